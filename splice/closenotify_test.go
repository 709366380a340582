package splice

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// notifier is a source that says whether its stream ended with close_notify.
type notifier struct {
	opaqueConn
	notified bool
}

func (c notifier) CloseNotified() bool { return c.notified }

// Options.RequireCloseNotify: a source that ended without close_notify
// fails its direction with ErrTruncated and the sink is aborted; with it,
// or for a source that cannot tell (no CloseNotifier), the end is orderly
// and the sink half-closed.
func TestRelayRequireCloseNotify(t *testing.T) {
	for _, c := range []struct {
		name      string
		source    func(net.Conn) net.Conn
		truncated bool
	}{
		{"notified", func(c net.Conn) net.Conn { return notifier{opaqueConn{c}, true} }, false},
		{"not notified", func(c net.Conn) net.Conn { return notifier{opaqueConn{c}, false} }, true},
		{"no CloseNotifier", func(c net.Conn) net.Conn { return c }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			tp := newTopology(t)
			b := endRecorder{opaqueConn{tp.relayB}, make(chan string, 2)}
			wait := runRelay(context.Background(), New(c.source(tp.relayA), b, Options{
				Pipes:              newTestPool(t, 4),
				RequireCloseNotify: [2]bool{AToB: true},
			}))
			if _, err := tp.client.Write([]byte("request")); err != nil {
				t.Fatal(err)
			}
			tp.client.CloseWrite()
			tp.upstream.SetReadDeadline(time.Now().Add(10 * time.Second))
			got, rerr := io.ReadAll(tp.upstream)
			if c.truncated {
				tp.upstream.Close()
				_, err := wait()
				if !errors.Is(err, ErrTruncated) {
					t.Errorf("relay: %v, want ErrTruncated", err)
				}
				select {
				case e := <-b.ended:
					if e != "abort" {
						t.Errorf("sink ended with %s, want abort", e)
					}
				default:
					t.Error("sink was closed in order, want abort")
				}
				return
			}
			if rerr != nil || string(got) != "request" {
				t.Fatalf("upstream read %q, %v: want the request and an orderly end", got, rerr)
			}
			tp.upstream.CloseWrite()
			if _, err := wait(); err != nil {
				t.Errorf("relay: %v, want an orderly end", err)
			}
		})
	}
}
