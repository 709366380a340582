package forward

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
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
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
// and splice pipes per tunnel. The active-tunnel tests measure the same
// tunnels idle and then while every one of them moves data both ways. Only
// the forwarder's side may live in the measuring process, so the gateways
// and the sandbox service run in a peer process: this test binary started
// again with idlePeerEnv set.
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
	// activeHeapProfileEnv names a file for a heap profile of the forwarder
	// at the last sample while the tunnels stream; beside the idle one,
	// `go tool pprof -base IDLE ACTIVE` shows what activity adds.
	activeHeapProfileEnv = "KTLS_ACTIVE_HEAP_PROFILE"
	// idlePeerEnv makes this binary the peer process; its value is the
	// JSON idlePeerConfig.
	idlePeerEnv = "KTLS_IDLE_PEER"
	// idleEchoBytes go through each tunnel and back before it turns idle:
	// one burst each way, so every direction has taken a splice pipe (or a
	// copy buffer) and must have given it back.
	idleEchoBytes = 4 << 10
	// idlePeerWorkers opens and closes tunnels in parallel.
	idlePeerWorkers = 8

	// activeTunnelsEnv sets how many tunnels the active-tunnel tests open
	// (docs/bench/idle.md gives the counts behind its figures); the
	// defaults keep `make test` short.
	activeTunnelsEnv           = "KTLS_ACTIVE_TUNNELS"
	defaultActiveTunnels       = 200
	defaultKernelActiveTunnels = 10
	// activeChunk is what a gateway writes at a time while its tunnel is
	// active: one full TLS record of plaintext.
	activeChunk = 16 << 10
	// activeWindow bounds what a streaming gateway has written and not yet
	// read back (its echo). Each tunnel keeps that much in flight, so that
	// every tunnel always has bytes between its two ends, while the
	// kernel's socket memory stays proportional to the tunnels.
	activeWindow = 2 * activeChunk
	// activeSamples is how many times the measured process is sampled while
	// the tunnels stream; every tunnel moves bytes both ways between two
	// samples.
	activeSamples = 5
	// activeHeldTunnels is how many tunnels back up to count their pipes:
	// one, because a tunnel that backs up fills the forwarder's socket
	// buffers (several MiB each), and all of it is read back before the
	// test goes on.
	activeHeldTunnels = 1
	// activeSeedBase seeds the streams' patterns, apart from the echoes'.
	activeSeedBase = 1 << 32
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
	fig := measureTunnels(t, tunnelRun{countEnv: idleTunnelsEnv, def: defaultIdleTunnels})
	t.Log(fig.Idle)
}

