package forward

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"golang.org/x/sys/unix"
)

// Kernel TLS tunnels move mid-stream to another forwarder and on the
// sockets, sessions and record sequences the kernel holds: every byte
// exact both ways, no record the kernel could not authenticate, and no
// session installed twice (the adopted sockets keep theirs).
func TestKernelMoveTunnels(t *testing.T) {
	kerneltest.Require(t)
	moveTLSTunnels(t, ktls.Options{RequireOffload: true}, 8)
}

// Tunnels whose gateway session runs in userspace TLS cannot move: they
// stay and finish exact, and the result says why.
func TestMoveUserspaceTLSTunnelsStay(t *testing.T) {
	moveTLSTunnels(t, ktls.Options{Disable: true}, 4)
}

func moveTLSTunnels(t *testing.T, opts ktls.Options, n int) {
	oldResults := make(chan Result, n)
	fx := newKTLSMoveFixture(t, opts, 0, func(res Result, err error) {
		if err != nil {
			t.Errorf("old Serve of tunnel %d: %v", res.Tunnel.ID, err)
		}
		oldResults <- res
	})
	oldReg, nuReg, nu, ln := fx.oldReg, fx.nuReg, fx.nu, fx.ln
	dialer, err := gateway.New(gateway.Config{TLS: fx.gatewayTLS, Signer: fx.signer, KTLS: ktls.Options{Disable: true}, DialTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer dialer.Close()
	up := forwardtest.NewPacedUpstream(t, 16<<10, 2*time.Millisecond)
	stat0, statErr := kerneltest.ReadStat()

	clients := make([]*forwardtest.Stream, n)
	conns := make([]net.Conn, n)
	var wg sync.WaitGroup
	start, release := make(chan struct{}), make(chan struct{})
	for i := range n {
		c, err := dialer.Dial(context.Background(), gateway.Route{Forwarder: ln.Addr().String(), Sandbox: "sbx-move", Target: up.Addr()})
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
		wg.Go(func() { clients[i] = forwardtest.RunStream(c, nil, uint64(i+1), start, release) })
	}
	waitStreaming(t, oldReg, up, n, func() { close(start) })
	nuResults := make(chan Result, n)
	var runs sync.WaitGroup
	res, _ := upgrade(t, oldReg, nu, nuReg, nuResults, &runs)
	movable := !opts.Disable
	if movable && (res.Moved != n || len(res.Stayed) != 0) {
		t.Errorf("moved %d, stayed %v (%v); want all %d moved", res.Moved, res.Stayed, res.Stays, n)
	}
	// A userspace session stays: its relay holds decrypted bytes (the
	// pause is refused), or it holds none and the session cannot be
	// handed off.
	if !movable && (res.Moved != 0 || res.Stayed[handoff.StayConn]+res.Stayed[handoff.StayPause] != n) {
		t.Errorf("moved %d, stayed %v (%v); want all %d to stay: userspace TLS", res.Moved, res.Stayed, res.Stays, n)
	}
	close(release)
	waitStreams(t, &wg, conns, up, oldReg, nuReg)
	up.Close()
	runs.Wait()
	fx.close()
	close(oldResults)
	close(nuResults)
	forwardtest.ExactBothWays(t, clients, up.Results())
	moved, spliced := 0, 0
	for r := range oldResults {
		if r.Moved {
			moved++
		}
	}
	for r := range nuResults {
		if r.Relay.AToB.Spliced && r.Relay.BToA.Spliced {
			spliced++
		}
	}
	if moved != res.Moved || (movable && spliced != n) {
		t.Errorf("old Serves ended moved: %d; adopted relays splicing both ways: %d; want %d each", moved, spliced, res.Moved)
	}
	if statErr == nil && movable {
		kerneltest.InstalledOnce(t, stat0, int64(n))
	}
}

// Kernel TLS standby connections move to another forwarder while they
// wait for their first preamble byte; the gateways then write their
// preambles on them, and the new forwarder carries the tunnels on the
// sockets, sessions and record sequences the kernel holds: every byte
// exact both ways, no record the kernel could not authenticate, and no
// session installed twice (the adopted sockets keep theirs). Every other
// one is refused by the new process: it waits on here, on the connection
// adopted back, and its tunnel runs here the same way.
func TestKernelMoveStandby(t *testing.T) {
	kerneltest.Require(t)
	moveTLSStandby(t, ktls.Options{RequireOffload: true}, 4)
}

// Standby connections whose session runs in userspace TLS cannot move:
// their wait, interrupted (a read deadline in the past on a crypto/tls
// session), resumes, and their tunnels run here, exact.
func TestMoveUserspaceTLSStandbyStays(t *testing.T) {
	moveTLSStandby(t, ktls.Options{Disable: true}, 2)
}

func moveTLSStandby(t *testing.T, opts ktls.Options, n int) {
	type end struct {
		res Result
		err error
	}
	oldEnds, nuEnds := make(chan end, n), make(chan end, n)
	fx := newKTLSMoveFixture(t, opts, 5*time.Minute, func(res Result, err error) { oldEnds <- end{res, err} })
	oldReg, nuReg, nu, ln, signer := fx.oldReg, fx.nuReg, fx.nu, fx.ln, fx.signer
	size := int64(kerneltest.BulkMiB(t, 1)) << 20
	up := forwardtest.NewSizedUpstream(t, func(int) int64 { return size + 1 })
	stat0, statErr := kerneltest.ReadStat()
	ks0 := ktls.Stats()
	conns := make([]*tls.Conn, n)
	for i := range conns {
		c, err := tls.Dial("tcp", ln.Addr().String(), fx.gatewayTLS)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns[i] = c
	}
	waitStandby(t, oldReg, n)

	var runs sync.WaitGroup
	adopted := make(chan *AdoptedStandby, n)
	var offered atomic.Int64
	s := standbySession(t, nu, func(offer int64) bool { return offer%2 == 0 }, adopted, &offered)
	ctx, cancel := context.WithTimeout(context.Background(), streamsLimit)
	defer cancel()
	res := oldReg.MoveStandby(ctx, handoff.SenderMover(s))
	s.Close()
	movable := !opts.Disable
	if movable && (res.Moved != n-n/2 || res.Stayed[handoff.StayRefused] != n/2 || len(res.Stays) != n/2) {
		t.Fatalf("moved %d, stays %v; want %d moved, %d refused", res.Moved, res.Stays, n-n/2, n/2)
	}
	if !movable && (res.Moved != 0 || res.Stayed[handoff.StayConn] != n) {
		t.Fatalf("moved %d, stays %v; want all %d to stay: userspace TLS", res.Moved, res.Stays, n)
	}
	for range res.Moved {
		a := <-adopted
		runs.Go(func() {
			r, err := a.Serve(nil)
			nuEnds <- end{r, err}
		})
	}
	waitStandby(t, nuReg, res.Moved)
	waitStandby(t, oldReg, n-res.Moved)

	clients := make([]*forwardtest.Stream, n)
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			sc := &forwardtest.Stream{}
			clients[i] = sc
			now := time.Now()
			claims := preamble.Claims{SandboxID: "sbx-standby", Target: up.Addr(), IssuedAt: now, ExpiresAt: now.Add(time.Minute)}
			if sc.Err = preamble.Send(context.Background(), c, signer, claims); sc.Err != nil {
				return
			}
			errc := make(chan error, 1)
			go func() {
				var err error
				sc.Sent, err = forwardtest.SendPattern(c, size, uint64(i+1))
				sc.SentN = size
				errc <- err
			}()
			h := sha256.New()
			sc.RecvN, sc.Err = io.Copy(h, c)
			copy(sc.Recv[:], h.Sum(nil))
			if err := <-errc; sc.Err == nil {
				sc.Err = err
			}
		})
	}
	netConns := make([]net.Conn, n)
	for i, c := range conns {
		netConns[i] = c
	}
	waitStreams(t, &wg, netConns, up, oldReg, nuReg)
	up.Close()
	runs.Wait()
	fx.close()
	close(oldEnds)
	close(nuEnds)
	forwardtest.ExactBothWays(t, clients, up.Results())
	movedEnds, tunnelsHere, splicedHere := 0, 0, 0
	for e := range oldEnds {
		if isStandbyEnd(e.err, StandbyMoved) {
			movedEnds++
		} else if e.err != nil || e.res.Tunnel.BytesToSandbox != size || e.res.Tunnel.BytesFromSandbox != size+1 {
			t.Errorf("old Serve: %+v, %v", e.res.Tunnel, e.err)
		} else {
			tunnelsHere++
			if e.res.Relay.AToB.Spliced && e.res.Relay.BToA.Spliced {
				splicedHere++
			}
		}
	}
	spliced := 0
	for e := range nuEnds {
		if e.err != nil || e.res.Tunnel.BytesToSandbox != size || e.res.Tunnel.BytesFromSandbox != size+1 {
			t.Errorf("new Serve: %+v, %v", e.res.Tunnel, e.err)
		}
		if e.res.Relay.AToB.Spliced && e.res.Relay.BToA.Spliced {
			spliced++
		}
	}
	if movedEnds != res.Moved || tunnelsHere != n-res.Moved || spliced != res.Moved || (movable && splicedHere != tunnelsHere) {
		t.Errorf("old Serves ended moved: %d, carried a tunnel: %d (%d splicing both ways); adopted tunnels splicing both ways: %d; want %d, %d, %d",
			movedEnds, tunnelsHere, splicedHere, spliced, res.Moved, n-res.Moved, res.Moved)
	}
	if _, ends := oldReg.Standby(); ends[StandbyMoved] != uint64(res.Moved) || len(ends) > 1 {
		t.Errorf("old registry's standby ends %v, want %d moved", ends, res.Moved)
	}
	if _, opened := nuReg.Counts(); opened != uint64(res.Moved) {
		t.Errorf("the new registry opened %d tunnels, want %d", opened, res.Moved)
	}
	// Each handed off once, and adopted once: by the new process, or
	// back here.
	if ks := ktls.Stats(); movable && (ks.HandedOff-ks0.HandedOff != uint64(n) || ks.Adopted-ks0.Adopted != uint64(n)) {
		t.Errorf("ktls handed off %d connections and adopted %d, want %d each", ks.HandedOff-ks0.HandedOff, ks.Adopted-ks0.Adopted, n)
	}
	if statErr == nil && movable {
		kerneltest.InstalledOnce(t, stat0, int64(n))
	}
}

