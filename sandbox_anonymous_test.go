package caddyktls

import (
	"crypto/tls"
	"encoding/base64"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// Under client_auth verify_if_given a connection without a certificate
// completes its handshake and is refused by the sandbox handler: anyone
// who reaches the port can do that, as anyone can fail a handshake under
// require_and_verify, and it is logged the same way. 50 anonymous
// connections are 50 DEBUG lines, each with its peer and reason, one WARN
// summary (at the first; the next one, a minute later at the earliest,
// counts the rest: TestFailureSummaryAggregates) and 50 in the reason's
// series; nothing is dialed.
func TestSandboxAnonymousRejectSummary(t *testing.T) {
	const n, reason = 50, string(forward.ReasonNoClientCertificate)
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxConfig(t, nil)
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
	policy := e.route()["handle"].([]any)[0].(map[string]any)["connection_policies"].([]any)[0].(map[string]any)
	policy["client_authentication"] = map[string]any{
		"mode":             "verify_if_given",
		"trusted_ca_certs": []string{base64.StdEncoding.EncodeToString(e.ca.Cert.Raw)},
	}
	e.start(t)
	forwardtest.CheckLeaks(t)
	metrics0, before := e.metrics(t), forwarder.Tunnels().RefusedTunnels()[reason]
	for i := range n {
		c, err := tls.Dial("tcp", e.addr, e.tlsConfig(nil))
		if err != nil {
			t.Fatalf("anonymous connection %d: the handshake failed (%v); verify_if_given completes it", i, err)
		}
		c.Write(e.gw.Frame(t, "sbx-anonymous", up.Addr()))
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if b, _ := io.ReadAll(c); len(b) != 0 {
			t.Errorf("anonymous connection %d read %d bytes", i, len(b))
		}
		c.Close()
	}
	waitRejections(t, reason, before+n)
	waitUntil(t, 10*time.Second, func() bool { return len(e.logLines(t, rejectedMsg)) == n }, fmt.Sprintf("%d rejections logged", n))
	for _, l := range e.logLines(t, rejectedMsg) {
		if l["level"] != "debug" || l["reason"] != reason || l["peer"] == "" {
			t.Errorf("log line %v, want DEBUG with reason %s and the peer", l, reason)
		}
	}
	w := e.logLines(t, forwarder.AnonymousRefusalSummary)
	if len(w) != 1 || w[0]["level"] != "warn" || w[0]["first"] != true || w[0][reason] != 1.0 ||
		w[0]["details"] != `each at DEBUG ("sandbox tunnel rejected"); caddy_ktls_sandbox_rejects_total{reason="no-client-certificate"} counts them` {
		t.Errorf("summaries %v, want one WARN, at the first refusal", w)
	}
	if up.Accepted() != 0 {
		t.Errorf("upstream dialed %d times for anonymous clients", up.Accepted())
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{rejectSeries(reason): n})
}