// TestKernelIdleTunnels is the kTLS forwarder: every tunnel offloaded TX and
// RX, its echo spliced both ways, and while idle it holds no pipe and no
// buffer.
func TestKernelIdleTunnels(t *testing.T) {
	kerneltest.Require(t)
	fig := measureTunnels(t, tunnelRun{opts: ktls.Options{RequireOffload: true}, countEnv: idleTunnelsEnv, def: defaultKernelIdleTunnels}).Idle
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

// TestActiveTunnels measures the same tunnels idle and then active, side by
// side in one process, with whatever this kernel offers: on a host without
// kTLS every direction copies through userspace TLS and no pipe is ever
// taken.
func TestActiveTunnels(t *testing.T) {
	fig := measureTunnels(t, tunnelRun{countEnv: activeTunnelsEnv, def: defaultActiveTunnels, active: true})
	t.Log(fig.Idle)
	t.Log(fig.Active)
}

// TestKernelActiveTunnels is the kTLS forwarder with every tunnel active:
// both directions of every tunnel spliced, every byte of the streams
// spliced and none copied, and, while the gateways stop reading, one pipe
// held by each direction.
func TestKernelActiveTunnels(t *testing.T) {
	kerneltest.Require(t)
	fig := measureTunnels(t, tunnelRun{opts: ktls.Options{RequireOffload: true}, countEnv: activeTunnelsEnv, def: defaultKernelActiveTunnels, active: true})
	t.Log(fig.Idle)
	t.Log(fig.Active)
	n := fig.Idle.Tunnels
	if fig.Idle.Offload[ktls.ReasonNone] != n || fig.Active.SplicedDirections != 2*n {
		t.Errorf("offload outcomes %v, %d directions spliced; want all %d tunnels fully offloaded, both directions spliced",
			fig.Idle.Offload, fig.Active.SplicedDirections, n)
	}
	if want := 2*int64(n)*idleEchoBytes + 2*fig.Active.Streamed; fig.Idle.SplicedBytes != want || fig.Idle.CopiedBytes != 0 {
		t.Errorf("relayed %d bytes spliced and %d copied, want %d spliced and none copied",
			fig.Idle.SplicedBytes, fig.Idle.CopiedBytes, want)
	}
}

// idleFigures is what measureTunnels found of the idle tunnels, per idle
// tunnel unless the name says otherwise.
type idleFigures struct {
	Tunnels                         int
	Offload                         map[ktls.Reason]int
	HeapInuse, HeapLive, StackInuse float64 // bytes
	Goroutines, FDs                 float64
	PipesHeld                       int64 // in total, while idle
	CopyBuffers                     int   // 32 KiB relay buffers held while idle, in total: one per copying direction, blocked in Read
	TLSStat                         kerneltest.Stat
	ResidualHeapLive                float64 // bytes, still live once every tunnel has closed
	SplicedBytes, CopiedBytes       int64   // in total, both directions, over the tunnels' lives
}

func (f idleFigures) String() string {
	return fmt.Sprintf("%d idle tunnels (offload %v): heap in use %.0f B/tunnel (live %.0f B), goroutine stacks %.0f B/tunnel, "+
		"goroutines %.2f/tunnel, fds %.2f/tunnel, pipes held %d, copy buffers held %d; tls_stat while idle %v; "+
		"after close: live heap %+.0f B/tunnel vs before; relayed %d bytes spliced, %d copied",
		f.Tunnels, f.Offload, f.HeapInuse, f.HeapLive, f.StackInuse, f.Goroutines, f.FDs, f.PipesHeld, f.CopyBuffers,
		f.TLSStat, f.ResidualHeapLive, f.SplicedBytes, f.CopiedBytes)
}

// activeSample is the measured process at one moment while the tunnels are
// active, less the baseline before the tunnels.
type activeSample struct {
	HeapInuse, HeapLive, StackInuse float64 // bytes per tunnel
	PipesInUse                      int64   // pipes the tunnels hold, in total
	PipeFDs                         int     // pipe fds, in total
	// TCPMemPages is what /proc/net/sockstat counts of the system's TCP
	// buffers, in pages: both processes' sockets (and anything else the
	// machine runs), for scale only.
	TCPMemPages int
}

// activeFigures is what measureTunnels found of the active tunnels.
type activeFigures struct {
	Tunnels int
	// SplicedDirections counts the tunnels' directions that splice: each
	// takes a pipe for a burst (two per fully offloaded tunnel).
	SplicedDirections int
	// Streaming holds the samples taken while every tunnel streamed both
	// ways.
	Streaming []activeSample
	// HeldTunnels streamed again while their gateways did not read, until
	// they had backed up (none unless every direction splices): HeldPipes
	// pipes were in use then, HeldPipeFDs pipe fds open.
	HeldTunnels int
	HeldPipes   int64
	HeldPipeFDs int
	// Streamed is what the gateways sent through their tunnels while active,
	// all tunnels together; the echoes brought as much back.
	Streamed int64
}

func (f activeFigures) String() string {
	field := func(get func(activeSample) float64) string {
		xs := make([]float64, len(f.Streaming))
		for i, s := range f.Streaming {
			xs[i] = get(s)
		}
		slices.Sort(xs)
		return fmt.Sprintf("%.0f/%.0f", xs[len(xs)/2], xs[len(xs)-1])
	}
	share := "no direction splices"
	if f.SplicedDirections > 0 {
		share = field(func(s activeSample) float64 { return 1000 * float64(s.PipesInUse) / float64(f.SplicedDirections) }) +
			" per mille of the spliced directions"
	}
	return fmt.Sprintf("%d active tunnels, %d directions spliced; streaming (%d samples, median/max): "+
		"heap in use %s B/tunnel (live %s B), goroutine stacks %s B/tunnel, pipes in use %s (%s), pipe fds %s, "+
		"TCP buffers %s pages; %d tunnels backed up: %d pipes in use, %d pipe fds; streamed %d bytes each way",
		f.Tunnels, f.SplicedDirections, len(f.Streaming),
		field(func(s activeSample) float64 { return s.HeapInuse }), field(func(s activeSample) float64 { return s.HeapLive }),
		field(func(s activeSample) float64 { return s.StackInuse }), field(func(s activeSample) float64 { return float64(s.PipesInUse) }),
		share, field(func(s activeSample) float64 { return float64(s.PipeFDs) }),
		field(func(s activeSample) float64 { return float64(s.TCPMemPages) }),
		f.HeldTunnels, f.HeldPipes, f.HeldPipeFDs, f.Streamed)
}

// tunnelCount is the tunnel count env names (default def), capped by what
// RLIMIT_NOFILE leaves: this process holds fdsPerTunnel fds per tunnel.
func tunnelCount(t *testing.T, env string, def, fdsPerTunnel int) int {
	n := def
	if s := os.Getenv(env); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			t.Fatalf("%s=%q: want a positive integer", env, s)
		}
		n = v
	}
	// The Go runtime has already raised the soft limit to the hard one.
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	const spare = 64 // test binary, listeners, peer pipes, probes
	if fit := (int(lim.Cur) - kerneltest.OpenFDs(t) - spare) / fdsPerTunnel; n > fit {
		t.Logf("RLIMIT_NOFILE %d fits %d tunnels (%d fds each), not %d: measuring %d", lim.Cur, fit, fdsPerTunnel, n, fit)
		n = fit
	}
	return n
}

