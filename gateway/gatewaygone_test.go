package gateway

import (
	"crypto/tls"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// A gateway that leaves (a reset) after its preamble verified is refused
// gateway-gone before the forwarder dials the target, or, where the first
// dial failed and Wake is on, before it wakes the sandbox: nothing is
// dialed or woken for nobody.
func TestForwarderRefusesGoneGateway(t *testing.T) {
	for _, tc := range []struct {
		name string
		at   forward.Step // where the forwarder waits for the gateway to leave
		wake bool
	}{
		{"before the dial", forward.StepPreambleVerify, false},
		{"before the wake", forward.StepDial, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			p := newPKI(t)
			gw := forwardtest.NewGateway(t, "gw-1")
			up := forwardtest.NewUpstream(t, 4<<10)
			target := up.Addr()
			var wakes atomic.Int32
			var waker *forward.Waker
			if tc.wake {
				// A target that refuses: its sandbox sleeps.
				target = forwardtest.ClosedPort(t)
				cp := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { wakes.Add(1) }))
				t.Cleanup(cp.Close)
				var err error
				if waker, err = forward.NewWaker(forward.WakerConfig{URL: cp.URL}); err != nil {
					t.Fatal(err)
				}
			}
			reached, hold := make(chan struct{}, 1), make(chan struct{})
			f := startForwarderWith(t, p, gw, "127.0.0.0/8", func(c *forward.Config) {
				c.Wake = waker
				c.OnStep = func(s forward.Step, _ time.Duration) {
					if s == tc.at {
						reached <- struct{}{}
						<-hold
					}
				}
			})
			conn, err := tls.Dial("tcp", f.addr(), p.client)
			if err != nil {
				t.Fatal(err)
			}
			if err := preamble.Send(t.Context(), conn, gw.Signer, preamble.Claims{SandboxID: "sbx-gone", Target: target}); err != nil {
				t.Fatal(err)
			}
			<-reached
			raw := conn.NetConn().(*net.TCPConn)
			local := raw.LocalAddr().String()
			raw.SetLinger(0)
			raw.Close()
			waitUntil(t, "the gateway's reset at the forwarder's socket", func() bool { return !forwardtest.Established(t, f.addr(), local) })
			close(hold)
			_, errs := f.served(t, 1)
			if got := forward.ReasonOf(errs[0]); got != string(forward.ReasonGatewayGone) {
				t.Errorf("Serve: %v (reason %q), want refused %s", errs[0], got, forward.ReasonGatewayGone)
			}
			if n := up.Accepted(); n != 0 {
				t.Errorf("the sandbox got %d connections, want none", n)
			}
			if n := wakes.Load(); n != 0 {
				t.Errorf("the control plane was asked %d times to wake the sandbox, want none", n)
			}
			if _, opened := f.reg.Counts(); opened != 0 {
				t.Errorf("the forwarder opened %d tunnels, want none", opened)
			}
		})
	}
}
