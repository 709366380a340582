package gateway

import (
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// forwarder is a sandbox forwarder on kernel TLS where the kernel has it,
// requiring the gateway's verified client certificate and channel binding.
type forwarder struct {
	ln   net.Listener
	fwd  *forward.Forwarder
	reg  *forward.Registry
	wg   sync.WaitGroup
	mu   sync.Mutex
	res  []forward.Result
	errs []error
}

// pki is one test's certificates: the forwarder's server certificate and
// the gateway's client certificate from one CA.
type pki struct {
	server, client *tls.Config
}

func newPKI(t testing.TB) pki {
	ca := testpki.NewCA(t, "gateway-test-ca")
	srv, cli := ca.Server(t), ca.Client(t, "gateway-1")
	return pki{
		server: &tls.Config{Certificates: []tls.Certificate{srv.TLS}, ClientCAs: ca.Pool, ClientAuth: tls.RequireAndVerifyClientCert},
		client: &tls.Config{Certificates: []tls.Certificate{cli.TLS}, RootCAs: ca.Pool, ServerName: "localhost"},
	}
}

func startForwarder(t testing.TB, p pki, gw *forwardtest.Gateway, allow string) *forwarder {
	t.Helper()
	return startForwarderWith(t, p, gw, allow, nil)
}

// startForwarderWith is startForwarder with mod applied to its Config.
func startForwarderWith(t testing.TB, p pki, gw *forwardtest.Gateway, allow string, mod func(*forward.Config)) *forwarder {
	t.Helper()
	v, err := preamble.NewVerifier(preamble.VerifierConfig{Keys: map[string]ed25519.PublicKey{gw.Signer.KeyID(): gw.Pub}, RequireBinding: true})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := forward.NewTargetPolicy([]string{allow}, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := &forwarder{reg: forward.NewRegistry()}
	cfg := forward.Config{Verifier: v, Policy: pol, Registry: f.reg, RequireClientCertificate: true}
	if mod != nil {
		mod(&cfg)
	}
	f.fwd, err = forward.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if f.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	f.wg.Go(func() {
		for {
			c, err := f.ln.Accept()
			if err != nil {
				return
			}
			f.wg.Go(func() {
				kc := ktls.Server(c, p.server, ktls.Options{})
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				err := kc.HandshakeContext(ctx)
				cancel()
				var res forward.Result
				if err == nil {
					st := kc.ConnectionState()
					binding, _ := preamble.ChannelBinding(st)
					res, err = f.fwd.Serve(forward.Gateway{Conn: kc, Binding: binding, Peer: c.RemoteAddr().String(),
						CertificateVerified: len(st.VerifiedChains) > 0})
				} else {
					kc.Close()
				}
				f.mu.Lock()
				f.res, f.errs = append(f.res, res), append(f.errs, err)
				f.mu.Unlock()
			})
		}
	})
	t.Cleanup(func() { f.ln.Close(); f.wg.Wait() })
	return f
}

func (f *forwarder) addr() string { return f.ln.Addr().String() }

// served waits until n tunnels have ended and returns their results.
func (f *forwarder) served(t *testing.T, n int) ([]forward.Result, []error) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		f.mu.Lock()
		if len(f.errs) >= n {
			defer f.mu.Unlock()
			return append([]forward.Result(nil), f.res...), append([]error(nil), f.errs...)
		}
		f.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %d tunnels at the forwarder", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func newDialer(t *testing.T, p pki, gw *forwardtest.Gateway) *Dialer {
	t.Helper()
	d, err := New(Config{TLS: p.client, Signer: gw.Signer})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// newKTLSDialer is a Dialer whose tunnels to the forwarder and users'
// sessions are offloaded as tunnel and user say.
func newKTLSDialer(t *testing.T, p pki, gw *forwardtest.Gateway, tunnel, user ktls.Options) *Dialer {
	t.Helper()
	d, err := New(Config{TLS: p.client, Signer: gw.Signer, KTLS: tunnel, UserKTLS: user})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// front is an edge gateway's user-facing side: it terminates the user's TLS
// (kernel TLS where it can) and carries it to route (Dialer.Carry).
type front struct {
	ln      net.Listener
	wg      sync.WaitGroup
	results chan relayResult
	// opened counts the tunnels Carry reported open (onDial, nil).
	opened atomic.Int32
}

type relayResult struct {
	stats   splice.Stats
	end     End
	err     error
	offload ktls.Offload
	// dials are what Carry told onDial: nil for a tunnel that opened.
	dials []error
}

func startFront(t *testing.T, p pki, d *Dialer, route Route) *front {
	t.Helper()
	return startFrontWith(t, p, d, route, ktls.Options{})
}

// startFrontWith is startFront with the user's sessions offloaded as opts
// say.
func startFrontWith(t *testing.T, p pki, d *Dialer, route Route, opts ktls.Options) *front {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// The user-facing certificate: the forwarder's will do (same CA).
	userCfg := &tls.Config{Certificates: p.server.Certificates}
	fr := &front{ln: ln, results: make(chan relayResult, 16)}
	fr.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fr.wg.Go(func() {
				user := ktls.Server(c, userCfg, opts)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if err := user.HandshakeContext(ctx); err != nil {
					user.Close()
					fr.results <- relayResult{err: err}
					return
				}
				var r relayResult
				r.stats, r.end, r.err = d.Carry(ctx, route, user, nil, func(tunnel *ktls.Conn, err error) {
					r.dials = append(r.dials, err)
					if err == nil {
						r.offload = tunnel.Offload()
						fr.opened.Add(1)
					}
				})
				fr.results <- r
			})
		}
	})
	t.Cleanup(func() { ln.Close(); fr.wg.Wait() })
	return fr
}