// fdKinds counts a process's open fds by what they are.
type fdKinds struct{ sockets, pipes, other int }

func (k fdKinds) total() int { return k.sockets + k.pipes + k.other }

func countFDKinds(t *testing.T) fdKinds {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("count fds: %v", err)
	}
	var k fdKinds
	for _, e := range ents {
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		switch {
		case err != nil:
			// Closed since the listing (the listing's own fd among them).
		case strings.HasPrefix(target, "socket:"):
			k.sockets++
		case strings.HasPrefix(target, "pipe:"):
			k.pipes++
		default:
			k.other++
		}
	}
	return k
}

// tcpMemPages is the TCP buffer memory /proc/net/sockstat counts, in pages.
func tcpMemPages(t *testing.T) int {
	b, err := os.ReadFile("/proc/net/sockstat")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != "TCP:" {
			continue
		}
		for i := 1; i+1 < len(f); i += 2 {
			if f[i] == "mem" {
				v, err := strconv.Atoi(f[i+1])
				if err != nil {
					t.Fatalf("sockstat: %q", line)
				}
				return v
			}
		}
	}
	t.Fatalf("sockstat has no TCP mem: %q", b)
	return 0
}

type idleSnapshot struct {
	heapInuse, heapLive, stackInuse uint64
	goroutines                      int
	fds                             fdKinds
	pipes                           splice.PoolStats
	// steady: no pipe was taken or given back while the fds were counted,
	// so that fds and pipes describe the same moment.
	steady      bool
	tcpMemPages int
}

func takeIdleSnapshot(t *testing.T, pool *splice.PipePool) idleSnapshot {
	// Two collections: the first may only finish sweeping what the
	// previous cycle found dead, and sync.Pool (the relay's copy buffers)
	// drops its contents over two.
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	snap := idleSnapshot{heapInuse: ms.HeapInuse, heapLive: ms.HeapAlloc, stackInuse: ms.StackInuse,
		goroutines: runtime.NumGoroutine(), tcpMemPages: tcpMemPages(t)}
	ps := pool.Stats()
	snap.fds = countFDKinds(t)
	snap.pipes = pool.Stats()
	snap.steady = snap.pipes == ps
	return snap
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

	mu          sync.Mutex
	ended       int
	errs        []error
	offload     map[ktls.Reason]int
	splicedDirs int // directions whose relay splices: a gateway side in the kernel
	spliced     int64
	copied      int64
	copying     int // directions that ran on the copy path
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
	off := kc.Offload()
	s.mu.Lock()
	if s.offload == nil {
		s.offload = map[ktls.Reason]int{}
	}
	s.offload[off.Reason]++
	if err == nil {
		// The gateway's side is the source of one direction and the sink
		// of the other: each splices where its half is in the kernel.
		for _, m := range []ktls.Mode{off.RX, off.TX} {
			if m != ktls.ModeUserspace {
				s.splicedDirs++
			}
		}
	}
	s.mu.Unlock()
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
	for _, d := range []splice.DirectionStats{res.Relay.AToB, res.Relay.BToA} {
		s.spliced += d.SpliceBytes
		s.copied += d.CopyBytes
		if err == nil && !d.Spliced {
			s.copying++
		}
	}
}

