package forward

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// The idle-tunnel tests measure what an open tunnel that carries nothing
// costs the forwarder: heap, goroutine stacks, goroutines, file descriptors
// and splice pipes per tunnel. Only the forwarder's side may live in the
// measuring process, so the gateways and the sandbox service run in a peer
// process: this test binary started again with idlePeerEnv set.
const (
	// idleTunnelsEnv sets how many tunnels the tests open (docs/bench/idle.md
	// gives the counts behind its figures). The kernel test's default is
	// small because a handshake costs a lot of emulated CPU in the VM.
	idleTunnelsEnv           = "KTLS_IDLE_TUNNELS"
	defaultIdleTunnels       = 200
	defaultKernelIdleTunnels = 50
	// idleHeapProfileEnv names a file for a heap profile (every allocation
	// sampled) of the forwarder while the tunnels are idle: where the bytes
	// per tunnel go.
	idleHeapProfileEnv = "KTLS_IDLE_HEAP_PROFILE"
	// idlePeerEnv makes this binary the peer process; its value is the
	// JSON idlePeerConfig.
	idlePeerEnv = "KTLS_IDLE_PEER"
	// idleEchoBytes go through each tunnel and back before it turns idle:
	// one burst each way, so every direction has taken a splice pipe (or a
	// copy buffer) and must have given it back.
	idleEchoBytes = 4 << 10
	// idlePeerWorkers opens and closes tunnels in parallel.
	idlePeerWorkers = 8
)

