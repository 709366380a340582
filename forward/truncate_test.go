package forward

import (
	"errors"
	"net"
	"syscall"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// notifierConn is a gateway's connection that says whether its stream
// ended with close_notify, as *ktls.Conn does (splice.CloseNotifier).
type notifierConn struct {
	*net.TCPConn
	notified bool
}

func (c *notifierConn) CloseNotified() bool { return c.notified }

// A gateway's stream that ends without close_notify was cut (a gateway
// that died): the target reads what came and then a reset, never an
// orderly end that would make a truncated request look complete. With
// close_notify the target gets its FIN.
func TestServeTruncatedTunnelResetsTarget(t *testing.T) {
	for _, c := range []struct {
		name     string
		notified bool
	}{
		{"close_notify", true},
		{"no close_notify", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			up := forwardtest.NewUpstream(t, 0)
			f := newFixture(t, nil)
			b, a := forwardtest.TCPPair(t)
			defer b.Close()
			request := []byte("POST /upload: the first half of it")
			if _, err := b.Write(append(f.gw.Frame(t, "sbx-1", up.Addr()), request...)); err != nil {
				t.Fatal(err)
			}
			b.CloseWrite()
			_, err := f.fwd.Serve(Gateway{Conn: &notifierConn{TCPConn: a, notified: c.notified}, Peer: "gw"})
			up.Close()
			r := up.Results()[0]
			if c.notified {
				if err != nil || r.ReadErr != nil || r.Received != int64(len(request)) {
					t.Fatalf("Serve: %v; target read %d bytes, %v: want all %d and an orderly end", err, r.Received, r.ReadErr, len(request))
				}
				return
			}
			if !errors.Is(err, splice.ErrTruncated) {
				t.Errorf("Serve: %v, want splice.ErrTruncated", err)
			}
			if !errors.Is(r.ReadErr, syscall.ECONNRESET) || r.Received > int64(len(request)) {
				t.Errorf("target read %d bytes, then %v: want at most %d, then a reset", r.Received, r.ReadErr, len(request))
			}
		})
	}
}
