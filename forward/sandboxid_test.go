package forward

import (
	"bytes"
	"crypto/ed25519"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
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

// A frame that names a sandbox in another case than the canonical
// lowercase, or by dots, authentic as it may be (signed by a trusted key,
// so no gateway of this module wrote it), is refused bad-sandbox-id and
// counted before its target is dialed: no spelling of a sandbox opens a
// tunnel that its limits and refusals do not see.
func TestForwarderRefusesNonCanonicalSandboxID(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	f := newFixture(t, func(c *Config) { c.MaxTunnelsPerSandbox = 1 })
	// resign returns f.gw's frame for sandbox "sbx-xx" with the ID's bytes
	// replaced by id (as long), signed again.
	resign := func(id string) []byte {
		frame := f.gw.Frame(t, "sbx-xx", up.Addr())
		i := bytes.Index(frame, []byte("\x06sbx-xx"))
		copy(frame[i+1:], id)
		body := frame[:len(frame)-preamble.SignatureLen]
		return append(body, ed25519.Sign(f.gw.Key, append([]byte(preamble.SignatureContext), body...))...)
	}
	for i, id := range []string{"SBX-XX", "Sbx-xx", "..sbx-", ".sbx-x"} {
		err := f.refused(t, i+1, string(preamble.ReasonBadSandboxID), func(c *net.TCPConn) { c.Write(resign(id)) })
		if !strings.Contains(err.Error(), id) {
			t.Errorf("sandbox %q: error %v does not name the ID", id, err)
		}
	}
	if n := f.reg.RefusedTunnels()[string(preamble.ReasonBadSandboxID)]; n != 4 {
		t.Errorf("rejections[bad-sandbox-id] = %d, want 4", n)
	}
	if up.Accepted() != 0 || len(f.reg.Activity()) != 0 {
		t.Errorf("the upstream accepted %d connections, the registry knows %+v; want none", up.Accepted(), f.reg.Activity())
	}
}
