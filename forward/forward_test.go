package forward

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// fixture is a forwarder listening on loopback, serving plain TCP clients
// (the kTLS side is tested in the Caddy package and the VM).
type fixture struct {
	gw   *forwardtest.Gateway
	reg  *Registry
	fwd  *Forwarder
	ln   net.Listener
	wg   sync.WaitGroup
	mu   sync.Mutex
	errs []error
	res  []Result
	// verified is what the fixture tells Serve about each client it
	// accepts from now on (Gateway.CertificateVerified).
	verified atomic.Bool
	// wrap, when set, is what Serve gets of each client it accepts from
	// now on, instead of the connection.
	wrap atomic.Pointer[func(net.Conn) net.Conn]
}

func newFixture(t testing.TB, mod func(*Config)) *fixture {
	t.Helper()
	f := &fixture{gw: forwardtest.NewGateway(t, "gw-1"), reg: NewRegistry()}
	v, err := preamble.NewVerifier(preamble.VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw-1": f.gw.Pub}})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := NewTargetPolicy([]string{"127.0.0.0/8"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pipes := splice.NewPipePool(0, 0)
	// PreambleTimeout outlasts a preamble read whose goroutine waits
	// seconds for a CPU (-race, every package's tests on two cores: a read
	// that starts after its deadline fails though the bytes are there);
	// the tests of the timeout set their own.
	cfg := Config{Verifier: v, Policy: pol, Registry: f.reg, Pipes: pipes, PreambleTimeout: 10 * time.Second}
	if mod != nil {
		mod(&cfg)
	}
	if f.fwd, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	if f.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			c, err := f.ln.Accept()
			if err != nil {
				return
			}
			f.wg.Add(1)
			go func() {
				defer f.wg.Done()
				conn := c
				if w := f.wrap.Load(); w != nil {
					conn = (*w)(c)
				}
				res, err := f.fwd.Serve(Gateway{Conn: conn, Peer: c.RemoteAddr().String(), CertificateVerified: f.verified.Load()})
				f.mu.Lock()
				f.errs, f.res = append(f.errs, err), append(f.res, res)
				f.mu.Unlock()
			}()
		}
	}()
	t.Cleanup(func() { f.ln.Close(); f.wg.Wait(); pipes.Close() })
	return f
}

func (f *fixture) dial(t testing.TB) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", f.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	return c.(*net.TCPConn)
}