// streamsLimit bounds a move test's waits (the move, the streams' end):
// a loaded emulated machine is done with each in seconds.
const streamsLimit = 2 * time.Minute

// waitStreams waits for the gateways' streams (wg) to end. A stream that
// has not ended within streamsLimit fails t with what each registry's open
// tunnels have moved and what the upstream received, and then conns are
// closed, which ends the tunnels: the test and its cleanups return instead
// of hanging until the binary's timeout.
func waitStreams(t *testing.T, wg *sync.WaitGroup, conns []net.Conn, up *forwardtest.Upstream, regs ...*Registry) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return
	case <-time.After(streamsLimit):
	}
	var b strings.Builder
	for i, reg := range regs {
		fmt.Fprintf(&b, "; registry %d:", i)
		for _, ti := range reg.Tunnels() {
			b.WriteString(" " + describeTunnel(ti) + ";")
		}
	}
	t.Errorf("the streams have not ended within %v: the upstream received %d bytes%s", streamsLimit, up.Received(), b.String())
	procNet, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Logf("/proc/net/tcp: %v", err)
	}
	t.Logf("sockets with bytes queued (local remote state tx_queue:rx_queue, hex):%s", forwardtest.QueuedSockets(t, procNet))
	if out, err := exec.Command("ss", "-tnmeio", "state", "established").CombinedOutput(); err == nil {
		t.Logf("ss -tnmeio (the sockets' memory, windows and timers):\n%s", out)
	}
	stacks := make([]byte, 8<<20)
	t.Logf("the relays' goroutines:\n%s", forwardtest.GoroutineBlocks(string(stacks[:runtime.Stack(stacks, true)]), "splice.(*Relay)"))
	for _, reg := range regs {
		for _, ti := range reg.Tunnels() {
			t.Logf("tunnel %d: %s", ti.ID, peekStalled(reg, ti))
		}
	}
	for _, c := range conns {
		c.Close()
	}
	<-done
}