func (fr *front) result(t *testing.T) relayResult {
	t.Helper()
	select {
	case r := <-fr.results:
		return r
	case <-time.After(30 * time.Second):
		t.Fatal("timed out waiting for the gateway's relay to end")
	}
	panic("unreachable")
}

// userTunnel is a user's TLS session through the front: it sends send
// bytes of pattern seed, half-closes and reads to the end.
func userTunnel(t *testing.T, addr string, roots *tls.Config, send int64, seed uint64) (sentSum, recvSum [32]byte, recvN int64, readErr error) {
	t.Helper()
	c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: roots.RootCAs, ServerName: "localhost"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	errc := make(chan error, 1)
	go func() {
		var err error
		sentSum, err = forwardtest.SendPattern(c, send, seed)
		errc <- err
	}()
	h := sha256.New()
	recvN, readErr = io.Copy(h, c)
	copy(recvSum[:], h.Sum(nil))
	<-errc
	return sentSum, recvSum, recvN, readErr
}

// relayExact: a user's bytes reach the sandbox and the sandbox's reach the
// user, exact to the byte, through front → forwarder → upstream; every
// counter on the way agrees.
func relayExact(t *testing.T, size int64) relayResult {
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	up := forwardtest.NewUpstream(t, size)
	f := startForwarder(t, p, gw, "127.0.0.0/8")
	route := Route{Forwarder: f.addr(), Sandbox: "sbx-1", Target: up.Addr()}
	fr := startFront(t, p, newDialer(t, p, gw), route)

	sent, recv, n, err := userTunnel(t, fr.ln.Addr().String(), p.client, size, 7)
	if err != nil {
		t.Fatalf("user read: %v", err)
	}
	r := fr.result(t)
	if r.err != nil {
		t.Fatalf("relay: %v", r.err)
	}
	if r.end != EndClosed || RelayEnd(r.stats, r.err) != EndClosed || len(r.dials) != 1 || r.dials[0] != nil {
		t.Errorf("relay end %s, dials %v; want %s and one dial that opened", r.end, r.dials, EndClosed)
	}
	up.Close()
	res := up.Results()
	if len(res) != 1 {
		t.Fatalf("upstream served %d connections, want 1", len(res))
	}
	if res[0].Received != size || res[0].RecvSum != sent {
		t.Errorf("sandbox received %d bytes (sum match %v), want %d", res[0].Received, res[0].RecvSum == sent, size)
	}
	if n != size || recv != forwardtest.PatternSum(2, size) {
		t.Errorf("user received %d bytes (sum match %v), want %d", n, recv == forwardtest.PatternSum(2, size), size)
	}
	if r.stats.AToB.Bytes != size || r.stats.BToA.Bytes != size {
		t.Errorf("gateway relay counted %d to and %d from the sandbox, want %d each", r.stats.AToB.Bytes, r.stats.BToA.Bytes, size)
	}
	fres, ferrs := f.served(t, 1)
	if ferrs[0] != nil {
		t.Errorf("forwarder: %v", ferrs[0])
	}
	if ti := fres[0].Tunnel; ti.Sandbox != "sbx-1" || ti.BytesToSandbox != size || ti.BytesFromSandbox != size {
		t.Errorf("forwarder tunnel %+v, want sandbox sbx-1 with %d bytes each way", ti, size)
	}
	return r
}