// wait returns the Serve errors once n tunnels have been served.
func (f *fixture) wait(t testing.TB, n int) []error {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		f.mu.Lock()
		if len(f.errs) >= n {
			errs := append([]error(nil), f.errs...)
			f.mu.Unlock()
			return errs
		}
		f.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %d tunnels to end", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// runTunnel writes the preamble and `send` bytes (followed by half-close),
// reads until EOF, and returns what it sent and received.
func runTunnel(t testing.TB, c *net.TCPConn, frame []byte, send int64, seed uint64) (sentSum, recvSum [32]byte, recvN int64) {
	t.Helper()
	defer c.Close()
	errc := make(chan error, 1)
	go func() {
		if _, err := c.Write(frame); err != nil {
			errc <- err
			return
		}
		var err error
		sentSum, err = forwardtest.SendPattern(c, send, seed)
		errc <- err
	}()
	h := sha256.New()
	n, err := io.Copy(h, c)
	if err != nil {
		t.Errorf("client read: %v", err)
	}
	if err := <-errc; err != nil {
		t.Errorf("client write: %v", err)
	}
	copy(recvSum[:], h.Sum(nil))
	return sentSum, recvSum, n
}

func TestServeRelaysExactBytesBothWays(t *testing.T) {
	forwardtest.CheckLeaks(t)
	size := forwardtest.TransferMiB(t, 64) << 20
	up := forwardtest.NewUpstream(t, size+7)
	f := newFixture(t, nil)
	sent, recv, n := runTunnel(t, f.dial(t), f.gw.Frame(t, "sbx-1", up.Addr()), size, 1)
	if errs := f.wait(t, 1); errs[0] != nil {
		t.Fatalf("Serve: %v", errs[0])
	}
	up.Close()
	r := up.Results()[0]
	if r.Received != size || r.RecvSum != sent {
		t.Errorf("upstream got %d bytes (sha %x), client sent %d (sha %x)", r.Received, r.RecvSum, size, sent)
	}
	if n != size+7 || recv != r.SentSum {
		t.Errorf("client got %d bytes (sha %x), upstream sent %d (sha %x)", n, recv, size+7, r.SentSum)
	}
	res := f.res[0]
	if res.Tunnel.BytesToSandbox != size || res.Tunnel.BytesFromSandbox != size+7 {
		t.Errorf("meters: to %d from %d, want %d and %d", res.Tunnel.BytesToSandbox, res.Tunnel.BytesFromSandbox, size, size+7)
	}
	// TCP to TCP: both directions must run on splice(2), with no userspace copy.
	for _, d := range []splice.DirectionStats{res.Relay.AToB, res.Relay.BToA} {
		if !d.Spliced || d.CopyBytes != 0 || d.SpliceBytes != d.Bytes {
			t.Errorf("direction not fully spliced: %+v", d)
		}
	}
	act := f.reg.Activity()
	if len(act) != 1 || act[0].Sandbox != "sbx-1" || act[0].BytesToSandbox != size || act[0].BytesFromSandbox != size+7 || act[0].OpenTunnels != 0 || act[0].TotalTunnels != 1 {
		t.Errorf("activity = %+v", act)
	}
	if dp := f.reg.DataPath(); dp.SpliceBytes != 2*size+7 || dp.CopyBytes != 0 {
		t.Errorf("data path = %+v", dp)
	}
	if open, opened := f.reg.Counts(); open != 0 || opened != 1 {
		t.Errorf("counts: open %d opened %d", open, opened)
	}
}

// A client that writes tenant bytes in the same segment as the preamble:
// ReadFrame must not swallow them.
func TestServePreambleAndDataInOneWrite(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	f := newFixture(t, nil)
	c := f.dial(t)
	payload := []byte("hello sandbox, right behind the preamble")
	if _, err := c.Write(append(f.gw.Frame(t, "sbx-2", up.Addr()), payload...)); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Fatalf("gateway read %d bytes, err %v: want an orderly end and nothing (the upstream sends nothing)", n, err)
	}
	c.Close()
	if errs := f.wait(t, 1); errs[0] != nil {
		t.Fatalf("Serve: %v", errs[0])
	}
	up.Close()
	if r := up.Results()[0]; r.Received != int64(len(payload)) || r.RecvSum != sha256.Sum256(payload) {
		t.Fatalf("upstream received %d bytes, want exactly the %d payload bytes", r.Received, len(payload))
	}
}

// Unwrap: bytes a wrapper buffered past the preamble reach the target first.
func TestServeForwardsBufferedBytesFirst(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	f := newFixture(t, nil)
	b, a := forwardtest.TCPPair(t)
	frame := f.gw.Frame(t, "sbx-3", up.Addr())
	done := make(chan error, 1)
	go func() {
		_, err := f.fwd.Serve(Gateway{
			Conn:   &bufferedConn{Conn: a, r: io.MultiReader(bytes.NewReader(frame), a)},
			Unwrap: func() (net.Conn, []byte) { return a, []byte("buffered-") },
		})
		done <- err
	}()
	b.Write([]byte("from-socket"))
	b.CloseWrite()
	io.Copy(io.Discard, b)
	b.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	up.Close()
	if want := sha256.Sum256([]byte("buffered-from-socket")); up.Results()[0].RecvSum != want {
		t.Fatalf("upstream got %d bytes in the wrong order or content", up.Results()[0].Received)
	}
}

// refuserConn records that the forwarder refused it through Refuse.
type refuserConn struct {
	*net.TCPConn
	refused atomic.Bool
}

func (c *refuserConn) Refuse() error {
	c.refused.Store(true)
	return c.TCPConn.Close()
}