// state says how many connections have ended and what the open tunnels
// have moved, the 20 least recently active first.
func (s *idleServer) state() string {
	s.mu.Lock()
	ended, errs := s.ended, len(s.errs)
	s.mu.Unlock()
	tunnels := s.reg.Tunnels()
	slices.SortFunc(tunnels, func(a, b TunnelInfo) int { return a.LastActivity.Compare(b.LastActivity) })
	var b strings.Builder
	fmt.Fprintf(&b, "%d connections ended (%d with an error), %d tunnels open, pipes %+v", ended, errs, len(tunnels), s.pipes.Stats())
	for _, ti := range tunnels[:min(len(tunnels), 20)] {
		b.WriteString("; " + describeTunnel(ti))
	}
	return b.String()
}

// describeTunnel says what an open tunnel has moved, for a test that
// gave up waiting on it.
func describeTunnel(ti TunnelInfo) string {
	return fmt.Sprintf("tunnel %d (gateway %s): %d to the sandbox, %d from it, last active %v ago",
		ti.ID, ti.Peer, ti.BytesToSandbox, ti.BytesFromSandbox, time.Since(ti.LastActivity).Round(time.Millisecond))
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

// waitNoPipes waits, up to 10 seconds, for the tunnels to give back every
// pipe: a direction gives its pipe back right after the burst that drained
// it.
func (s *idleServer) waitNoPipes() {
	for deadline := time.Now().Add(10 * time.Second); s.pipes.Stats().InUse != 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
}

// tunnelRun is one run of measureTunnels.
type tunnelRun struct {
	opts     ktls.Options // the forwarder's offload options
	countEnv string       // names the tunnel count: idleTunnelsEnv or activeTunnelsEnv
	def      int          // the tunnel count when countEnv is not set
	// active makes the tunnels active once they have been measured idle.
	active bool
}

// tunnelFigures is what measureTunnels found.
type tunnelFigures struct {
	Idle   idleFigures
	Active *activeFigures // nil unless the run made its tunnels active
}

// measureTunnels opens tunnels through a forwarder, lets them go idle,
// measures this process, makes them active and measures it again when the
// run asks for it, closes them all and checks that everything came back.
func measureTunnels(t *testing.T, run tunnelRun) tunnelFigures {
	fdsPerTunnel := 2
	ktls.Probe() // cached for the process: its throwaway sockets stay out of the figures
	if run.active && !run.opts.Disable && ktls.Probe().ULP == nil {
		fdsPerTunnel = 6 // and a pipe per direction, while active
	}
	n := tunnelCount(t, run.countEnv, run.def, fdsPerTunnel)
	heapProfile := os.Getenv(idleHeapProfileEnv)
	if heapProfile != "" || os.Getenv(activeHeapProfileEnv) != "" {
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
	s := &idleServer{reg: NewRegistry(), pipes: splice.NewPipePool(0, 0), opts: run.opts, cfg: &tls.Config{
		Certificates: []tls.Certificate{serverLeaf.TLS},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca.Pool,
		MinVersion:   tls.VersionTLS13,
	}}
	if s.fwd, err = New(Config{Verifier: v, Policy: pol, Registry: s.reg, Pipes: s.pipes}); err != nil {
		t.Fatal(err)
	}
	if s.ln, err = listenEthernetMSS("127.0.0.1:0"); err != nil {
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
	}, s.state)
	statBefore, statErr := kerneltest.ReadStat()
	before := takeIdleSnapshot(t, s.pipes)

	peer.command(t, "open", fmt.Sprintf("open %d", n))
	if open, _ := s.reg.Counts(); open != n {
		t.Fatalf("%d tunnels registered open, want %d", open, n)
	}
	// The last echo reply has reached its gateway; its direction gives the
	// pipe back right after draining it.
	s.waitNoPipes()
	idle := takeIdleSnapshot(t, s.pipes)
	if heapProfile != "" {
		writeHeapProfile(t, heapProfile)
	}
	fig := idleFigures{
		Tunnels:    n,
		HeapInuse:  perTunnel(idle.heapInuse, before.heapInuse, n),
		HeapLive:   perTunnel(idle.heapLive, before.heapLive, n),
		StackInuse: perTunnel(idle.stackInuse, before.stackInuse, n),
		Goroutines: float64(idle.goroutines-before.goroutines) / float64(n),
		FDs:        float64(idle.fds.total()-before.fds.total()) / float64(n),
		PipesHeld:  idle.pipes.InUse,
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
	if idle.fds.total()-before.fds.total() != 2*n || idle.goroutines-before.goroutines != 2*n {
		t.Errorf("%d idle tunnels added %d fds and %d goroutines, want %d of each",
			n, idle.fds.total()-before.fds.total(), idle.goroutines-before.goroutines, 2*n)
	}
	var act *activeFigures
	if run.active {
		act = activate(t, s, peer, n, before)
	}

	peer.command(t, "close", "closed")
	peer.wait(t)
	s.waitEnded(t, n)
	after := takeIdleSnapshot(t, s.pipes)
	fig.ResidualHeapLive = (float64(after.heapLive) - float64(before.heapLive)) / float64(n)
	s.mu.Lock()
	fig.Offload, fig.SplicedBytes, fig.CopiedBytes, fig.CopyBuffers = s.offload, s.spliced, s.copied, s.copying
	errs := s.errs
	s.mu.Unlock()
	if len(errs) > 0 {
		t.Fatalf("%d of %d tunnels ended with an error, first: %v", len(errs), n, errs[0])
	}
	want := 2 * int64(n) * idleEchoBytes
	if act != nil {
		want += 2 * act.Streamed
	}
	if total := fig.SplicedBytes + fig.CopiedBytes; total != want {
		t.Errorf("relayed %d bytes, want %d (%d each way per tunnel, and what the streams sent each way)", total, want, idleEchoBytes)
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
	return tunnelFigures{Idle: fig, Active: act}
}

// activate makes the n idle tunnels active and measures this process while
// they are: the peer's gateways stream through every tunnel both ways (each
// keeps activeWindow bytes in flight and checks its echo), and the process
// is sampled activeSamples times, every tunnel having moved bytes both ways
// since the previous sample. Then the streams stop, every byte having come
// back, and the tunnels must be idle again. Last, where every direction
// splices, activeHeldTunnels of them stream again while their gateways stop
// reading, until each of their directions waits for its sink with a pipe
// that holds bytes: the most pipes a tunnel can hold, counted exactly. before
// is the baseline without tunnels.
func activate(t *testing.T, s *idleServer, peer *idlePeer, n int, before idleSnapshot) *activeFigures {
	s.mu.Lock()
	fig := &activeFigures{Tunnels: n, SplicedDirections: s.splicedDirs}
	s.mu.Unlock()
	// What holds at any moment of an active tunnel: its two goroutines (the
	// relay starts none per burst) and two sockets; the only other fds are
	// pipes, and only a spliced direction takes one.
	check := func(state string, snap idleSnapshot) {
		t.Helper()
		if g := snap.goroutines - before.goroutines; g != 2*n {
			t.Errorf("%s: %d tunnels added %d goroutines, want %d", state, n, g, 2*n)
		}
		if d := snap.fds.sockets - before.fds.sockets; d != 2*n {
			t.Errorf("%s: %d tunnels added %d sockets, want %d", state, n, d, 2*n)
		}
		if d := snap.fds.other - before.fds.other; d != 0 {
			t.Errorf("%s: %d fds that are neither sockets nor pipes appeared", state, d)
		}
		if fig.SplicedDirections == 0 && (snap.pipes.InUse != 0 || snap.fds.pipes != before.fds.pipes) {
			t.Errorf("%s: %d pipes in use and %d pipe fds more than before, with no direction spliced",
				state, snap.pipes.InUse, snap.fds.pipes-before.fds.pipes)
		}
	}
	stop := func(phase string, start time.Time) {
		t.Helper()
		answer := peer.ask(t, "stop")
		var sent int64
		if _, err := fmt.Sscanf(answer, "stopped %d", &sent); err != nil {
			t.Fatalf("peer said %q, want \"stopped <bytes>\"", answer)
		}
		t.Logf("%s: %d bytes each way in %v", phase, sent, time.Since(start).Round(time.Millisecond))
		fig.Streamed += sent
		// Every byte came back (the peer checked each echo against what it
		// sent): the tunnels are idle again, and hold what idle tunnels hold.
		s.waitNoPipes()
		after := takeIdleSnapshot(t, s.pipes)
		if d, g := after.fds.total()-before.fds.total(), after.goroutines-before.goroutines; d != 2*n || g != 2*n || after.pipes.InUse != 0 {
			t.Errorf("idle again after streaming: %d tunnels hold %d fds, %d goroutines and %d pipes, want %d, %d and 0",
				n, d, g, after.pipes.InUse, 2*n, 2*n)
		}
	}

	start := time.Now()
	peer.command(t, fmt.Sprintf("stream %d", n), "streaming")
	moved := tunnelBytes(s.reg)
	for i := range activeSamples {
		moved = waitMoved(t, s.reg, moved)
		snap := takeIdleSnapshot(t, s.pipes)
		if p := os.Getenv(activeHeapProfileEnv); p != "" && i == activeSamples-1 {
			writeHeapProfile(t, p)
		}
		check("streaming", snap)
		fig.Streaming = append(fig.Streaming, activeSample{
			HeapInuse: perTunnel(snap.heapInuse, before.heapInuse, n), HeapLive: perTunnel(snap.heapLive, before.heapLive, n),
			StackInuse: perTunnel(snap.stackInuse, before.stackInuse, n),
			PipesInUse: snap.pipes.InUse, PipeFDs: snap.fds.pipes - before.fds.pipes, TCPMemPages: snap.tcpMemPages - before.tcpMemPages,
		})
	}
	stop("streaming", start)

	if fig.SplicedDirections != 2*n {
		t.Logf("not every direction splices (%d of %d): no backed-up tunnels to count pipes of", fig.SplicedDirections, 2*n)
		return fig
	}
	fig.HeldTunnels = min(n, activeHeldTunnels)
	start = time.Now()
	peer.command(t, fmt.Sprintf("stream %d", fig.HeldTunnels), "streaming")
	peer.command(t, "hold", "held")
	waitBackedUp(s, int64(2*fig.HeldTunnels))
	t.Logf("%d tunnels backed up in %v", fig.HeldTunnels, time.Since(start).Round(time.Millisecond))
	held := takeIdleSnapshot(t, s.pipes)
	check("backed up", held)
	fig.HeldPipes, fig.HeldPipeFDs = held.pipes.InUse, held.fds.pipes-before.fds.pipes
	// Nothing moves: the pool and the fd table describe the same moment,
	// each direction of the backed-up tunnels holds one pipe, and each
	// pipe is two fds.
	if !held.steady || fig.HeldPipes != int64(2*fig.HeldTunnels) || fig.HeldPipeFDs != 2*int(fig.HeldPipes) {
		t.Errorf("%d tunnels backed up: %d pipes in use (the pool %+v, steady %v) and %d pipe fds more than before, want %d pipes, two fds each",
			fig.HeldTunnels, fig.HeldPipes, held.pipes, held.steady, fig.HeldPipeFDs, 2*fig.HeldTunnels)
	}
	stop("backed up and drained", start)
	return fig
}

// tunnelBytes is what each open tunnel has moved, by ID: towards the
// sandbox and from it.
func tunnelBytes(reg *Registry) map[uint64][2]int64 {
	m := map[uint64][2]int64{}
	for _, ti := range reg.Tunnels() {
		m[ti.ID] = [2]int64{ti.BytesToSandbox, ti.BytesFromSandbox}
	}
	return m
}

// waitMoved waits until every tunnel in prev has moved bytes both ways
// since prev was taken, and returns what they have moved now. A tunnel's
// turn may take long where many share a slow machine (an emulated one):
// the wait is bounded by two minutes and 100 ms more per tunnel.
func waitMoved(t *testing.T, reg *Registry, prev map[uint64][2]int64) map[uint64][2]int64 {
	t.Helper()
	limit := 2*time.Minute + time.Duration(len(prev))*100*time.Millisecond
	deadline := time.Now().Add(limit)
	for {
		now, behind := tunnelBytes(reg), 0
		for id, p := range prev {
			if c := now[id]; c[0] <= p[0] || c[1] <= p[1] {
				behind++
			}
		}
		if behind == 0 {
			return now
		}
		if time.Now().After(deadline) {
			t.Fatalf("streaming: %d of %d tunnels did not move bytes both ways within %v", behind, len(prev), limit)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitBackedUp waits, up to two minutes, until no tunnel has moved a byte
// for three polls in a row with the given number of pipes in use: the state
// that tunnels whose gateways stopped reading come to and stay in.
func waitBackedUp(s *idleServer, pipes int64) {
	last, still := int64(-1), 0
	for deadline := time.Now().Add(2 * time.Minute); still < 3 && time.Now().Before(deadline); {
		time.Sleep(200 * time.Millisecond)
		to, from := s.reg.Totals()
		if to+from == last && s.pipes.Stats().InUse == pipes {
			still++
		} else {
			still = 0
		}
		last = to + from
	}
}

// ethernetMSS is the TCP segment size of a 1500-byte MTU path with
// timestamps.
const ethernetMSS = 1448

// listenEthernetMSS listens on addr with TCP_MAXSEG at ethernetMSS, which
// the accepted connections inherit and announce, so that both ends of each
// send an Ethernet path's segments: the forwarder's sockets face the
// gateways' and the sandboxes' networks, not loopback's 64 KiB segments,
// from which the kernel would size every socket's send buffer at several
// MiB for a tunnel that backs up to fill.
func listenEthernetMSS(addr string) (net.Listener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_MAXSEG, ethernetMSS)
		}); err != nil {
			return err
		}
		return serr
	}}
	return lc.Listen(context.Background(), "tcp", addr)
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
// (answering "closed"). In between, "stream K" starts streams through the
// first K tunnels ("streaming"), "hold" makes their gateways stop reading
// ("held"), and "stop" ends the streams once every byte sent has come back
// ("stopped B", B the bytes the gateways sent while streaming).
type idlePeer struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
	// state describes the forwarder's side when the peer does not answer.
	state func() string
}

// idlePeerLimit bounds the wait for one answer of the peer: a loaded
// emulated machine opens, streams and closes the tunnels in seconds.
const idlePeerLimit = 3 * time.Minute

func startIdlePeer(t *testing.T, cfg idlePeerConfig, state func() string) *idlePeer {
	t.Helper()
	js, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), idlePeerEnv+"="+string(js))
	cmd.Stderr = os.Stderr
	p := &idlePeer{cmd: cmd, state: state}
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

