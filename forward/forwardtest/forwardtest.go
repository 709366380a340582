// Package forwardtest holds what the forwarder's tests share: a sandbox
// upstream that hashes what it receives while sending a deterministic
// stream, a gateway that signs preambles, transfer sizing from
// KTLS_TEST_MIB, and fd/goroutine leak checks.
package forwardtest

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// Gateway signs preambles like an edge gateway.
type Gateway struct {
	Signer *preamble.Signer
	Pub    ed25519.PublicKey
	// Key is the private key, for frames the Signer refuses to write.
	Key ed25519.PrivateKey
}

// NewGateway makes a gateway with a fresh Ed25519 key named keyID.
func NewGateway(t testing.TB, keyID string) *Gateway {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := preamble.NewSigner(keyID, priv)
	if err != nil {
		t.Fatal(err)
	}
	return &Gateway{Signer: s, Pub: pub, Key: priv}
}

// WithExtensionArea returns frame, signed by g's key and carrying no
// extensions, with area as its extension area, re-signed: a frame the
// Signer would refuse to write (a malformed value of a known extension).
func (g *Gateway) WithExtensionArea(t testing.TB, frame, area []byte) []byte {
	t.Helper()
	body := frame[:len(frame)-preamble.SignatureLen]
	if len(body) < 2 || body[len(body)-1] != 0 || body[len(body)-2] != 0 {
		t.Fatal("WithExtensionArea: frame already has extensions")
	}
	out := append(append([]byte(nil), body[:len(body)-2]...), byte(len(area)>>8), byte(len(area)))
	out = append(out, area...)
	bodyLen := len(out) - preamble.HeaderLen + preamble.SignatureLen
	out[6], out[7] = byte(bodyLen>>8), byte(bodyLen)
	sig := ed25519.Sign(g.Key, append([]byte(preamble.SignatureContext), out...))
	return append(out, sig...)
}

// Frame signs an unbound preamble for sandbox and target.
func (g *Gateway) Frame(t testing.TB, sandbox string, target netip.AddrPort) []byte {
	t.Helper()
	return g.Sign(t, preamble.Claims{SandboxID: sandbox, Target: target})
}