func TestMain(m *testing.M) {
	if os.Getenv(bulkPeerEnv) != "" {
		err := runBulkPeer(os.Stdin, os.Stdout)
		fmt.Fprintf(os.Stderr, "bulk peer: %v\n", err)
		os.Exit(1)
	}
	if cfg := os.Getenv(idlePeerEnv); cfg != "" {
		if err := runIdlePeer(cfg, os.Stdin, os.Stdout); err != nil {
			fmt.Fprintf(os.Stderr, "idle-tunnel peer: %v\n", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestIdleTunnels measures idle tunnels with whatever this kernel offers:
// on a host without kTLS every tunnel falls back to userspace TLS, both
// directions copy, and each holds a 32 KiB copy buffer while it waits.
func TestIdleTunnels(t *testing.T) {
	fig := measureIdleTunnels(t, ktls.Options{}, defaultIdleTunnels)
	t.Log(fig)
}

// TestKernelIdleTunnels is the kTLS forwarder: every tunnel offloaded TX and
// RX, its echo spliced both ways, and while idle it holds no pipe and no
// buffer.
func TestKernelIdleTunnels(t *testing.T) {
	kerneltest.Require(t)
	fig := measureIdleTunnels(t, ktls.Options{RequireOffload: true}, defaultKernelIdleTunnels)
	t.Log(fig)
	n := int64(fig.Tunnels)
	if fig.Offload[ktls.ReasonNone] != fig.Tunnels {
		t.Errorf("offload outcomes %v, want all %d tunnels fully offloaded", fig.Offload, fig.Tunnels)
	}
	if fig.PipesHeld != 0 {
		t.Errorf("%d pipes held by %d idle tunnels, want 0", fig.PipesHeld, fig.Tunnels)
	}
	// The kernel's own count of sockets whose records it seals and opens now.
	if fig.TLSStat["TlsCurrTxSw"] != n || fig.TLSStat["TlsCurrRxSw"] != n {
		t.Errorf("tls_stat while idle moved by %v, want TlsCurrTxSw and TlsCurrRxSw +%d", fig.TLSStat, n)
	}
	if fig.SplicedBytes != 2*n*idleEchoBytes || fig.CopiedBytes != 0 {
		t.Errorf("relayed %d bytes spliced and %d copied, want %d spliced and none copied",
			fig.SplicedBytes, fig.CopiedBytes, 2*n*idleEchoBytes)
	}
}

// idleFigures is what measureIdleTunnels found, per idle tunnel unless the
// name says otherwise.
type idleFigures struct {
	Tunnels                         int
	Offload                         map[ktls.Reason]int
	HeapInuse, HeapLive, StackInuse float64 // bytes
	Goroutines, FDs                 float64
	PipesHeld                       int64 // in total, while idle
	CopyBuffers                     int   // 32 KiB relay buffers held while idle, in total: one per copying direction, blocked in Read
	TLSStat                         kerneltest.Stat
	ResidualHeapLive                float64 // bytes, still live once every tunnel has closed
	SplicedBytes, CopiedBytes       int64   // in total, both directions
}

func (f idleFigures) String() string {
	return fmt.Sprintf("%d idle tunnels (offload %v): heap in use %.0f B/tunnel (live %.0f B), goroutine stacks %.0f B/tunnel, "+
		"goroutines %.2f/tunnel, fds %.2f/tunnel, pipes held %d, copy buffers held %d; tls_stat while idle %v; "+
		"after close: live heap %+.0f B/tunnel vs before; relayed %d bytes spliced, %d copied",
		f.Tunnels, f.Offload, f.HeapInuse, f.HeapLive, f.StackInuse, f.Goroutines, f.FDs, f.PipesHeld, f.CopyBuffers,
		f.TLSStat, f.ResidualHeapLive, f.SplicedBytes, f.CopiedBytes)
}

// idleTunnelCount is KTLS_IDLE_TUNNELS (default def), capped by what
// RLIMIT_NOFILE leaves: this process holds two sockets per tunnel.
func idleTunnelCount(t *testing.T, def int) int {
	n := def
	if s := os.Getenv(idleTunnelsEnv); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			t.Fatalf("%s=%q: want a positive integer", idleTunnelsEnv, s)
		}
		n = v
	}
	// The Go runtime has already raised the soft limit to the hard one.
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	const spare = 64 // test binary, listeners, peer pipes, probes
	if fit := (int(lim.Cur) - kerneltest.OpenFDs(t) - spare) / 2; n > fit {
		t.Logf("RLIMIT_NOFILE %d fits %d tunnels (2 fds each), not %d: measuring %d", lim.Cur, fit, n, fit)
		n = fit
	}
	return n
}

type idleSnapshot struct {
	heapInuse, heapLive, stackInuse uint64
	goroutines, fds                 int
}

func takeIdleSnapshot(t *testing.T) idleSnapshot {
	// Two collections: the first may only finish sweeping what the
	// previous cycle found dead, and sync.Pool (the relay's copy buffers)
	// drops its contents over two.
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return idleSnapshot{heapInuse: ms.HeapInuse, heapLive: ms.HeapAlloc, stackInuse: ms.StackInuse,
		goroutines: runtime.NumGoroutine(), fds: kerneltest.OpenFDs(t)}
}

// idleServer is the forwarder under measurement: a loopback listener that
// terminates mutual TLS with the ktls engine, binds the preamble to the
// session and hands each connection to a Forwarder, as the Caddy handlers do.
type idleServer struct {
	ln    net.Listener
	fwd   *Forwarder
	reg   *Registry
	pipes *splice.PipePool
	cfg   *tls.Config
	opts  ktls.Options
	wg    sync.WaitGroup

	mu      sync.Mutex
	ended   int
	errs    []error
	offload map[ktls.Reason]int
	spliced int64
	copied  int64
	copying int // directions that ran on the copy path
}

func (s *idleServer) serve() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.wg.Go(func() { s.serveConn(c) })
	}
}