// ask sends cmd and returns the peer's answer.
func (p *idlePeer) ask(t *testing.T, cmd string) string {
	t.Helper()
	if _, err := fmt.Fprintln(p.in, cmd); err != nil {
		t.Fatalf("peer: %s: %v", cmd, err)
	}
	if !p.scan(t, cmd) {
		t.Fatalf("peer exited before answering %q (its error is above): %v", cmd, p.out.Err())
	}
	return p.out.Text()
}

// scan reads the peer's next line. A peer that has not answered what
// was asked within idlePeerLimit fails t with the forwarder's state and
// is killed, which ends its tunnels and the read.
func (p *idlePeer) scan(t *testing.T, asked string) bool {
	t.Helper()
	stuck := time.AfterFunc(idlePeerLimit, func() {
		t.Errorf("peer: no answer to %q within %v; the forwarder: %s", asked, idlePeerLimit, p.state())
		p.cmd.Process.Kill()
	})
	defer stuck.Stop()
	return p.out.Scan()
}

func (p *idlePeer) expect(t *testing.T, line string) {
	t.Helper()
	if !p.scan(t, line) {
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
	ln, err := listenEthernetMSS("127.0.0.1:0")
	if err != nil {
		return err
	}
	sandbox := ln.(*net.TCPListener)
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
	fmt.Fprintln(stdout, "ready")
	var (
		conns []*ktls.Conn
		st    *streams
	)
	for lines.Scan() {
		switch cmd := lines.Text(); {
		case cmd == "open" && conns == nil:
			conns = make([]*ktls.Conn, cfg.Tunnels)
			if err := forEachTunnel(cfg.Tunnels, func(i int) (err error) {
				conns[i], err = openEchoTunnel(dialer, cfg.Forwarder, target, uint64(i))
				return err
			}); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "open %d\n", cfg.Tunnels)
		case strings.HasPrefix(cmd, "stream ") && conns != nil && st == nil:
			k, err := strconv.Atoi(strings.TrimPrefix(cmd, "stream "))
			if err != nil || k < 1 || k > len(conns) {
				return fmt.Errorf("command %q: want 1 to %d tunnels", cmd, len(conns))
			}
			st = startStreams(conns[:k])
			fmt.Fprintln(stdout, "streaming")
		case cmd == "hold" && st != nil:
			st.hold()
			fmt.Fprintln(stdout, "held")
		case cmd == "stop" && st != nil:
			sent, err := st.stop()
			if err != nil {
				return err
			}
			st = nil
			fmt.Fprintf(stdout, "stopped %d\n", sent)
		case cmd == "close" && conns != nil:
			if err := forEachTunnel(cfg.Tunnels, func(i int) error { return closeTunnel(conns[i]) }); err != nil {
				return err
			}
			sandbox.Close()
			echoes.Wait()
			fmt.Fprintln(stdout, "closed")
			return nil
		default:
			return fmt.Errorf("command %q out of order", cmd)
		}
	}
	return errors.New("stdin ended before \"close\"")
}