// Sign signs c as it is (validity, binding, extensions): for frames that
// are authentic but must be refused for what they claim.
func (g *Gateway) Sign(t testing.TB, c preamble.Claims) []byte {
	t.Helper()
	f, err := g.Signer.Sign(c)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// Upstream is a sandbox service: for each connection it hashes everything
// it receives until EOF while sending its reply, then half-closes and
// closes. It records each connection's results.
type Upstream struct {
	ln       *net.TCPListener
	reply    func(conn int, clientDone <-chan struct{}) io.Reader
	mu       sync.Mutex
	accepted int
	results  []Result
	wg       sync.WaitGroup
	received atomic.Int64 // bytes read so far, all connections
}

// Result is what one upstream connection saw.
type Result struct {
	Received int64
	RecvSum  [32]byte
	Sent     int64
	SentSum  [32]byte
	ReadErr  error
	WriteErr error
}

// NewUpstream listens on 127.0.0.1 and sends the first send bytes of
// NewPattern(2) on each connection. It stops at test cleanup.
func NewUpstream(t testing.TB, send int64) *Upstream {
	t.Helper()
	return NewUpstreamOn(t, "127.0.0.1:0", send)
}

// NewUpstreamOn is NewUpstream listening on addr: another loopback address,
// or ":0" (every local address) for a trap that counts the dials a
// forwarder must never make.
func NewUpstreamOn(t testing.TB, addr string, send int64) *Upstream {
	t.Helper()
	return newUpstream(t, addr, func(int, <-chan struct{}) io.Reader { return io.LimitReader(NewPattern(2), send) })
}

// NewSizedUpstream is an Upstream whose replies differ: the conn-th
// connection accepted (from 0) gets size(conn) bytes of its own pattern, so
// a reply delivered to the wrong tunnel cannot hash right. Results tell what
// each connection sent.
func NewSizedUpstream(t testing.TB, size func(conn int) int64) *Upstream {
	t.Helper()
	return newUpstream(t, "127.0.0.1:0", func(conn int, _ <-chan struct{}) io.Reader {
		return io.LimitReader(NewPattern(replySeed(conn)), size(conn))
	})
}

// NewPacedUpstream is an Upstream that streams: on each connection it sends
// chunk bytes of that connection's own pattern at once and then every pace,
// until the client's side ends (EOF or an error), so a reply lasts as long
// as the client keeps its tunnel open. Results tell what each connection
// sent.
func NewPacedUpstream(t testing.TB, chunk int, pace time.Duration) *Upstream {
	t.Helper()
	return newUpstream(t, "127.0.0.1:0", func(conn int, clientDone <-chan struct{}) io.Reader {
		return &pacedReader{src: NewPattern(replySeed(conn)), chunk: chunk, pace: pace, stop: clientDone}
	})
}

// NewHeldUpstream is NewPacedUpstream whose connections send nothing until
// hold is closed: a sandbox service that has not answered yet.
func NewHeldUpstream(t testing.TB, chunk int, pace time.Duration, hold <-chan struct{}) *Upstream {
	t.Helper()
	return newUpstream(t, "127.0.0.1:0", func(conn int, clientDone <-chan struct{}) io.Reader {
		return &pacedReader{src: NewPattern(replySeed(conn)), chunk: chunk, pace: pace, stop: clientDone, hold: hold}
	})
}

// replySeed is the pattern seed of the conn-th connection's reply: far from
// the small seeds clients use, so that a tunnel echoing its client's bytes
// back does not look like the reply.
func replySeed(conn int) uint64 { return 1<<32 + uint64(conn) }

// pacedReader yields chunk bytes of src once hold is closed (at once
// where hold is nil) and then every pace, and io.EOF once stop is closed.
type pacedReader struct {
	src   io.Reader
	chunk int
	pace  time.Duration
	stop  <-chan struct{}
	hold  <-chan struct{}
	left  int // bytes of the current chunk not read yet
	timer *time.Timer
}

func (p *pacedReader) Read(b []byte) (int, error) {
	if p.hold != nil {
		select {
		case <-p.stop:
			return 0, io.EOF
		case <-p.hold:
			p.hold = nil
		}
	}
	if p.left == 0 {
		if p.timer != nil {
			select {
			case <-p.stop:
				p.timer.Stop()
				return 0, io.EOF
			case <-p.timer.C:
			}
		}
		p.timer = time.NewTimer(p.pace)
		p.left = p.chunk
	}
	n, _ := p.src.Read(b[:min(len(b), p.left)])
	p.left -= n
	return n, nil
}

// newUpstream listens on addr and answers the conn-th connection it
// accepts with what reply(conn, ...) yields.
func newUpstream(t testing.TB, addr string, reply func(conn int, clientDone <-chan struct{}) io.Reader) *Upstream {
	t.Helper()
	l, err := listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	ln := l.(*net.TCPListener)
	u := &Upstream{ln: ln, reply: reply}
	u.wg.Add(1)
	go func() {
		defer u.wg.Done()
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			u.take(c)
		}
	}()
	t.Cleanup(u.Close)
	return u
}

// take serves c, the next connection accepted.
func (u *Upstream) take(c *net.TCPConn) {
	u.mu.Lock()
	conn := u.accepted
	u.accepted++
	u.mu.Unlock()
	u.wg.Add(1)
	go func() {
		defer u.wg.Done()
		u.serve(c, conn)
	}()
}

func (u *Upstream) serve(c *net.TCPConn, conn int) {
	defer c.Close()
	var res Result
	var wg sync.WaitGroup
	clientDone := make(chan struct{})
	reply := u.reply(conn, clientDone)
	wg.Add(1)
	go func() {
		defer wg.Done()
		h := sha256.New()
		res.Sent, res.WriteErr = io.Copy(io.MultiWriter(c, h), reply)
		copy(res.SentSum[:], h.Sum(nil))
		c.CloseWrite()
	}()
	h := sha256.New()
	res.Received, res.ReadErr = io.Copy(io.MultiWriter(h, countWriter{&u.received}), c)
	res.ReadErr = sockerr.ReadError(c, res.ReadErr)
	copy(res.RecvSum[:], h.Sum(nil))
	close(clientDone)
	wg.Wait()
	u.mu.Lock()
	u.results = append(u.results, res)
	u.mu.Unlock()
}

// Received is how many bytes the upstream has read so far, over all its
// connections: what reached the sandbox service, not just its socket.
func (u *Upstream) Received() int64 { return u.received.Load() }

// countWriter adds what is written to n.
type countWriter struct{ n *atomic.Int64 }

func (w countWriter) Write(p []byte) (int, error) {
	w.n.Add(int64(len(p)))
	return len(p), nil
}

// Addr is the upstream's address.
func (u *Upstream) Addr() netip.AddrPort { return u.ln.Addr().(*net.TCPAddr).AddrPort() }

// Accepted counts the connections accepted so far.
func (u *Upstream) Accepted() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.accepted
}