// peekStalled peeks (MSG_PEEK, non-blocking) at the forwarder's socket to
// ti's gateway, which runs the kernel TLS receive path once more, and says
// whether the tunnel then moved bytes towards the sandbox within 5 s: a
// record parser that waits behind a window TCP closed after its last look
// copies the partial record out on such a call and reopens the window.
func peekStalled(reg *Registry, ti TunnelInfo) string {
	peer, err := netip.ParseAddrPort(ti.Peer)
	if err != nil {
		return err.Error()
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err.Error()
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		sa, err := unix.Getpeername(fd)
		in4, ok := sa.(*unix.SockaddrInet4)
		if err != nil || !ok || netip.AddrPortFrom(netip.AddrFrom4(in4.Addr), uint16(in4.Port)) != peer {
			continue
		}
		inq, _ := unix.IoctlGetInt(fd, unix.SIOCINQ)
		var b [1]byte
		oob := make([]byte, unix.CmsgSpace(1))
		n, _, _, _, perr := unix.Recvmsg(fd, b[:], oob, unix.MSG_PEEK|unix.MSG_DONTWAIT)
		before := ti.BytesToSandbox
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			for _, now := range reg.Tunnels() {
				if now.ID == ti.ID && now.BytesToSandbox > before {
					return fmt.Sprintf("fd %d (%d bytes queued): a peek read %d (%v), and the tunnel moved on: +%d bytes to the sandbox", fd, inq, n, perr, now.BytesToSandbox-before)
				}
			}
		}
		return fmt.Sprintf("fd %d (%d bytes queued): a peek read %d (%v); the tunnel did not move on within 5 s", fd, inq, n, perr)
	}
	return "no socket of this process has the gateway " + ti.Peer + " as its peer"
}