// streams are the gateways' streams through the tunnels while they are
// active. Each tunnel has a writer, which sends its pattern in activeChunk
// writes while it has fewer than activeWindow bytes in flight, and a
// reader, which takes the echo back and hashes it. Streams with a window,
// rather than small calls made in turn, give every tunnel bytes in flight
// both ways at every moment by construction, whatever the machine's speed:
// with calls in turn, the share of tunnels in the middle of one would
// depend on how fast the machine answers them. Where the bytes are at a
// given moment (a socket, a pipe, the peer) is the machine's business.
type streams struct {
	each []*tunnelStream
	// held is closed when the gateways stop reading: the readers wait for
	// release, and the writers write without a window until their tunnel
	// has backed up to them. stopped is closed to end the streams.
	held, release, stopped chan struct{}
	wg                     sync.WaitGroup
}

type tunnelStream struct {
	c      *ktls.Conn
	seed   uint64
	credit chan struct{} // one per activeChunk the writer may still send
	// last is the byte count the stream ends at, set before the writer's
	// last write; -1 before.
	last       atomic.Int64
	sent, got  int64
	sentSum    [32]byte
	gotSum     [32]byte
	wErr, rErr error
}

func startStreams(conns []*ktls.Conn) *streams {
	st := &streams{held: make(chan struct{}), release: make(chan struct{}), stopped: make(chan struct{})}
	for i, c := range conns {
		ts := &tunnelStream{c: c, seed: activeSeedBase + uint64(i), credit: make(chan struct{}, activeWindow/activeChunk)}
		ts.last.Store(-1)
		for range activeWindow / activeChunk {
			ts.credit <- struct{}{}
		}
		st.each = append(st.each, ts)
		st.wg.Go(func() { ts.wErr = ts.write(st) })
		st.wg.Go(func() { ts.rErr = ts.read(st) })
	}
	return st
}