func (s *idleServer) serveConn(c net.Conn) {
	kc := ktls.Server(c, s.cfg, s.opts)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	err := kc.HandshakeContext(ctx)
	cancel()
	var res Result
	if err != nil {
		kc.Close()
		err = fmt.Errorf("handshake: %w", err)
	} else {
		binding, _ := preamble.ChannelBinding(kc.ConnectionState())
		res, err = s.fwd.Serve(Gateway{Conn: kc, Binding: binding, Peer: c.RemoteAddr().String()})
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ended++
	if err != nil {
		s.errs = append(s.errs, err)
	}
	if s.offload == nil {
		s.offload = map[ktls.Reason]int{}
	}
	s.offload[kc.Offload().Reason]++
	for _, d := range []splice.DirectionStats{res.Relay.AToB, res.Relay.BToA} {
		s.spliced += d.SpliceBytes
		s.copied += d.CopyBytes
		if err == nil && !d.Spliced {
			s.copying++
		}
	}
}

// waitEnded waits until n connections have been served to their end.
func (s *idleServer) waitEnded(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s.mu.Lock()
		ended := s.ended
		s.mu.Unlock()
		if ended >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d tunnels ended within 2 minutes of the close", ended, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// measureIdleTunnels opens tunnels through a forwarder, lets them go idle,
// measures this process, closes them all and checks that everything came
// back. opts are the forwarder's offload options; def is the number of
// tunnels when KTLS_IDLE_TUNNELS is not set.
func measureIdleTunnels(t *testing.T, opts ktls.Options, def int) idleFigures {
	n := idleTunnelCount(t, def)
	ktls.Probe() // cached for the process: its throwaway sockets stay out of the figures
	heapProfile := os.Getenv(idleHeapProfileEnv)
	if heapProfile != "" {
		runtime.MemProfileRate = 1
	}

	ca := testpki.NewCA(t, "idle tunnels CA")
	serverLeaf, gatewayLeaf := ca.Server(t), ca.Client(t, "gateway")
	seed := make([]byte, ed25519.SeedSize)
	rand.Read(seed)
	v, err := preamble.NewVerifier(preamble.VerifierConfig{
		Keys:           map[string]ed25519.PublicKey{"gw-1": ed25519.NewKeyFromSeed(seed).Public().(ed25519.PublicKey)},
		RequireBinding: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := NewTargetPolicy([]string{"127.0.0.0/8"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// No idle pipes kept: every pipe this pool has open is held by a tunnel.
	s := &idleServer{reg: NewRegistry(), pipes: splice.NewPipePool(0, 0), opts: opts, cfg: &tls.Config{
		Certificates: []tls.Certificate{serverLeaf.TLS},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca.Pool,
		MinVersion:   tls.VersionTLS13,
	}}
	if s.fwd, err = New(Config{Verifier: v, Policy: pol, Registry: s.reg, Pipes: s.pipes}); err != nil {
		t.Fatal(err)
	}
	if s.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	// The baseline comes after the first socket, which may have started the
	// netpoller (an epoll fd and an eventfd that stay open for good).
	forwardtest.CheckLeaks(t)
	s.wg.Add(1)
	go s.serve()
	t.Cleanup(func() { s.ln.Close(); s.wg.Wait(); s.pipes.Close() })

	peer := startIdlePeer(t, idlePeerConfig{
		Forwarder: s.ln.Addr().String(), Tunnels: n, KeyID: "gw-1", SigningSeed: seed,
		CAPEM: ca.PEM, CertPEM: gatewayLeaf.CertPEM, KeyPEM: gatewayLeaf.KeyPEM,
	})
	statBefore, statErr := kerneltest.ReadStat()
	before := takeIdleSnapshot(t)

	peer.command(t, "open", fmt.Sprintf("open %d", n))
	if open, _ := s.reg.Counts(); open != n {
		t.Fatalf("%d tunnels registered open, want %d", open, n)
	}
	// The last echo reply has reached its gateway; its direction gives the
	// pipe back right after draining it.
	for deadline := time.Now().Add(10 * time.Second); s.pipes.Stats().InUse != 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	idle := takeIdleSnapshot(t)
	if heapProfile != "" {
		writeHeapProfile(t, heapProfile)
	}
	fig := idleFigures{
		Tunnels:    n,
		HeapInuse:  perTunnel(idle.heapInuse, before.heapInuse, n),
		HeapLive:   perTunnel(idle.heapLive, before.heapLive, n),
		StackInuse: perTunnel(idle.stackInuse, before.stackInuse, n),
		Goroutines: float64(idle.goroutines-before.goroutines) / float64(n),
		FDs:        float64(idle.fds-before.fds) / float64(n),
		PipesHeld:  s.pipes.Stats().InUse,
	}
	if statErr == nil {
		after, err := kerneltest.ReadStat()
		if err != nil {
			t.Fatalf("read tls_stat: %v", err)
		}
		fig.TLSStat = after.Sub(statBefore)
	}
	// The forwarder's whole footprint is its two sockets and two goroutines
	// (Serve and the relay's second direction) per tunnel.
	if idle.fds-before.fds != 2*n || idle.goroutines-before.goroutines != 2*n {
		t.Errorf("%d idle tunnels added %d fds and %d goroutines, want %d of each",
			n, idle.fds-before.fds, idle.goroutines-before.goroutines, 2*n)
	}

	peer.command(t, "close", "closed")
	peer.wait(t)
	s.waitEnded(t, n)
	after := takeIdleSnapshot(t)
	fig.ResidualHeapLive = (float64(after.heapLive) - float64(before.heapLive)) / float64(n)
	s.mu.Lock()
	fig.Offload, fig.SplicedBytes, fig.CopiedBytes, fig.CopyBuffers = s.offload, s.spliced, s.copied, s.copying
	errs := s.errs
	s.mu.Unlock()
	if len(errs) > 0 {
		t.Fatalf("%d of %d tunnels ended with an error, first: %v", len(errs), n, errs[0])
	}
	if total := fig.SplicedBytes + fig.CopiedBytes; total != 2*int64(n)*idleEchoBytes {
		t.Errorf("relayed %d bytes, want %d (%d each way per tunnel)", total, 2*int64(n)*idleEchoBytes, idleEchoBytes)
	}
	if open, opened := s.reg.Counts(); open != 0 || opened != uint64(n) {
		t.Errorf("registry after close: %d open, %d opened, want 0 and %d", open, opened, n)
	}
	if ps := s.pipes.Stats(); ps.InUse != 0 || ps.Created != ps.Destroyed {
		t.Errorf("pipes after close: %+v, want none in use or open", ps)
	}
	// What may stay: the runtime keeps the descriptors of exited goroutines
	// for reuse (about 450 bytes each, two per tunnel), and the replay cache
	// keeps each nonce until its frame expires.
	if fig.ResidualHeapLive > 2048 {
		t.Errorf("after close %.0f live heap bytes per tunnel stayed, want at most 2048", fig.ResidualHeapLive)
	}
	return fig
}

func writeHeapProfile(t *testing.T, path string) {
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := pprof.WriteHeapProfile(f); err != nil {
		t.Fatal(err)
	}
}

func perTunnel(now, before uint64, n int) float64 {
	return (float64(now) - float64(before)) / float64(n)
}

// idlePeerConfig tells the peer process where the forwarder is and what
// the gateway presents: a client certificate and a preamble signing key.
type idlePeerConfig struct {
	Forwarder       string
	Tunnels         int
	KeyID           string
	SigningSeed     []byte
	CAPEM           []byte // trusts the forwarder's certificate
	CertPEM, KeyPEM []byte // the gateway's client certificate
}

// idlePeer is the running peer process. It speaks one line per step on its
// stdin and stdout: it says "ready" once its sandbox service listens, opens
// the tunnels on "open" (answering "open N"), and closes them on "close"
// (answering "closed").
type idlePeer struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

func startIdlePeer(t *testing.T, cfg idlePeerConfig) *idlePeer {
	t.Helper()
	js, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), idlePeerEnv+"="+string(js))
	cmd.Stderr = os.Stderr
	p := &idlePeer{cmd: cmd}
	if p.in, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.out = bufio.NewScanner(out)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A test that failed midway: stop the peer so its sockets go too.
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	p.expect(t, "ready")
	return p
}

func (p *idlePeer) command(t *testing.T, cmd, answer string) {
	t.Helper()
	if _, err := fmt.Fprintln(p.in, cmd); err != nil {
		t.Fatalf("peer: %s: %v", cmd, err)
	}
	p.expect(t, answer)
}

func (p *idlePeer) expect(t *testing.T, line string) {
	t.Helper()
	if !p.out.Scan() {
		t.Fatalf("peer exited before saying %q (its error is above): %v", line, p.out.Err())
	}
	if got := p.out.Text(); got != line {
		t.Fatalf("peer said %q, want %q", got, line)
	}
}

func (p *idlePeer) wait(t *testing.T) {
	t.Helper()
	p.in.Close()
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("peer: %v", err)
	}
}

// runIdlePeer is the peer process: the sandbox service (an echo server) and
// the gateways, each tunnel carrying one echo before it goes idle.
func runIdlePeer(cfgJSON string, stdin io.Reader, stdout io.Writer) error {
	var cfg idlePeerConfig
	if err := json.Unmarshal([]byte(cfgJSON), &cfg); err != nil {
		return err
	}
	cert, err := tls.X509KeyPair(cfg.CertPEM, cfg.KeyPEM)
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(cfg.CAPEM) {
		return errors.New("no CA certificate in the config")
	}
	tlsCfg := &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: roots, ServerName: "localhost", MinVersion: tls.VersionTLS13}
	signer, err := preamble.NewSigner(cfg.KeyID, ed25519.NewKeyFromSeed(cfg.SigningSeed))
	if err != nil {
		return err
	}
	// Full handshakes in userspace TLS, every tunnel alike.
	dialer, err := gateway.New(gateway.Config{TLS: tlsCfg, Signer: signer, KTLS: ktls.Options{Disable: true}, DisableResumption: true, DialTimeout: time.Minute})
	if err != nil {
		return err
	}
	sandbox, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return err
	}
	var echoes sync.WaitGroup
	echoes.Go(func() {
		for {
			c, err := sandbox.AcceptTCP()
			if err != nil {
				return
			}
			echoes.Go(func() {
				defer c.Close()
				io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{c}, make([]byte, idleEchoBytes))
				c.CloseWrite()
			})
		}
	})
	target := sandbox.Addr().(*net.TCPAddr).AddrPort()

	lines := bufio.NewScanner(stdin)
	expect := func(want string) error {
		if !lines.Scan() {
			return fmt.Errorf("stdin ended before %q", want)
		}
		if got := lines.Text(); got != want {
			return fmt.Errorf("got command %q, want %q", got, want)
		}
		return nil
	}
	fmt.Fprintln(stdout, "ready")
	if err := expect("open"); err != nil {
		return err
	}
	conns := make([]*ktls.Conn, cfg.Tunnels)
	if err := forEachTunnel(cfg.Tunnels, func(i int) (err error) {
		conns[i], err = openEchoTunnel(dialer, cfg.Forwarder, target, uint64(i))
		return err
	}); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "open %d\n", cfg.Tunnels)
	if err := expect("close"); err != nil {
		return err
	}
	if err := forEachTunnel(cfg.Tunnels, func(i int) error { return closeTunnel(conns[i]) }); err != nil {
		return err
	}
	sandbox.Close()
	echoes.Wait()
	fmt.Fprintln(stdout, "closed")
	return nil
}

