package listensock

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
)

// alert is what a shed connection reads: ktls.Shed's access_denied record.
var alert = []byte{21, 3, 3, 0, 2, 2, 49}

// fakeShedder sheds while shed is set, and records whom. With admitAfter
// set, it admits from its admitAfter-th shed on (clears shed as it counts
// it), as a handler whose load fell: the listener asks ShedNow about the
// next connection only after Shed returned.
type fakeShedder struct {
	shed       atomic.Bool
	admitAfter int
	mu         sync.Mutex
	remotes    []string
}

func (f *fakeShedder) ShedNow() []zap.Field {
	if f.shed.Load() {
		return []zap.Field{zap.String("bound", "test")}
	}
	return nil
}

func (f *fakeShedder) Shed(remote net.Addr, why []zap.Field) {
	if len(why) != 1 || why[0].String != "test" {
		panic("Shed without ShedNow's fields")
	}
	f.mu.Lock()
	f.remotes = append(f.remotes, remote.String())
	if len(f.remotes) == f.admitAfter {
		f.shed.Store(false)
	}
	f.mu.Unlock()
}

// waitSheds returns whom f shed once it counted n, or after 5s: a
// listener counts a shed after its client read the alert and the end.
func (f *fakeShedder) waitSheds(n int) []string {
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if g := f.shedFrom(); len(g) >= n || time.Now().After(deadline) {
			return g
		}
	}
}

func (f *fakeShedder) shedFrom() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.remotes...)
}

// countingAccept counts the connections Go's accept returned.
type countingAccept struct {
	net.Listener
	n atomic.Int64
}

func (l *countingAccept) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// retryT listens on the tcp-retry address as a configuration does, Go's
// accepts counted.
func retryT(t *testing.T, hostport string) (*retryListener, *countingAccept) {
	t.Helper()
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		t.Fatal(err)
	}
	got, err := listenRetry(context.Background(), RetryNetwork, host, port, 0, net.ListenConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ln := got.(*retryListener)
	if ln.raw == nil {
		t.Fatal("the tcp-retry listener has no descriptor of its own to shed on")
	}
	counted := &countingAccept{Listener: ln.Listener}
	ln.Listener = counted
	return ln, counted
}

// handoffT is listenT with Go's accepts counted.
func handoffT(t *testing.T, hostport string) (*listener, *atomic.Int64) {
	t.Helper()
	ln := listenT(t, hostport)
	var n atomic.Int64
	mu.Lock()
	accept := ln.s.accept
	ln.s.accept = func() (net.Conn, error) {
		c, err := accept()
		if err == nil {
			n.Add(1)
		}
		return c, err
	}
	mu.Unlock()
	return ln, &n
}

// shedDial connects to addr as a gateway (a ClientHello's worth of bytes
// at once) and returns what it read to the end, and its local address.
func shedDial(t *testing.T, addr string) ([]byte, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write(make([]byte, 300))
	got, _ := io.ReadAll(c) // the end is a reset: nothing read the bytes
	return got, c.LocalAddr().String()
}