func (st *streams) hold() { close(st.held) }

// stop ends every stream after the chunk it is writing, waits for all the
// echoes, and returns what the gateways sent; an echo that differs from
// what was sent is an error.
func (st *streams) stop() (int64, error) {
	close(st.stopped)
	select {
	case <-st.held:
		close(st.release)
	default:
	}
	st.wg.Wait()
	var sent int64
	for i, ts := range st.each {
		switch {
		case ts.wErr != nil:
			return 0, fmt.Errorf("tunnel %d: streaming: %w", i, ts.wErr)
		case ts.rErr != nil:
			return 0, fmt.Errorf("tunnel %d: reading the stream's echo: %w", i, ts.rErr)
		case ts.got != ts.sent || ts.gotSum != ts.sentSum:
			return 0, fmt.Errorf("tunnel %d: the echo (%d bytes, SHA-256 %x) differs from what was sent (%d bytes, SHA-256 %x)",
				i, ts.got, ts.gotSum, ts.sent, ts.sentSum)
		}
		sent += ts.sent
	}
	return sent, nil
}

func (ts *tunnelStream) write(st *streams) error {
	pattern, h := forwardtest.NewPattern(ts.seed), sha256.New()
	buf := make([]byte, activeChunk)
	for {
		select {
		case <-ts.credit:
		case <-st.held:
		case <-st.stopped:
		}
		pattern.Read(buf)
		h.Write(buf)
		last := false
		select {
		case <-st.stopped:
			// Published before the bytes that reach it are written, so the
			// reader knows the end when it reads them.
			last = true
			ts.last.Store(ts.sent + activeChunk)
		default:
		}
		if _, err := ts.c.Write(buf); err != nil {
			return err
		}
		ts.sent += activeChunk
		if last {
			h.Sum(ts.sentSum[:0])
			return nil
		}
	}
}

func (ts *tunnelStream) read(st *streams) error {
	h := sha256.New()
	buf := make([]byte, activeChunk)
	var unacked int
	for {
		if last := ts.last.Load(); last >= 0 && ts.got >= last {
			if ts.got > last {
				return fmt.Errorf("%d bytes came back, %d were sent", ts.got, last)
			}
			h.Sum(ts.gotSum[:0])
			return nil
		}
		select {
		case <-st.held:
			<-st.release
		default:
		}
		n, err := ts.c.Read(buf)
		h.Write(buf[:n])
		ts.got += int64(n)
		for unacked += n; unacked >= activeChunk; unacked -= activeChunk {
			select {
			case ts.credit <- struct{}{}:
			default: // the writer stopped counting (held)
			}
		}
		if err != nil {
			return err
		}
	}
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