// ktlsMoveFixture is what the kernel move tests share: two forwarders of
// one gateway key that move and adopt with opts, and a listener whose
// connections old serves once their handshake (mutual TLS 1.3, the
// gateway's certificate verified, the session in kernel TLS as opts says)
// is done, telling served how each Serve ended.
type ktlsMoveFixture struct {
	oldReg, nuReg *Registry
	old, nu       *Forwarder
	ln            net.Listener
	signer        *preamble.Signer
	gatewayTLS    *tls.Config // the gateway's side
	serves        sync.WaitGroup
}

func newKTLSMoveFixture(t testing.TB, opts ktls.Options, standbyTimeout time.Duration, served func(Result, error)) *ktlsMoveFixture {
	ktls.Probe() // cached for the process: its throwaway sessions stay out of the counters
	ca := testpki.NewCA(t, "move CA")
	serverLeaf, gatewayLeaf := ca.Server(t), ca.Client(t, "gateway")
	seed := make([]byte, ed25519.SeedSize)
	rand.Read(seed)
	key := ed25519.NewKeyFromSeed(seed)
	newForwarder := func(reg *Registry) *Forwarder {
		v, err := preamble.NewVerifier(preamble.VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw-1": key.Public().(ed25519.PublicKey)}, RequireBinding: true})
		if err != nil {
			t.Fatal(err)
		}
		pol, err := NewTargetPolicy([]string{"127.0.0.0/8"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		f, err := New(Config{Verifier: v, Policy: pol, Registry: reg, RequireClientCertificate: true, StandbyTimeout: standbyTimeout,
			HandOffConn: ktls.HandOffConn, AdoptConn: ktls.AdoptConn(opts), MoveName: testMoveName})
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	fx := &ktlsMoveFixture{oldReg: NewRegistry(), nuReg: NewRegistry()}
	fx.old, fx.nu = newForwarder(fx.oldReg), newForwarder(fx.nuReg)
	signer, err := preamble.NewSigner("gw-1", key)
	if err != nil {
		t.Fatal(err)
	}
	fx.signer = signer
	// The gateway's side in userspace TLS: the kernel's counters then
	// count the forwarder's sessions only.
	fx.gatewayTLS = &tls.Config{Certificates: []tls.Certificate{gatewayLeaf.TLS}, RootCAs: ca.Pool, ServerName: "localhost", MinVersion: tls.VersionTLS13}
	serverCfg := &tls.Config{Certificates: []tls.Certificate{serverLeaf.TLS}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: ca.Pool, MinVersion: tls.VersionTLS13}
	if fx.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	forwardtest.CheckLeaks(t)
	t.Cleanup(fx.close)
	fx.serves.Go(func() {
		for {
			c, err := fx.ln.Accept()
			if err != nil {
				return
			}
			fx.serves.Go(func() {
				kc := ktls.Server(c, serverCfg, opts)
				if err := kc.HandshakeContext(context.Background()); err != nil {
					kc.Close()
					t.Errorf("handshake: %v", err)
					return
				}
				cs := kc.ConnectionState()
				binding, _ := preamble.ChannelBinding(cs)
				leaf := cs.PeerCertificates[0]
				served(fx.old.Serve(Gateway{Conn: kc, Binding: binding, Peer: c.RemoteAddr().String(),
					Certificate: leaf.Subject.String(), CertificateNames: []string{leaf.Subject.CommonName}, CertificateVerified: len(cs.VerifiedChains) > 0}))
			})
		}
	})
	return fx
}

// close closes the listener and waits for old's Serves to return.
func (fx *ktlsMoveFixture) close() {
	fx.ln.Close()
	fx.serves.Wait()
}