// Close stops listening and waits for the connections to finish. The
// connections the kernel has queued for the listener are taken first:
// closing a listener resets what it has not accepted, so a dial that
// completed just before Close (a forwarder's, whose tunnel then ended at
// once) would otherwise leave no Result.
func (u *Upstream) Close() {
	for _, c := range u.queued() {
		u.take(c)
	}
	u.ln.Close()
	u.wg.Wait()
}

// queued accepts what the listener's queue holds now, without waiting
// (Go's listening socket is non-blocking: accept4 says EAGAIN once the
// queue is empty; an interrupted or aborted accept goes on to the next,
// as Go's does). None once the listener is closed.
func (u *Upstream) queued() []*net.TCPConn {
	rc, err := u.ln.SyscallConn()
	if err != nil {
		return nil
	}
	var fds []int
	rc.Control(func(fd uintptr) {
		for {
			nfd, _, err := syscall.Accept4(int(fd), syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC)
			switch err {
			case nil:
				fds = append(fds, nfd)
			case syscall.EINTR, syscall.ECONNABORTED:
				// As Go's accept: the next one.
			default:
				return // EAGAIN: the queue is empty
			}
		}
	})
	var conns []*net.TCPConn
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "upstream")
		c, err := net.FileConn(f)
		f.Close()
		if err == nil {
			conns = append(conns, c.(*net.TCPConn))
		}
	}
	return conns
}

// Results returns the finished connections' results; call after Close to
// see all of them.
func (u *Upstream) Results() []Result {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]Result(nil), u.results...)
}

// Totals sums what the connections of results received and sent.
func Totals(results []Result) (received, sent int64) {
	for _, r := range results {
		received += r.Received
		sent += r.Sent
	}
	return received, sent
}

// Pattern is a cheap deterministic byte stream (xorshift), so tests move
// many MiB without paying for crypto/rand.
type Pattern struct{ x uint64 }

// NewPattern returns the stream for seed.
func NewPattern(seed uint64) *Pattern { return &Pattern{x: seed*0x9E3779B97F4A7C15 + 1} }

func (p *Pattern) Read(b []byte) (int, error) {
	for i := range b {
		p.x ^= p.x << 13
		p.x ^= p.x >> 7
		p.x ^= p.x << 17
		b[i] = byte(p.x)
	}
	return len(b), nil
}

// ClosedPort is a loopback address nothing listens on: a target or a
// forwarder that refuses the connection. The port stays bound, not
// listening, until the test ends or NewUpstreamOn listens on it (a sandbox
// that wakes): a port merely closed goes back to the kernel, whose next
// listener on port 0 (another forwarder of the same test) may get it and
// answer.
func ClosedPort(t testing.TB) netip.AddrPort {
	t.Helper()
	f, a := boundSocket(t, netip.AddrFrom4([4]byte{127, 0, 0, 1}), "closed port")
	closedPorts.Store(a, f)
	t.Cleanup(func() { closedPorts.Delete(a) })
	return a
}

// boundSocket returns a TCP socket bound to ip, on a port the kernel
// picks, and its address. It is not listening and has no SO_REUSEADDR:
// every other bind to the port conflicts with it. The test's end closes
// it.
func boundSocket(t testing.TB, ip netip.Addr, name string) (*os.File, netip.AddrPort) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), name)
	t.Cleanup(func() { f.Close() })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: ip.As4()}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return f, netip.AddrPortFrom(ip, uint16(sa.(*syscall.SockaddrInet4).Port))
}

// closedPorts holds ClosedPort's sockets that no upstream listens on yet.
var closedPorts sync.Map // netip.AddrPort -> *os.File

// listen listens on addr, on ClosedPort's own socket where addr is one.
func listen(addr string) (net.Listener, error) {
	if a, err := netip.ParseAddrPort(addr); err == nil {
		if f, ok := closedPorts.LoadAndDelete(a); ok {
			f := f.(*os.File)
			defer f.Close()
			if err := syscall.Listen(int(f.Fd()), syscall.SOMAXCONN); err != nil {
				return nil, os.NewSyscallError("listen", err)
			}
			return net.FileListener(f)
		}
	}
	return net.Listen("tcp", addr)
}

// SendPattern writes n bytes of seed's pattern to c, then half-closes it,
// and returns the SHA-256 of what it wrote: one direction of a tunnel
// test.
func SendPattern(c interface {
	io.Writer
	CloseWrite() error
}, n int64, seed uint64) ([32]byte, error) {
	h := sha256.New()
	_, err := io.Copy(io.MultiWriter(c, h), io.LimitReader(NewPattern(seed), n))
	var sum [32]byte
	copy(sum[:], h.Sum(nil))
	if err == nil {
		err = c.CloseWrite()
	}
	return sum, err
}