func TestRelayExactBothWays(t *testing.T) {
	forwardtest.CheckLeaks(t)
	relayExact(t, 3<<20+17)
}

// TestKernelRelaySplicesKTLSToKTLS: with kTLS on both of the gateway's
// sockets, every byte moves kernel to kernel (the user's records opened
// and the forwarder's sealed by the kernel): spliced both ways, nothing
// copied, and the kernel counts the sessions of both hops.
func TestKernelRelaySplicesKTLSToKTLS(t *testing.T) {
	kerneltest.Require(t)
	size := int64(kerneltest.BulkMiB(t, 8)) << 20
	var r relayResult
	delta := kerneltest.StatDelta(t, func() { r = relayExact(t, size) })
	if r.offload.TX == ktls.ModeUserspace || r.offload.RX == ktls.ModeUserspace {
		t.Errorf("forwarder connection offload %+v, want TX and RX in the kernel", r.offload)
	}
	for _, d := range []splice.DirectionStats{r.stats.AToB, r.stats.BToA} {
		if !d.Spliced || d.CopyBytes != 0 || d.SpliceBytes != size {
			t.Errorf("gateway direction %+v: want %d bytes spliced, none copied", d, size)
		}
	}
	// Three sessions: user↔gateway and gateway↔forwarder (both ends).
	if delta["TlsTxSw"] < 3 || delta["TlsRxSw"] < 3 {
		t.Errorf("tls_stat delta %v: want at least 3 TX and 3 RX software sessions", delta)
	}
}

// TestKernelRelayRefusalTravels: the forwarder refuses a target outside
// its allowlist with access_denied; the gateway's relay ends the user's
// session with access_denied too, and nothing reached the sandbox. Also
// with the user's bytes in flight, which the forwarder never reads: it
// lingers after the alert (ktls.Conn.Refuse) so that no reset overtakes
// the alert, and the tunnel's end without close_notify could not reach
// the user as an orderly end in any case (Options.RequireCloseNotify).
func TestKernelRelayRefusalTravels(t *testing.T) {
	kerneltest.Require(t)
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	for _, c := range []struct {
		name string
		send int
	}{
		{"nothing sent", 0},
		{"bytes in flight", 64 << 10},
	} {
		t.Run(c.name, func(t *testing.T) {
			up := forwardtest.NewUpstream(t, 1<<10)
			f := startForwarder(t, p, gw, "10.255.0.0/16") // the upstream's 127.0.0.1 is not allowed
			fr := startFront(t, p, newDialer(t, p, gw), Route{Forwarder: f.addr(), Sandbox: "sbx-1", Target: up.Addr()})
			var n int64
			var err error
			if c.send > 0 {
				_, _, n, err = userTunnel(t, fr.ln.Addr().String(), p.client, int64(c.send), 7)
			} else {
				c2, derr := tls.Dial("tcp", fr.ln.Addr().String(), &tls.Config{RootCAs: p.client.RootCAs, ServerName: "localhost"})
				if derr != nil {
					t.Fatal(derr)
				}
				c2.SetDeadline(time.Now().Add(30 * time.Second))
				n, err = io.Copy(io.Discard, c2)
				c2.Close()
			}
			if n != 0 || err == nil || !strings.Contains(err.Error(), "access denied") {
				t.Errorf("user read %d bytes, error %v: want none and access denied", n, err)
			}
			r := fr.result(t)
			if e := RelayEnd(r.stats, r.err); e != EndRefused {
				t.Errorf("relay end %s (%v), want %s", e, r.err, EndRefused)
			}
			if _, errs := f.served(t, 1); forward.ReasonOf(errs[0]) != string(forward.ReasonTargetDenied) {
				t.Errorf("forwarder: %v, want reason %s", errs[0], forward.ReasonTargetDenied)
			}
			if up.Accepted() != 0 || up.Received() != 0 {
				t.Errorf("sandbox accepted %d connections, received %d bytes: want none", up.Accepted(), up.Received())
			}
		})
	}
}

