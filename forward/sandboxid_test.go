package forward

import (
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Close names a sandbox case-insensitively: a close of SBX-R2 ends the
// tunnels of sbx-r2 (the form a verified preamble carries) and refuses
// sbx-r2; an ID that is not valid even lowercased is refused with the
// rule, and changes nothing.
func TestRegistryCloseSandboxIDCase(t *testing.T) {
	reg := NewRegistry()
	a, actx, err := reg.Open("sbx-r2", "10.0.0.1:1", Origin{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for _, id := range []string{"..", ".", ".a", "sbx/r2"} {
		_, err := reg.Close(CloseRequest{Sandbox: id, RefuseFor: time.Minute})
		if preamble.ReasonOf(err) != string(preamble.ReasonBadSandboxID) || !strings.Contains(err.Error(), "[a-z0-9._-]") {
			t.Errorf("Close(%q): %v, want a bad-sandbox-id error that gives the rule", id, err)
		}
	}
	if actx.Err() != nil || len(reg.Refusals()) != 0 {
		t.Fatal("a refused close ended a tunnel or refused a sandbox")
	}
	res, err := reg.Close(CloseRequest{Sandbox: "SBX-R2", RefuseFor: time.Minute})
	if err != nil || len(res.Tunnels) != 1 || res.Tunnels[0].ID != a.ID || actx.Err() == nil {
		t.Fatalf("Close(SBX-R2): %+v, %v; want sbx-r2's tunnel %d ended", res, err, a.ID)
	}
	if r := reg.Refusals(); len(r) != 1 || r[0].Sandbox != "sbx-r2" {
		t.Errorf("refusals %+v, want sbx-r2 alone", r)
	}
	if _, _, err := reg.Open("sbx-r2", "10.0.0.1:1", Origin{}, 0); ReasonOf(err) != string(ReasonSandboxClosed) {
		t.Errorf("Open(sbx-r2) after a close of SBX-R2: %v, want %s", err, ReasonSandboxClosed)
	}
}
