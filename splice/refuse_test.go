package splice

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"
)

// endRecorder is a sink that records how the relay ended it.
type endRecorder struct {
	opaqueConn
	ended chan string
}

func (c endRecorder) Refuse() error { c.ended <- "refuse"; return c.Conn.Close() }
func (c endRecorder) Abort() error  { c.ended <- "abort"; return c.Conn.Close() }

// A direction whose source refuses before it delivered a byte ends its sink
// with Refuse when Options.Refused recognizes the error, and with Abort
// otherwise or once a byte went through.
func TestRelayRefusalTravels(t *testing.T) {
	isReset := func(err error) bool { return errors.Is(err, syscall.ECONNRESET) }
	for _, c := range []struct {
		name    string
		refused func(error) bool
		first   []byte // what upstream sends before its reset
		want    string
	}{
		{"refused", isReset, nil, "refuse"},
		{"no Refused option", nil, nil, "abort"},
		{"another error", func(error) bool { return false }, nil, "abort"},
		{"after a byte", isReset, []byte("x"), "abort"},
	} {
		t.Run(c.name, func(t *testing.T) {
			tp := newTopology(t)
			a := endRecorder{opaqueConn{tp.relayA}, make(chan string, 2)}
			wait := runRelay(context.Background(), New(a, tp.relayB, Options{Pipes: newTestPool(t, 4), Refused: c.refused}))
			if len(c.first) > 0 {
				if _, err := tp.upstream.Write(c.first); err != nil {
					t.Fatal(err)
				}
				buf := make([]byte, len(c.first))
				tp.client.SetReadDeadline(time.Now().Add(10 * time.Second))
				if _, err := tp.client.Read(buf); err != nil {
					t.Fatal(err)
				}
			}
			resetClose(t, tp.upstream)
			_, err := wait()
			if err == nil {
				t.Fatal("relay ended without error after a reset")
			}
			select {
			case got := <-a.ended:
				if got != c.want {
					t.Errorf("sink ended with %s, want %s", got, c.want)
				}
			default:
				t.Errorf("sink was neither refused nor aborted (closed in order), want %s", c.want)
			}
		})
	}
}

var _ net.Conn = endRecorder{}