func TestDialErrors(t *testing.T) {
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	d := newDialer(t, p, gw)
	target := netip.MustParseAddrPort("10.0.0.7:8080")

	// Nothing listens.
	closed := forwardtest.ClosedPort(t).String()
	_, err := d.Dial(context.Background(), Route{Forwarder: closed, Sandbox: "s", Target: target})
	var de *DialError
	if !errors.As(err, &de) || de.Step != StepConnect {
		t.Errorf("dial to a closed port: %v, want a *DialError at %s", err, StepConnect)
	}

	// A forwarder whose certificate another CA signed.
	other := newPKI(t)
	f := startForwarder(t, other, gw, "10.0.0.0/8")
	_, err = d.Dial(context.Background(), Route{Forwarder: f.addr(), Sandbox: "s", Target: target})
	if !errors.As(err, &de) || de.Step != StepHandshake || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("dial to an untrusted forwarder: %v, want a *DialError at %s about its certificate", err, StepHandshake)
	}

	// A listener that never answers the handshake: the dial timeout ends it.
	mute, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	short, err := New(Config{TLS: p.client, Signer: gw.Signer, DialTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	_, err = short.Dial(context.Background(), Route{Forwarder: mute.Addr().String(), Sandbox: "s", Target: target})
	if !errors.As(err, &de) || de.Step != StepHandshake || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("dial to a mute listener: %v, want a *DialError at %s with the deadline", err, StepHandshake)
	}
	if errors.Is(err, ErrOverloaded) {
		t.Errorf("dial to a mute listener: %v, which is no shed", err)
	}

	// A forwarder that sheds the connection: overloaded, and safe to retry.
	shedding, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer shedding.Close()
	go func() {
		if c, err := shedding.Accept(); err == nil {
			ktls.Shed(c)
		}
	}()
	_, err = d.Dial(context.Background(), Route{Forwarder: shedding.Addr().String(), Sandbox: "s", Target: target})
	if !errors.As(err, &de) || de.Step != StepHandshake || !errors.Is(err, ErrOverloaded) || !RetrySafe(err) {
		t.Errorf("dial to a shedding forwarder: %v, want a retry-safe *DialError at %s with ErrOverloaded", err, StepHandshake)
	}
	if _, ok := CertificateAlert(err); ok {
		t.Errorf("a shed is no certificate refusal: %v", err)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	insecure := p.client.Clone()
	insecure.InsecureSkipVerify = true
	tls12 := p.client.Clone()
	tls12.MaxVersion = tls.VersionTLS12
	noCert := p.client.Clone()
	noCert.Certificates = nil
	for _, c := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no TLS", Config{Signer: gw.Signer}, "no TLS configuration"},
		{"insecure", Config{TLS: insecure, Signer: gw.Signer}, "skips verifying"},
		{"no client certificate", Config{TLS: noCert, Signer: gw.Signer}, "no client certificate"},
		{"no signer", Config{TLS: p.client}, "no preamble signer"},
		{"TLS 1.2", Config{TLS: tls12, Signer: gw.Signer}, "below TLS 1.3"},
		{"negative timeout", Config{TLS: p.client, Signer: gw.Signer, DialTimeout: -1}, "negative"},
	} {
		if _, err := New(c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error about %q", c.name, err, c.want)
		}
	}
}

func TestParseRoute(t *testing.T) {
	r, err := ParseRoute("fwd.internal:8443", "sbx-1", "[::ffff:10.0.0.7]:8080")
	if err != nil || r != (Route{Forwarder: "fwd.internal:8443", Sandbox: "sbx-1", Target: netip.MustParseAddrPort("10.0.0.7:8080")}) {
		t.Errorf("ParseRoute = %+v, %v", r, err)
	}
	for _, c := range []struct{ fwd, sbx, target, field string }{
		{"", "s", "10.0.0.7:80", "forwarder"},
		{"fwd.internal", "s", "10.0.0.7:80", "forwarder"},
		{"f:1", "", "10.0.0.7:80", "sandbox"},
		{"f:1", "a/b", "10.0.0.7:80", "sandbox"},
		{"f:1", "s", "app.internal:80", "target"},
		{"f:1", "s", "10.0.0.7", "target"},
		{"f:1", "s", "10.0.0.7:0", "target"},
		{"f:1", "s", "0.0.0.0:80", "target"},
		{"f:1", "s", "[fe80::1%eth0]:80", "target"},
	} {
		_, err := ParseRoute(c.fwd, c.sbx, c.target)
		var re *RouteError
		if !errors.As(err, &re) || re.Field != c.field {
			t.Errorf("ParseRoute(%q, %q, %q) = %v, want a *RouteError on %s", c.fwd, c.sbx, c.target, err, c.field)
		}
	}
}

