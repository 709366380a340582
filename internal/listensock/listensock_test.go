package listensock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"
)

// checkLeaks fails t if, once t's other cleanups ran, the process holds
// more goroutines or descriptors than now, or a socket is left
// registered. It undoes StopAccepting for the next test.
func checkLeaks(t *testing.T) {
	t.Helper()
	goroutines, fds := runtime.NumGoroutine(), openFDs(t)
	t.Cleanup(func() {
		mu.Lock()
		left := len(sockets)
		stopped, paused, stoppedAddrs = false, false, nil
		mu.Unlock()
		if left > 0 {
			t.Errorf("%d sockets left registered", left)
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			g, f := runtime.NumGoroutine(), openFDs(t)
			if g <= goroutines && f <= fds {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				t.Errorf("leak: %d goroutines (were %d), %d descriptors (were %d)\n%s",
					g, goroutines, f, fds, buf[:runtime.Stack(buf, true)])
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// listenT listens on the tcp-handoff address as a configuration does.
func listenT(t *testing.T, hostport string) *listener {
	t.Helper()
	ln, err := listenAddr(hostport)
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

func listenAddr(hostport string) (*listener, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, err
	}
	got, err := listen(context.Background(), Network, host, port, 0, net.ListenConfig{})
	if err != nil {
		return nil, err
	}
	return got.(*listener), nil
}

// inode returns the socket's inode, which fstat reports and /proc/self/fd
// names (socket:[inode]).
func inode(t *testing.T, ln *listener) uint64 {
	t.Helper()
	rc, err := ln.s.ln.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	var serr error
	rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) })
	if serr != nil {
		t.Fatal(serr)
	}
	return st.Ino
}

// waiting waits until n Accepts wait on s.
func waiting(t *testing.T, s *socket, n int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		got := len(s.waiters)
		mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d Accepts wait, want %d", got, n)
		}
	}
}