// While every handler registered for a listener's address would shed, the
// tcp-retry and tcp-handoff listeners shed each connection in its name,
// below Go's accept (after the first, which the accept waiting took): the
// client reads the alert and the end, the handler counts it with the
// client's address, and no Accept returns it. Once the handler admits,
// the next connection is accepted; once its configuration is unloaded
// (forget), the listener sheds nothing for it.
//
// The handler admits as it counts its fifth shed, before the listener
// asks it about the next connection: set from the test, after the fifth
// client read the end, the listener could still shed the next connection
// on an answer it got before (ShedNow, then accept(2) of whatever arrived
// meanwhile).
func TestShedBelowAccept(t *testing.T) {
	for _, network := range []string{Network, RetryNetwork} {
		t.Run(network, func(t *testing.T) {
			checkLeaks(t)
			var (
				ln       net.Listener
				goAccept func() int64
			)
			if network == Network {
				l, n := handoffT(t, "127.0.0.1:0")
				ln, goAccept = l, n.Load
			} else {
				l, counted := retryT(t, "127.0.0.1:0")
				ln, goAccept = l, counted.n.Load
			}
			addr := ln.Addr().String()
			got := make(chan net.Conn, 8)
			var acceptErr error // Accept's last, once got is closed
			go func() {
				defer close(got)
				for {
					c, err := ln.Accept()
					if err != nil {
						acceptErr = err
						return
					}
					got <- c
				}
			}()
			// However the test ends, Close ends the Accepts, and what
			// they returned is closed: no goroutine or descriptor left.
			closeLn := sync.OnceValue(ln.Close)
			defer func() {
				closeLn()
				for c := range got {
					c.Close()
				}
			}()
			accepted := func() net.Conn {
				t.Helper()
				select {
				case a, ok := <-got:
					if !ok {
						t.Fatalf("Accept failed: %v", acceptErr)
					}
					return a
				case <-time.After(10 * time.Second):
					t.Fatal("no Accept returned the connection")
				}
				return nil
			}

			f := &fakeShedder{admitAfter: 5}
			f.shed.Store(true)
			forget := Serves(netip.MustParseAddrPort(addr), f)
			defer forget()
			var want []string
			for range 5 {
				read, from := shedDial(t, addr)
				if !bytes.Equal(read, alert) {
					t.Fatalf("a shed connection read % x, want the alert % x and the end", read, alert)
				}
				want = append(want, from)
			}
			if g := f.waitSheds(len(want)); !slices.Equal(g, want) {
				t.Errorf("the handler counted sheds of %v, want %v", g, want)
			}
			if n := goAccept(); n > 1 {
				t.Errorf("Go's accept took %d of the 5 shed connections, want at most the first", n)
			}
			if len(got) != 0 {
				t.Fatal("an Accept returned a shed connection")
			}

			// The handler admits: the next connection is the Accept's.
			if f.shed.Load() {
				t.Fatal("the handler still sheds: it counted no fifth shed")
			}
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			a := accepted()
			if a.RemoteAddr().String() != c.LocalAddr().String() {
				t.Errorf("Accept returned %s, dialed from %s", a.RemoteAddr(), c.LocalAddr())
			}
			a.Close()

			// Its configuration is unloaded: nothing is shed for it.
			forget()
			f.shed.Store(true)
			c2, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c2.Close()
			a = accepted()
			if a.RemoteAddr().String() != c2.LocalAddr().String() {
				t.Errorf("Accept returned %s, dialed from %s", a.RemoteAddr(), c2.LocalAddr())
			}
			a.Close()
			if n := len(f.shedFrom()); n != 5 {
				t.Errorf("%d sheds counted, want the 5 before", n)
			}
			closeLn()
			for c := range got {
				t.Error("an Accept returned a connection after Close")
				c.Close()
			}
		})
	}
}