// A refused tunnel ends through the Refuser under the client's buffer
// (Unwrap), which a *ktls.Conn is, not with an orderly close of the wrapper.
func TestServeRefusesThroughRefuser(t *testing.T) {
	forwardtest.CheckLeaks(t)
	f := newFixture(t, nil)
	b, a := forwardtest.TCPPair(t)
	defer b.Close()
	under := &refuserConn{TCPConn: a}
	b.Write([]byte("not a preamble"))
	_, err := f.fwd.Serve(Gateway{
		Conn:   &bufferedConn{Conn: a, r: a},
		Unwrap: func() (net.Conn, []byte) { return under, nil },
	})
	if ReasonOf(err) != string(preamble.ReasonBadMagic) || !under.refused.Load() {
		t.Errorf("Serve: %v, Refuse called: %v; want bad-magic, refused through Refuse", err, under.refused.Load())
	}
}

type bufferedConn struct {
	net.Conn
	r io.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func TestRejections(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	closedPort := forwardtest.ClosedPort(t)
	f := newFixture(t, func(c *Config) { c.PreambleTimeout = 300 * time.Millisecond })
	other := forwardtest.NewGateway(t, "gw-1") // same key ID, different key
	unknown := forwardtest.NewGateway(t, "gw-unknown")
	cases := []struct {
		name   string
		send   func(c *net.TCPConn)
		reason string
	}{
		{"bad-signature", func(c *net.TCPConn) { c.Write(other.Frame(t, "sbx", up.Addr())) }, "bad-signature"},
		{"unknown-key", func(c *net.TCPConn) { c.Write(unknown.Frame(t, "sbx", up.Addr())) }, "unknown-key"},
		{"bad-magic", func(c *net.TCPConn) { c.Write([]byte("GET / HTTP/1.1\r\n\r\n")) }, "bad-magic"},
		{"timeout", func(c *net.TCPConn) { c.Write(f.gw.Frame(t, "sbx", up.Addr())[:10]) }, "timeout"},
		{"truncated", func(c *net.TCPConn) { c.Write(f.gw.Frame(t, "sbx", up.Addr())[:10]); c.CloseWrite() }, "truncated"},
		{"target-denied", func(c *net.TCPConn) {
			c.Write(f.gw.Frame(t, "sbx", netip.MustParseAddrPort("169.254.169.254:80")))
		}, "target-denied"},
		{"dial-failed", func(c *net.TCPConn) { c.Write(f.gw.Frame(t, "sbx", closedPort)) }, "dial-failed"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { f.refused(t, i+1, tc.reason, tc.send) })
	}
	replay := f.gw.Frame(t, "sbx", up.Addr())
	t.Run("replayed-nonce", func(t *testing.T) {
		for j := 0; j < 2; j++ {
			c := f.dial(t)
			c.Write(replay)
			c.CloseWrite()
			io.Copy(io.Discard, c)
			c.Close()
		}
		errs := f.wait(t, len(cases)+2)
		// Either may be recorded first: the client sees EOF before Serve returns.
		got := map[string]int{ReasonOf(errs[len(cases)]): 1}
		got[ReasonOf(errs[len(cases)+1])]++
		if got[""] != 1 || got["replayed-nonce"] != 1 {
			t.Errorf("outcomes %v, %v; want one success and one replayed-nonce", errs[len(cases)], errs[len(cases)+1])
		}
	})
	if got := up.Accepted(); got != 1 {
		t.Errorf("upstream accepted %d connections; only the one valid tunnel may dial", got)
	}
	rej := f.reg.RefusedTunnels()
	for _, tc := range cases {
		if rej[tc.reason] != 1 {
			t.Errorf("rejections[%q] = %d, want 1 (all: %v)", tc.reason, rej[tc.reason], rej)
		}
	}
	if rej["replayed-nonce"] != 1 {
		t.Errorf("rejections = %v", rej)
	}
}

func TestDrainRefusesNewAndClosesAfterGrace(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	f := newFixture(t, nil)
	c := f.dial(t)
	defer c.Close()
	c.Write(append(f.gw.Frame(t, "sbx-d", up.Addr()), "x"...))
	for {
		if open, _ := f.reg.Counts(); open == 1 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if forced := f.reg.Drain(ctx); forced != 1 {
		t.Fatalf("Drain forced %d tunnels, want 1", forced)
	}
	// The idle tunnel was closed by the drain: the client sees EOF.
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("client after drain: %v", err)
	}
	// Draining is refused before the preamble is read, with a reset (a
	// TCP client has no alert) that can arrive before connect(2) returns.
	if c2, err := net.Dial("tcp", f.ln.Addr().String()); err == nil {
		defer c2.Close()
		c2.Write(f.gw.Frame(t, "sbx-d", up.Addr()))
	} else if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatal(err)
	}
	// Either may be recorded first: the drained tunnel's client sees EOF
	// before its Serve returns.
	errs := f.wait(t, 2)
	got := map[string]int{ReasonOf(errs[0]): 1}
	got[ReasonOf(errs[1])]++
	if got[string(ReasonDraining)] != 1 || !errors.Is(errs[0], context.Canceled) && !errors.Is(errs[1], context.Canceled) {
		t.Fatalf("outcomes %v, %v; want one drained (context canceled) and one refused as draining", errs[0], errs[1])
	}
}

