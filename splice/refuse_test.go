package splice

import (
	"context"
	"errors"
	"net"
	"sync"
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

// closingSource is a tunnel side that, as a ktls.Conn meeting the peer's
// fatal alert, closes its socket inside Read and only then returns the
// error: here once the other direction's write has met the closed socket.
type closingSource struct {
	opaqueConn
	writeFailed chan struct{}
	once        *sync.Once
}

var errTestRefused = errors.New("test: refused")

func (c closingSource) Read(p []byte) (int, error) {
	c.Conn.Close()
	select {
	case <-c.writeFailed:
	case <-time.After(5 * time.Second):
	}
	return 0, errTestRefused
}

func (c closingSource) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err != nil {
		c.once.Do(func() { close(c.writeFailed) })
	}
	return n, err
}

// A source's refusal still travels when its connection closed itself
// first, so that the other direction's write failed before the refusal was
// read: the closed sink is not taken for the tunnel's failure.
func TestRelayRefusalAfterTheSourceClosedItsSocket(t *testing.T) {
	tp := newTopology(t)
	a := endRecorder{opaqueConn{tp.relayA}, make(chan string, 2)}
	b := closingSource{opaqueConn{tp.relayB}, make(chan struct{}), new(sync.Once)}
	go func() {
		// The user's bytes in flight: the relay writes them to b.
		chunk := make([]byte, 32<<10)
		for {
			if _, err := tp.client.Write(chunk); err != nil {
				return
			}
		}
	}()
	refused := func(err error) bool { return errors.Is(err, errTestRefused) }
	st, err := New(a, b, Options{Pipes: newTestPool(t, 4), Refused: refused}).Run(context.Background())
	if err == nil || st.BToA.End != EndError || !refused(st.BToA.Err) {
		t.Errorf("relay: %v, b->a ended %v with %v; want the refusal", err, st.BToA.End, st.BToA.Err)
	}
	if err != nil && !refused(err) {
		t.Errorf("relay error %v names the closed sink, want the refusal", err)
	}
	select {
	case got := <-a.ended:
		if got != "refuse" {
			t.Errorf("user side ended with %s, want refuse", got)
		}
	default:
		t.Error("user side was neither refused nor aborted")
	}
}