func TestEndOf(t *testing.T) {
	for _, c := range []struct {
		err  error
		want End
	}{
		{nil, EndClosed},
		{io.EOF, EndClosed},
		{ktls.AlertError(ktls.AlertAccessDenied), EndRefused},
		{&net.OpError{Op: "read", Err: ktls.AlertError(ktls.AlertAccessDenied)}, EndRefused},
		{&net.OpError{Op: "remote error", Err: tls.AlertError(ktls.AlertAccessDenied)}, EndRefused},
		{ktls.AlertError(80), EndFailed},
		{&net.OpError{Op: "remote error", Err: tls.AlertError(80)}, EndFailed},
		{errors.New("tls: access denied"), EndFailed}, // a string is not the alert
		{&net.OpError{Op: "read", Err: errors.New("connection reset by peer")}, EndFailed},
	} {
		if got := EndOf(c.err); got != c.want {
			t.Errorf("EndOf(%v) = %s, want %s", c.err, got, c.want)
		}
	}
}

// TestCarryDialOutcomes: Carry tells onDial exactly once how the tunnel's
// opening went, and a tunnel that did not open returns its *DialError, no
// End, and ends the user's session with nothing from the sandbox: a
// forwarder that does not answer (connect), one that refuses the gateway's
// certificate after Dial returned (handshake, the refusal named), and one
// that refuses the tunnel itself (opened: an End of refused).
func TestCarryDialOutcomes(t *testing.T) {
	forwardtest.CheckLeaks(t)
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	up := forwardtest.NewUpstream(t, 1<<10)
	noAnswer := forwardtest.ClosedPort(t).String()
	strict := p.server.Clone()
	strict.ClientCAs = testpki.NewCA(t, "another-ca").Pool
	refusesCert := startForwarder(t, pki{server: strict, client: p.client}, gw, "127.0.0.0/8")
	refusesTarget := startForwarder(t, p, gw, "10.255.0.0/16")
	for _, tc := range []struct {
		name      string
		forwarder string
		step      string // the failed dial's step; "" for a tunnel that opened
		end       End
	}{
		{"no answer", noAnswer, StepConnect, ""},
		{"certificate refused", refusesCert.addr(), StepHandshake, ""},
		{"tunnel refused", refusesTarget.addr(), "", EndRefused},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fr := startFront(t, p, newDialer(t, p, gw), Route{Forwarder: tc.forwarder, Sandbox: "sbx-1", Target: up.Addr()})
			c, err := tls.Dial("tcp", fr.ln.Addr().String(), &tls.Config{RootCAs: p.client.RootCAs, ServerName: "localhost"})
			if err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(30 * time.Second))
			n, readErr := io.Copy(io.Discard, c)
			c.Close()
			r := fr.result(t)
			if n != 0 || readErr == nil {
				t.Errorf("user read %d bytes, error %v: want none, and an error", n, readErr)
			}
			if len(r.dials) != 1 {
				t.Fatalf("onDial called %d times (%v), want once", len(r.dials), r.dials)
			}
			var de *DialError
			switch {
			case tc.step != "":
				if !errors.As(r.dials[0], &de) || de.Step != tc.step || !errors.As(r.err, &de) || r.end != "" {
					t.Errorf("dial %v, Carry %v, end %q: want a *DialError at %s both, no end", r.dials[0], r.err, r.end, tc.step)
				}
				var cre *CertificateRefusedError
				if tc.step == StepHandshake && !errors.As(r.err, &cre) {
					t.Errorf("Carry %v: want the refusal of the certificate", r.err)
				}
			default:
				if r.dials[0] != nil || r.end != tc.end {
					t.Errorf("dial %v, end %q: want one that opened, end %s", r.dials[0], r.end, tc.end)
				}
			}
		})
	}
	if up.Accepted() != 0 {
		t.Errorf("sandbox accepted %d connections, want none", up.Accepted())
	}
	refusesCert.served(t, 1)
	refusesTarget.served(t, 1)
}