// A listener sheds only when every handler registered for its address
// would: one that admits is enough to accept. A wildcard listener serves
// every address of its port; a handler of another port or address is not
// its.
func TestShedForEveryHandler(t *testing.T) {
	shedding, admitting, other := new(fakeShedder), new(fakeShedder), new(fakeShedder)
	shedding.shed.Store(true)
	other.shed.Store(true)
	forget := []func(){
		Serves(netip.MustParseAddrPort("127.0.0.1:9443"), shedding),
		Serves(netip.MustParseAddrPort("[::ffff:127.0.0.2]:9443"), shedding), // as an IPv6 socket reports it
		Serves(netip.MustParseAddrPort("127.0.0.1:9444"), other),
	}
	defer func() {
		for _, f := range forget {
			f()
		}
	}()
	for _, c := range []struct {
		bound string
		shed  bool
	}{
		{"127.0.0.1:9443", true},
		{"127.0.0.2:9443", true},
		{"[::]:9443", true},
		{"127.0.0.3:9443", false},
		{"127.0.0.1:9445", false},
	} {
		if h, why := shedFor(netip.MustParseAddrPort(c.bound)); (h != nil) != c.shed || (h != nil) != (why != nil) {
			t.Errorf("shedFor(%s) = %v, %v; want shed %v", c.bound, h, why, c.shed)
		}
	}
	forget = append(forget, Serves(netip.MustParseAddrPort("127.0.0.1:9443"), admitting))
	if h, _ := shedFor(netip.MustParseAddrPort("127.0.0.1:9443")); h != nil {
		t.Error("a listener sheds though one of its handlers admits")
	}
	if h, _ := shedFor(netip.MustParseAddrPort("[::]:9443")); h != nil {
		t.Error("a wildcard listener sheds though one of its handlers admits")
	}
	if h, _ := shedFor(netip.MustParseAddrPort("127.0.0.2:9443")); h != shedding {
		t.Error("the handler that admits on 127.0.0.1 keeps 127.0.0.2's listener from shedding")
	}
}

// A listener waiting below Go's accept for connections to shed stops as
// an Accept waiting in Go's would: StopAccepting returns, and the
// connection that comes next queues for the process that took the socket
// over; after ResumeAccepting and Close, Accept ends. A tcp-retry
// listener's Close ends its wait too.
func TestShedWaitEnds(t *testing.T) {
	t.Run(Network, func(t *testing.T) {
		checkLeaks(t)
		ln, goAccept := handoffT(t, "127.0.0.1:0")
		addr := ln.Addr().String()
		f := new(fakeShedder)
		f.shed.Store(true)
		defer Serves(netip.MustParseAddrPort(addr), f)()
		done := make(chan error, 1)
		go func() {
			c, err := ln.Accept()
			if c != nil {
				c.Close()
			}
			done <- err
		}()
		waiting(t, ln.s, 1)
		waitShedWait(t, ln.s)
		stopped := make(chan struct{})
		go func() { StopAccepting(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(10 * time.Second):
			t.Fatal("StopAccepting did not return while the listener waited to shed")
		}
		fl := fileListener(t, ln.s)
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := fl.Accept()
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
		if n := len(f.shedFrom()); n != 0 || goAccept.Load() != 0 {
			t.Errorf("after StopAccepting this process shed %d and accepted %d connections, want none", n, goAccept.Load())
		}
		fl.Close()
		ResumeAccepting()
		ln.Close()
		if err := <-done; !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
		}
	})
	t.Run(RetryNetwork, func(t *testing.T) {
		checkLeaks(t)
		ln, _ := retryT(t, "127.0.0.1:0")
		f := new(fakeShedder)
		f.shed.Store(true)
		defer Serves(netip.MustParseAddrPort(ln.Addr().String()), f)()
		done := make(chan error, 1)
		go func() {
			_, err := ln.Accept()
			done <- err
		}()
		// Shed one, so that the listener waits below Go's accept.
		if read, _ := shedDial(t, ln.Addr().String()); !bytes.Equal(read, alert) {
			t.Fatalf("a shed connection read % x, want the alert", read)
		}
		ln.Close()
		select {
		case err := <-done:
			if !errors.Is(err, net.ErrClosed) {
				t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Close did not end an Accept waiting to shed")
		}
	})
}

// waitShedWait waits until s's goroutine accepts below Go's accept.
func waitShedWait(t *testing.T, s *socket) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		ready := s.raw != nil && s.accepting
		mu.Unlock()
		if ready {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the listener did not start shedding")
		}
	}
}

// fileListener is another holder of s's socket, as the process that takes
// it over.
func fileListener(t *testing.T, s *socket) net.Listener {
	t.Helper()
	f := fileOf(t, s.ln)
	defer f.Close()
	fl, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	return fl
}