// MaxTunnelsPerSandbox caps one sandbox's open tunnels: one more is refused as
// tunnel-limit before any dial, other sandboxes are not affected, and a
// tunnel that ends makes room again.
func TestTunnelLimitPerSandbox(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up := forwardtest.NewUpstream(t, 0)
	f := newFixture(t, func(c *Config) { c.MaxTunnelsPerSandbox = 2 })
	open := func(sandbox string) *net.TCPConn {
		c := f.dial(t)
		t.Cleanup(func() { c.Close() })
		if _, err := c.Write(f.gw.Frame(t, sandbox, up.Addr())); err != nil {
			t.Fatal(err)
		}
		return c
	}
	waitOpen := func(want int) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if open, _ := f.reg.Counts(); open == want {
				return
			} else if time.Now().After(deadline) {
				t.Fatalf("%d tunnels open, want %d", open, want)
			}
		}
	}
	a1 := open("sbx-a")
	open("sbx-a")
	waitOpen(2)
	f.refused(t, 1, string(ReasonTunnelLimit), func(c *net.TCPConn) { c.Write(f.gw.Frame(t, "sbx-a", up.Addr())) })
	if n := up.Accepted(); n != 2 {
		t.Errorf("the target was dialed %d times, want 2: the refused tunnel must not dial", n)
	}
	open("sbx-b")
	waitOpen(3)
	a1.Close()
	waitOpen(2)
	open("sbx-a")
	waitOpen(3)
	if rej := f.reg.RefusedTunnels(); rej[string(ReasonTunnelLimit)] != 1 || len(rej) != 1 {
		t.Errorf("rejections %v, want one tunnel-limit", rej)
	}
}

// MaxTunnelLifetime ends a tunnel that is still open at that age as a failure:
// both sides reset (plain TCP here), the bytes sent before arrive, Serve
// returns a *LifetimeError and the registry counts it.
func TestTunnelLifetime(t *testing.T) {
	forwardtest.CheckLeaks(t)
	// The target reads and never answers nor closes: neither direction
	// ends by itself.
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type upResult struct {
		n   int64
		err error
	}
	upDone := make(chan upResult, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			upDone <- upResult{err: err}
			return
		}
		defer c.Close()
		n, err := io.Copy(io.Discard, c)
		upDone <- upResult{n, sockerr.ReadError(c, err)}
	}()
	const lifetime = 300 * time.Millisecond
	f := newFixture(t, func(c *Config) { c.MaxTunnelLifetime = lifetime })
	c := f.dial(t)
	defer c.Close()
	payload := bytes.Repeat([]byte("x"), 1000)
	start := time.Now()
	if _, err := c.Write(append(f.gw.Frame(t, "sbx-old", ln.Addr().(*net.TCPAddr).AddrPort()), payload...)); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 || !errors.Is(sockerr.ReadError(c, err), syscall.ECONNRESET) {
		t.Errorf("client read %d bytes, err %v; want the tunnel reset at its lifetime", n, err)
	}
	var le *LifetimeError
	if err := f.wait(t, 1)[0]; !errors.As(err, &le) || le.Lifetime != lifetime || !strings.Contains(err.Error(), "lifetime of 300ms") {
		t.Fatalf("Serve: %v, want a *LifetimeError of %v", err, lifetime)
	}
	if age := time.Since(start); age < lifetime {
		t.Errorf("the tunnel ended after %v, before its lifetime", age)
	}
	if r := <-upDone; r.n != int64(len(payload)) || !errors.Is(r.err, syscall.ECONNRESET) {
		t.Errorf("target read %d bytes, then %v; want the %d bytes, then a reset", r.n, r.err, len(payload))
	}
	if n := f.reg.Expired(); n != 1 {
		t.Errorf("registry counts %d expired tunnels, want 1", n)
	}
}