// PatternSum is the SHA-256 of the first n bytes of NewPattern(seed).
func PatternSum(seed uint64, n int64) [32]byte {
	h := sha256.New()
	io.Copy(h, io.LimitReader(NewPattern(seed), n))
	var s [32]byte
	copy(s[:], h.Sum(nil))
	return s
}

// TransferMiB is the per-direction size of big transfer tests:
// kerneltest.BulkMiB (KTLS_TEST_MIB when set), else def (def/8 under the
// race detector, at least 1).
func TransferMiB(t testing.TB, def int64) int64 {
	t.Helper()
	if RaceEnabled {
		def = max(def/8, 1)
	}
	return int64(kerneltest.BulkMiB(t, int(def)))
}

// fdTargets lists what this process's fds point at, for leak reports.
func fdTargets() []string {
	ents, _ := os.ReadDir("/proc/self/fd")
	var out []string
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name())
		out = append(out, e.Name()+"->"+target)
	}
	return out
}

// CheckLeaks records open fds and goroutines now and fails t at cleanup
// when they have not come back to that level within a few seconds. Empty
// pipes kept for reuse by splice's default pool (two fds each) are not
// leaks; a pipe still in use at cleanup is.
func CheckLeaks(t testing.TB) {
	t.Helper()
	pool := splice.DefaultPipePool()
	fds, gs, idle := kerneltest.OpenFDs(t), runtime.NumGoroutine(), pool.Stats().Idle
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			ps := pool.Stats()
			nf, ng := kerneltest.OpenFDs(t)-2*(ps.Idle-idle), runtime.NumGoroutine()
			if nf <= fds && ng <= gs && ps.InUse == 0 {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Fatalf("leak: fds %d -> %d, goroutines %d -> %d, pipes in use %d\nfds: %v\n%s", fds, nf, gs, ng, ps.InUse, fdTargets(), buf)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// Blackhole returns an address on ip (IPv4) of a listener whose accept
// queue is full, so that the kernel drops further SYNs: a connect there
// hangs until the dialer gives up, like a firewall that drops packets.
func Blackhole(t testing.TB, ip netip.Addr) netip.AddrPort {
	t.Helper()
	ln, addr := boundSocket(t, ip, "blackhole")
	// Backlog 0: the queue holds one connection, never accepted.
	if err := syscall.Listen(int(ln.Fd()), 0); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		c, err := net.DialTimeout("tcp", addr.String(), time.Second)
		if err != nil {
			break // already full
		}
		t.Cleanup(func() { c.Close() })
	}
	return addr
}

// HostAddress returns an address of this host's interfaces that is neither
// loopback nor link-local: the forwarder must refuse it as a target. A host
// without one cannot run the test: it is skipped loudly ("SKIP: ..." on
// stderr), and fails where kernel tests are required (the VM harness gives
// its guest such an address).
func HostAddress(t testing.TB) netip.Addr {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatalf("list interface addresses: %v", err)
	}
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		if ip, ok := netip.AddrFromSlice(ipn.IP); ok && !ip.Unmap().IsLoopback() && !ip.Unmap().IsLinkLocalUnicast() {
			return ip.Unmap()
		}
	}
	const why = "this host has no interface address besides loopback and link-local: the refusal of the host's own address is not tested"
	if kerneltest.Required() {
		t.Fatalf("FAIL: %s=1 but %s", kerneltest.RequireEnv, why)
	}
	fmt.Fprintf(os.Stderr, "SKIP: %s: %s\n", t.Name(), why)
	t.Skip("SKIP: " + why)
	return netip.Addr{}
}

// ServeTCP listens on a loopback port and runs serve on its own goroutine
// for every connection accepted, until the test ends; it returns the
// address.
func ServeTCP(t testing.TB, serve func(c net.Conn)) string {
	t.Helper()
	return ServeTCPOn(t, "127.0.0.1:0", serve)
}

// ServeTCPOn is ServeTCP on the address given.
func ServeTCPOn(t testing.TB, addr string, serve func(c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go serve(c)
		}
	}()
	return ln.Addr().String()
}

// TCPPair returns the two ends of a loopback TCP connection, closed when t
// ends.
func TCPPair(t testing.TB) (dialed, accepted *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a, err := ln.Accept()
	if err != nil {
		d.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close(); a.Close() })
	return d.(*net.TCPConn), a.(*net.TCPConn)
}