// forEachTunnel runs fn for 0..n-1 on idlePeerWorkers goroutines and
// returns the first error.
func forEachTunnel(n int, fn func(i int) error) error {
	next := make(chan int)
	errs := make(chan error, idlePeerWorkers)
	var wg sync.WaitGroup
	for range idlePeerWorkers {
		wg.Go(func() {
			for i := range next {
				if err := fn(i); err != nil {
					errs <- fmt.Errorf("tunnel %d: %w", i, err)
					return
				}
			}
		})
	}
	var err error
feed:
	for i := range n {
		select {
		case next <- i:
		case err = <-errs:
			break feed
		}
	}
	close(next)
	wg.Wait()
	close(errs)
	if err == nil {
		err = <-errs
	}
	return err
}

// openEchoTunnel dials the forwarder as a gateway, sends idleEchoBytes and
// checks that the sandbox echoed exactly them.
func openEchoTunnel(d *gateway.Dialer, addr string, target netip.AddrPort, seed uint64) (*ktls.Conn, error) {
	c, err := d.Dial(context.Background(), gateway.Route{Forwarder: addr, Sandbox: "sbx-idle", Target: target})
	if err != nil {
		return nil, err
	}
	sent := make([]byte, idleEchoBytes)
	forwardtest.NewPattern(seed).Read(sent)
	got := make([]byte, idleEchoBytes)
	if _, err := c.Write(sent); err != nil {
		c.Close()
		return nil, err
	}
	if _, err := io.ReadFull(c, got); err != nil {
		c.Close()
		return nil, fmt.Errorf("reading the echo: %w", err)
	}
	if !bytes.Equal(got, sent) {
		c.Close()
		return nil, errors.New("the echo differs from what was sent")
	}
	return c, nil
}

// closeTunnel ends a tunnel the way a gateway does: close_notify, then
// everything the forwarder still sends until its own close_notify.
func closeTunnel(c *ktls.Conn) error {
	defer c.Close()
	if err := c.CloseWrite(); err != nil {
		return err
	}
	n, err := io.Copy(io.Discard, c)
	if err == nil && n != 0 {
		err = fmt.Errorf("%d unexpected bytes after the echo", n)
	}
	return err
}
