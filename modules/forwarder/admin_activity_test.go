package forwarder

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward"
)

// GET /sandbox/activity's last_report is null until a report was taken,
// never a report of zero values; then it names the latest report.
func TestActivityLastReportNullBeforeFirst(t *testing.T) {
	reg := forward.NewRegistry()
	body, err := json.Marshal(activityOfRegistry(reg))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(body), `"last_report":null`) {
		t.Errorf("before any report: %s, want last_report null", body)
	}
	tun, _, err := reg.Open("sbx-a", "10.0.0.1:80", forward.Origin{Peer: "peer"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	tun.AddToSandbox(10)
	tun.Close()
	rep, ok := reg.TakeReport("fwd-1")
	if !ok {
		t.Fatal("no report taken")
	}
	var got struct {
		LastReport *forward.ReportID `json:"last_report"`
	}
	body, err = json.Marshal(activityOfRegistry(reg))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatal(err)
	}
	if got.LastReport == nil || got.LastReport.ID != rep.ID || got.LastReport.Sequence != 1 || got.LastReport.Instance != "fwd-1" {
		t.Errorf("after a report: last_report %+v (%s), want report %s, sequence 1", got.LastReport, body, rep.ID)
	}
}