// A reload's two configurations share one socket: the connections queued
// while both held it are all accepted by the one left, with their bytes.
func TestReloadKeepsSocket(t *testing.T) {
	checkLeaks(t)
	first := listenT(t, "127.0.0.1:0")
	addr := first.Addr().String()
	second := listenT(t, addr)
	defer second.Close()
	if first.s != second.s || inode(t, first) != inode(t, second) {
		t.Fatalf("the second listen of %s has socket inode %d, the first %d: want one socket", addr, inode(t, second), inode(t, first))
	}
	ino := inode(t, first)

	const n = 20
	var clients []net.Conn
	for i := range n + 1 {
		if i == n {
			first.Close() // the old configuration unloads
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		defer c.Close()
		if _, err := fmt.Fprintf(c, "conn %02d\n", i); err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	if got := inode(t, second); got != ino {
		t.Errorf("socket inode %d after the first configuration closed, want %d", got, ino)
	}
	seen := map[string]bool{}
	for range n + 1 {
		s, err := second.Accept()
		if err != nil {
			t.Fatalf("Accept: %v", err)
		}
		line := make([]byte, 8)
		if _, err := io.ReadFull(s, line); err != nil {
			t.Fatal(err)
		}
		seen[string(line)] = true
		s.Write(line)
		s.Close()
	}
	if len(seen) != n+1 {
		t.Errorf("accepted %d distinct connections, want %d", len(seen), n+1)
	}
	for i, c := range clients {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		got, err := io.ReadAll(c)
		if want := fmt.Sprintf("conn %02d\n", i); string(got) != want || err != nil {
			t.Errorf("client %d read %q, %v; want %q", i, got, err, want)
		}
	}
	// Nothing else was accepted: the next Accept waits.
	done := make(chan error, 1)
	go func() { _, err := second.Accept(); done <- err }()
	select {
	case err := <-done:
		t.Fatalf("a further Accept returned %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	second.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
	}
	// The last configuration closed the socket.
	if c, err := net.Dial("tcp", addr); err == nil {
		c.Close()
		t.Errorf("dial %s after the last close succeeded", addr)
	}
}

// Close ends the wrapper's own blocked Accept only, and the connection
// goes to the other wrapper's.
func TestCloseEndsOwnAccept(t *testing.T) {
	checkLeaks(t)
	a := listenT(t, "127.0.0.1:0")
	b := listenT(t, a.Addr().String())
	defer b.Close()
	accept := func(l *listener) chan result {
		ch := make(chan result, 1)
		go func() { c, err := l.Accept(); ch <- result{c, err} }()
		return ch
	}
	ra := accept(a)
	waiting(t, a.s, 1)
	rb := accept(b)
	waiting(t, a.s, 2)
	a.Close()
	if r := <-ra; !errors.Is(r.err, net.ErrClosed) {
		t.Fatalf("closed wrapper's Accept = %v, %v; want net.ErrClosed", r.c, r.err)
	}
	select {
	case r := <-rb:
		t.Fatalf("the other wrapper's Accept returned %v, %v on Close", r.c, r.err)
	case <-time.After(100 * time.Millisecond):
	}
	c, err := net.Dial("tcp", a.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := <-rb
	if r.err != nil {
		t.Fatalf("Accept = %v", r.err)
	}
	if r.c.RemoteAddr().String() != c.LocalAddr().String() {
		t.Errorf("accepted %s, dialed from %s", r.c.RemoteAddr(), c.LocalAddr())
	}
	r.c.Close()
	if _, err := a.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept of a closed wrapper = %v, want net.ErrClosed", err)
	}
	if err := a.Close(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("second Close = %v, want net.ErrClosed", err)
	}
}

// The socket is bound without SO_REUSEPORT: Caddy's own "tcp" bind of the
// address, which sets it, fails, as does a plain bind.
func TestSecondBindFails(t *testing.T) {
	checkLeaks(t)
	ln := listenT(t, "127.0.0.1:0")
	defer ln.Close()
	addr := ln.Addr().String()
	if l, err := net.Listen("tcp", addr); !errors.Is(err, syscall.EADDRINUSE) {
		if l != nil {
			l.Close()
		}
		t.Errorf("net.Listen %s = %v, want EADDRINUSE", addr, err)
	}
	na, err := caddy.ParseNetworkAddress("tcp/" + addr)
	if err != nil {
		t.Fatal(err)
	}
	if l, err := na.Listen(context.Background(), 0, net.ListenConfig{}); !errors.Is(err, syscall.EADDRINUSE) {
		if l != nil {
			l.(net.Listener).Close()
		}
		t.Errorf("Caddy's tcp/%s (SO_REUSEPORT) = %v, want EADDRINUSE", addr, err)
	}
	// And a tcp-handoff listen of a port another socket holds says so.
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	_, err = listenAddr(other.Addr().String())
	if !errors.Is(err, syscall.EADDRINUSE) || !strings.Contains(err.Error(), "tcp-handoff/"+other.Addr().String()) {
		t.Errorf("listen of a port in use = %v, want EADDRINUSE naming the address", err)
	}
}

func TestListenRefusesName(t *testing.T) {
	checkLeaks(t)
	if _, err := listenAddr("localhost:9443"); err == nil || !strings.Contains(err.Error(), "tcp-handoff/localhost:9443") || !strings.Contains(err.Error(), "not an IP address") {
		t.Errorf("listen localhost:9443 = %v, want a refusal of the name", err)
	}
}

func TestCanonical(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1:9443":        "127.0.0.1:9443",
		":9443":                 "[::]:9443",
		"0.0.0.0:9443":          "[::]:9443",
		"[::]:9443":             "[::]:9443",
		"[::ffff:10.0.0.1]:443": "10.0.0.1:443",
		"[2001:DB8::1]:443":     "[2001:db8::1]:443",
	} {
		if got, _, err := canonical(in); got != want || err != nil {
			t.Errorf("canonical(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

// fileOf returns a duplicate descriptor of a net.Listener, Conn or
// PacketConn.
func fileOf(t *testing.T, x interface{ File() (*os.File, error) }) *os.File {
	t.Helper()
	f, err := x.File()
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// Adopt refuses what is not a listening TCP socket of the address, and a
// second socket of an address; the socket it takes is the one a listen
// of the address uses.
func TestAdopt(t *testing.T) {
	checkLeaks(t)
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer tcp.Close()
	addr := tcp.Addr().String()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	udp, err := net.ListenPacket("udp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer udp.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()

	for _, tc := range []struct {
		name, addr string
		f          *os.File
		want       string
	}{
		{"a connection", addr, fileOf(t, conn.(*net.TCPConn)), "does not listen"},
		{"UDP", addr, fileOf(t, udp.(*net.UDPConn)), "a UDP socket"},
		{"a pipe", addr, r, "not a socket"},
		{"another port", addr, fileOf(t, other.(*net.TCPListener)), "is bound to " + other.Addr().String()},
		{"a name", "localhost:" + strings.Split(addr, ":")[1], fileOf(t, tcp.(*net.TCPListener)), "not an IP address"},
		{"port 0", "127.0.0.1:0", fileOf(t, tcp.(*net.TCPListener)), "port 0"},
	} {
		err := Adopt(tc.addr, tc.f)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.addr) {
			t.Errorf("Adopt of %s = %v; want an error naming %s and saying %q", tc.name, err, tc.addr, tc.want)
		}
		if tc.f != r {
			tc.f.Close()
		}
	}

	f := fileOf(t, tcp.(*net.TCPListener))
	if err := Adopt(addr, f); err != nil {
		t.Fatal(err)
	}
	if err := Adopt(addr, f); err == nil || !strings.Contains(err.Error(), "holds a socket of "+addr) {
		t.Errorf("second Adopt of %s = %v, want a refusal", addr, err)
	}
	f.Close()
	// An unclaimed adopted socket is exported.
	ex, err := Export()
	if err != nil {
		t.Fatal(err)
	}
	if len(ex) != 1 || ex[0].Address != addr {
		t.Errorf("Export = %v, want the adopted %s", ex, addr)
	}
	for _, e := range ex {
		e.File.Close()
	}

	ln := listenT(t, addr)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	ln.Close()
	// The original descriptor holds the socket open still.
	if got := tcp.(*net.TCPListener).Addr().String(); got != addr {
		t.Fatal(got)
	}
	c2, err := net.Dial("tcp", addr)
	if err != nil {
		t.Errorf("dial after the adopted socket's last wrapper closed: %v (the original descriptor still holds it)", err)
	} else {
		c2.Close()
	}
}

// A tcp-handoff socket rides out a shortage of descriptors as tcp-retry
// does, and a wrapper's Close ends its Accept during the backoff.
func TestHandoffRetry(t *testing.T) {
	checkLeaks(t)
	ln := listenT(t, "127.0.0.1:0")
	core, logs := observer.New(zapcore.WarnLevel)
	var script []error
	mu.Lock()
	s := ln.s
	s.logger = zap.New(core)
	s.accept = func() (net.Conn, error) {
		mu.Lock()
		var err error
		if len(script) > 0 {
			err, script = script[0], script[1:]
		}
		mu.Unlock()
		if err != nil {
			return nil, err
		}
		return s.ln.Accept()
	}
	script = []error{acceptErr(syscall.EMFILE), acceptErr(syscall.ENFILE), acceptErr(syscall.EMFILE)}
	mu.Unlock()

	before := acceptRetries.Load()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got, err := ln.Accept()
	if err != nil {
		t.Fatalf("Accept = %v; want the connection after the shortage", err)
	}
	if got.RemoteAddr().String() != c.LocalAddr().String() {
		t.Errorf("accepted %s, dialed from %s", got.RemoteAddr(), c.LocalAddr())
	}
	got.Close()
	if n := acceptRetries.Load() - before; n != 3 {
		t.Errorf("%d retries counted, want 3", n)
	}
	if n := logs.FilterMessage("accept failed for lack of resources; retrying").Len(); n != 3 {
		t.Errorf("%d WARN lines, want 3", n)
	}

	// Another error goes to the Accept.
	mu.Lock()
	script = []error{acceptErr(syscall.EINVAL)}
	mu.Unlock()
	if _, err := ln.Accept(); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("Accept = %v, want EINVAL passed through", err)
	}

	// Close during a backoff ends Accept and the accepting goroutine.
	mu.Lock()
	for range 100 {
		script = append(script, acceptErr(syscall.EMFILE))
	}
	mu.Unlock()
	done := make(chan error, 1)
	go func() { _, err := ln.Accept(); done <- err }()
	// 3 retries above, and 9 here: the backoff reached its 1s cap.
	for acceptRetries.Load()-before < 12 {
		time.Sleep(time.Millisecond)
	}
	start := time.Now()
	ln.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
	}
	if d := time.Since(start); d > 300*time.Millisecond {
		t.Errorf("Close took %v during a backoff", d)
	}
}

// StopAccepting leaves the kernel's queue to another holder of the socket
// while this process's Accepts wait, refuses new listens, and
// ResumeAccepting gives the waiting Accepts connections again.
func TestStopAccepting(t *testing.T) {
	checkLeaks(t)
	ln := listenT(t, "127.0.0.1:0")
	addr := ln.Addr().String()
	got := make(chan net.Conn, 2)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(got)
				return
			}
			got <- c
		}
	}()
	waiting(t, ln.s, 1)
	StopAccepting()
	StopAccepting()
	// A connection queues for whoever else holds the socket (f): nothing
	// here takes it, though an Accept waits.
	f := fileOf(t, ln.s.ln)
	defer f.Close()
	fl, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dial after StopAccepting: %v", err)
	}
	defer c.Close()
	s, err := fl.Accept()
	if err != nil {
		t.Fatal(err)
	}
	if s.RemoteAddr().String() != c.LocalAddr().String() {
		t.Errorf("the other holder accepted %s, dialed from %s", s.RemoteAddr(), c.LocalAddr())
	}
	s.Close()
	if _, err := listenAddr(addr); err == nil || !strings.Contains(err.Error(), "tcp-handoff/"+addr) {
		t.Errorf("listen after StopAccepting = %v, want a refusal naming the address", err)
	}
	// The handoff failed: this process accepts again, its waiting Accept
	// first.
	ResumeAccepting()
	ResumeAccepting()
	fl.Close()
	c2, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	a := <-got
	if a.RemoteAddr().String() != c2.LocalAddr().String() {
		t.Errorf("after ResumeAccepting the waiting Accept got %s, dialed from %s", a.RemoteAddr(), c2.LocalAddr())
	}
	a.Close()
	ln.Close()
	if _, open := <-got; open {
		t.Error("the Accept loop got a connection after Close")
	}
}

// Held counts, once the process stopped accepting, the connections it
// accepted from its stopped sockets and still holds, and nothing else: not
// the listening socket or a duplicate of it, the client's end dialed from
// this process, a connection accepted by another listener, or a UDP socket
// on the same port. A wildcard socket's connections count whatever
// address they came to, and an MPTCP connection counts as a TCP one.
func TestHeld(t *testing.T) {
	checkLeaks(t)
	ln := listenT(t, "127.0.0.1:0")
	wild := listenT(t, ":0")
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	udp, err := net.ListenPacket("udp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer udp.Close()
	accept := func(l net.Listener, dial string) (client, server net.Conn) {
		t.Helper()
		c, err := net.Dial("tcp", dial)
		if err != nil {
			t.Fatal(err)
		}
		s, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		return c, s
	}
	held := func(want int) {
		t.Helper()
		if n, err := Held(); n != want || err != nil {
			t.Errorf("Held() = %d, %v; want %d", n, err, want)
		}
	}
	c1, s1 := accept(ln, ln.Addr().String())
	defer c1.Close()
	held(0) // accepting: nothing is handed over
	_, port, _ := net.SplitHostPort(wild.Addr().String())
	c2, s2 := accept(wild, "127.0.0.1:"+port)
	defer c2.Close()
	c3, s3 := accept(other, other.Addr().String())
	defer c3.Close()
	defer s3.Close()
	// A client that speaks MPTCP: where the kernel has it, the socket
	// accepted from Go's listener (MPTCP by default) is an MPTCP one.
	var d net.Dialer
	d.SetMultipathTCP(true)
	c5, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c5.Close()
	s5, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	dup := fileOf(t, ln.s.ln)
	defer dup.Close()
	StopAccepting()
	held(3)
	s1.Close()
	held(2)
	s2.Close()
	held(1)
	s5.Close()
	held(0)
	ResumeAccepting()
	c4, s4 := accept(ln, ln.Addr().String())
	defer c4.Close()
	defer s4.Close()
	held(0)
	ln.Close()
	wild.Close()
}

// serve accepts from ln as caddy-l4 does until Accept fails, and answers
// each connection with tag and the 8 bytes it read; it returns the
// connections accepted and Accept's error.
func serve(ln net.Listener, tag byte) (int, error) {
	var wg sync.WaitGroup
	defer wg.Wait()
	n := 0
	for {
		c, err := ln.Accept()
		if err != nil {
			return n, err
		}
		n++
		wg.Go(func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			var id [8]byte
			if _, err := io.ReadFull(c, id[:]); err != nil {
				return
			}
			c.Write(append([]byte{tag}, id[:]...))
		})
	}
}

// dialOnce sends id and returns the tag of the process that answered.
func dialOnce(addr string, id uint64) (byte, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	var b [9]byte
	binary.BigEndian.PutUint64(b[1:], id)
	if _, err := c.Write(b[1:]); err != nil {
		return 0, err
	}
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return 0, err
	}
	if binary.BigEndian.Uint64(b[1:]) != id {
		return 0, fmt.Errorf("connection %d answered for %d", id, binary.BigEndian.Uint64(b[1:]))
	}
	return b[0], nil
}

// A socket with no Accept waiting accepts nothing: its connections stay
// in the kernel's queue, for another holder of the socket (here a
// duplicate descriptor, as in the process that adopted it).
func TestIdleSocketAcceptsNothing(t *testing.T) {
	checkLeaks(t)
	a := listenT(t, "127.0.0.1:0")
	b := listenT(t, a.Addr().String()) // a configuration that does not accept yet
	defer b.Close()
	done := make(chan error, 1)
	go func() { _, err := a.Accept(); done <- err }()
	waiting(t, a.s, 1)
	a.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Close = %v", err)
	}
	f := fileOf(t, a.s.ln)
	defer f.Close()
	other, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	other.(*net.TCPListener).SetDeadline(time.Now().Add(2 * time.Second))
	for i := range 10 {
		c, err := net.Dial("tcp", a.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := other.Accept()
		if err != nil {
			mu.Lock()
			n := len(a.s.pending)
			mu.Unlock()
			t.Fatalf("connection %d: the other holder's Accept = %v; %d connections were taken here with no Accept waiting", i, err, n)
		}
		s.Close()
	}
}