// Revoke ends the open tunnels whose key trusted refuses, a key ID now
// bound to another key included, with a *RevokedError as the cause, and
// leaves the others running.
func TestRegistryRevoke(t *testing.T) {
	reg := NewRegistry()
	keep, gone, rebound := forwardtest.NewGateway(t, "gw-1"), forwardtest.NewGateway(t, "gw-2"), forwardtest.NewGateway(t, "gw-1")
	open := func(g *forwardtest.Gateway) (*Tunnel, context.Context) {
		tun, ctx, err := reg.Open("sbx", "10.0.0.1:1", Origin{Peer: "peer", KeyID: g.Signer.KeyID(), key: g.Pub}, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(tun.Close)
		return tun, ctx
	}
	_, kept := open(keep)
	_, revoked := open(gone)
	_, reboundCtx := open(rebound)
	n := reg.Revoke(func(id string, key ed25519.PublicKey) bool { return id == "gw-1" && key.Equal(keep.Pub) })
	if n != 2 || reg.Revoked() != 2 {
		t.Fatalf("Revoke ended %d tunnels (counted %d), want 2", n, reg.Revoked())
	}
	for name, ctx := range map[string]context.Context{"gw-2": revoked, "gw-1 bound to another key": reboundCtx} {
		var re *RevokedError
		if !errors.As(context.Cause(ctx), &re) || ctx.Err() == nil {
			t.Errorf("%s: cause %v, want a *RevokedError", name, context.Cause(ctx))
		}
	}
	if kept.Err() != nil {
		t.Errorf("the trusted key's tunnel was ended: %v", context.Cause(kept))
	}
}

// KeyClients: a bound key is accepted only with one of its client names
// among the certificate's (Common Name or DNS name); unbound keys with any.
func TestKeyClients(t *testing.T) {
	f := &Forwarder{cfg: Config{KeyClients: map[string][]string{"gw-1": {"gateway-1", "gw1.internal"}}}}
	for _, tc := range []struct {
		key   string
		names []string
		ok    bool
	}{
		{"gw-1", []string{"gateway-1"}, true},
		{"gw-1", []string{"other", "gw1.internal"}, true},
		{"gw-1", []string{"gateway-2", "gw2.internal"}, false},
		{"gw-1", nil, false},
		{"gw-2", nil, true},
	} {
		err := f.checkKeyClient(tc.key, tc.names)
		if tc.ok != (err == nil) || !tc.ok && ReasonOf(err) != string(ReasonKeyNotForClient) {
			t.Errorf("key %s with certificate names %v: %v, want accepted %v", tc.key, tc.names, err, tc.ok)
		}
	}
}

// readCounter counts the reads a forwarder makes on a client connection.
type readCounter struct {
	net.Conn
	reads atomic.Int64
}

func (c *readCounter) Read(p []byte) (int, error) {
	c.reads.Add(1)
	return c.Conn.Read(p)
}

// RequireClientCertificate: a client without a verified client certificate
// is refused (no-client-certificate, counted, a reset) before a byte of it
// is read, even while the forwarder drains, and nothing is dialed; the same
// forwarder carries a client that has one, exact bytes both ways.
func TestRequireClientCertificate(t *testing.T) {
	forwardtest.CheckLeaks(t)
	const size = 256 << 10
	up := forwardtest.NewUpstream(t, size+3)
	f := newFixture(t, func(c *Config) { c.RequireClientCertificate = true })

	// Through the listener, as a gateway: a valid frame, refused with a
	// reset, which can arrive before connect(2) returns (nothing is read
	// first), or on the write, which then reports it instead of the read.
	if c, err := net.Dial("tcp", f.ln.Addr().String()); err == nil {
		_, werr := c.Write(f.gw.Frame(t, "sbx", up.Addr()))
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, rerr := io.Copy(io.Discard, c)
		rerr = sockerr.ReadError(c, rerr)
		c.Close()
		if n != 0 || !errors.Is(rerr, syscall.ECONNRESET) && !errors.Is(werr, syscall.ECONNRESET) {
			t.Errorf("refused client read %d bytes, write err %v, read err %v; want none, then a reset", n, werr, rerr)
		}
	} else if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatal(err)
	}
	if err := f.wait(t, 1)[0]; ReasonOf(err) != string(ReasonNoClientCertificate) || !strings.Contains(fmt.Sprint(err), "no verified client certificate") {
		t.Errorf("Serve: %v, want no-client-certificate saying why", err)
	}
	if !slices.Contains(Reasons(), ReasonNoClientCertificate) {
		t.Errorf("Reasons() %v lacks %s: its metric series would not be pre-registered", Reasons(), ReasonNoClientCertificate)
	}

	// Directly: nothing is read from the refused client, and its peer
	// reads a reset.
	b, a := forwardtest.TCPPair(t)
	defer b.Close()
	b.Write(f.gw.Frame(t, "sbx", up.Addr()))
	rc := &readCounter{Conn: a}
	res, err := f.fwd.Serve(Gateway{Conn: rc, Peer: "direct"})
	if ReasonOf(err) != string(ReasonNoClientCertificate) || res.Tunnel.ID != 0 || rc.reads.Load() != 0 {
		t.Errorf("Serve: %v (tunnel %d) after %d reads; want no-client-certificate, no tunnel, no read", err, res.Tunnel.ID, rc.reads.Load())
	}
	b.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, b); n != 0 || !errors.Is(sockerr.ReadError(b, err), syscall.ECONNRESET) {
		t.Errorf("refused client read %d bytes, err %v; want none, then a reset", n, err)
	}
	if got := f.reg.RefusedTunnels()[string(ReasonNoClientCertificate)]; got != 2 {
		t.Errorf("no-client-certificate counted %d times, want 2", got)
	}
	if up.Accepted() != 0 {
		t.Fatalf("upstream accepted %d connections for unauthenticated clients", up.Accepted())
	}

	// With a verified certificate the same forwarder carries the tunnel.
	f.verified.Store(true)
	sent, recv, n := runTunnel(t, f.dial(t), f.gw.Frame(t, "sbx", up.Addr()), size, 5)
	if errs := f.wait(t, 2); errs[1] != nil {
		t.Fatalf("verified client's tunnel: %v", errs[1])
	}
	up.Close()
	r := up.Results()
	if len(r) != 1 || r[0].Received != size || r[0].RecvSum != sent || n != size+3 || recv != r[0].SentSum {
		t.Fatalf("verified client's tunnel: upstream results %+v, client got %d bytes (hash match %v); want %d bytes each way, exact",
			r, n, len(r) == 1 && recv == r[0].SentSum, size)
	}

	// The certificate is checked before draining: an unauthenticated
	// client is no-client-certificate, an authenticated one draining.
	if forced := f.reg.Drain(context.Background()); forced != 0 {
		t.Fatalf("Drain forced %d tunnels, want 0", forced)
	}
	for _, verified := range []bool{false, true} {
		b, a := forwardtest.TCPPair(t)
		_, err := f.fwd.Serve(Gateway{Conn: a, CertificateVerified: verified})
		b.Close()
		want := ReasonNoClientCertificate
		if verified {
			want = ReasonDraining
		}
		if ReasonOf(err) != string(want) {
			t.Errorf("draining, client certificate verified %v: %v, want %s", verified, err, want)
		}
	}
}
