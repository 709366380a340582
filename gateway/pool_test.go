package gateway

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// poolEvents records what a Pool reports through its callbacks.
type poolEvents struct {
	mu       sync.Mutex
	dialsOK  int
	dialErrs []error
	ends     map[End]int
	failures []Failure
}

func (ev *poolEvents) config(cfg PoolConfig) PoolConfig {
	ev.ends = map[End]int{}
	cfg.OnDial = func(_ Route, conn *ktls.Conn, err error) {
		ev.mu.Lock()
		defer ev.mu.Unlock()
		switch {
		case err != nil:
			ev.dialErrs = append(ev.dialErrs, err)
		case conn == nil:
			panic("a tunnel reported open without its connection")
		default:
			ev.dialsOK++
		}
	}
	cfg.OnEnd = func(_ Route, e End) {
		ev.mu.Lock()
		ev.ends[e]++
		ev.mu.Unlock()
	}
	cfg.OnFailure = func(f Failure) {
		ev.mu.Lock()
		ev.failures = append(ev.failures, f)
		ev.mu.Unlock()
	}
	return cfg
}

// counts is what ev holds: dials opened, dials failed, ends by kind,
// failures.
func (ev *poolEvents) counts() string {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	return fmt.Sprintf("dials ok %d, failed %d; ends closed %d, refused %d, failed %d; failures %d",
		ev.dialsOK, len(ev.dialErrs), ev.ends[EndClosed], ev.ends[EndRefused], ev.ends[EndFailed], len(ev.failures))
}

// waitCounts waits until ev's counts are want.
func (ev *poolEvents) waitCounts(t *testing.T, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for ev.counts() != want {
		if time.Now().After(deadline) {
			t.Fatalf("pool reported %s; want %s", ev.counts(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// newPool is a Pool of d whose reports ev records; its idle tunnels are
// closed at the test's end.
func newPool(t *testing.T, d *Dialer, ev *poolEvents, cfg PoolConfig) *Pool {
	t.Helper()
	cfg.Dialer = d
	p, err := NewPool(ev.config(cfg))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.CloseIdleConnections)
	return p
}

// httpApp is a sandbox's HTTP app (HTTP/1.1 and h2c). /sum answers the
// SHA-256 of the request's body (X-Body-Sha256) and n pattern bytes of
// seed; /wait answers once release is closed, after it said on entered
// that the request reached it.
type httpApp struct {
	addr             netip.AddrPort
	entered, release chan struct{}
}

func startHTTPApp(t *testing.T) *httpApp {
	t.Helper()
	app := &httpApp{entered: make(chan struct{}, 1), release: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("/sum", func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		io.Copy(h, r.Body)
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		seed, _ := strconv.ParseUint(r.URL.Query().Get("seed"), 10, 64)
		w.Header().Set("X-Body-Sha256", hex.EncodeToString(h.Sum(nil)))
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		io.CopyN(w, forwardtest.NewPattern(seed), n)
	})
	mux.HandleFunc("/wait", func(w http.ResponseWriter, r *http.Request) {
		app.entered <- struct{}{}
		<-app.release
		io.WriteString(w, "released")
	})
	srv := &http.Server{Handler: mux, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	app.addr = ln.Addr().(*net.TCPAddr).AddrPort()
	return app
}

// sum sends size pattern bytes of seed to /sum on r and checks, by
// SHA-256, that the app received exactly them and the response body is
// exactly the n bytes it sent.
func sum(t *testing.T, p *Pool, r Route, size int64, seed uint64, n int64) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://sandbox/sum?n=%d&seed=%d", n, seed+1), io.LimitReader(forwardtest.NewPattern(seed), size))
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = size
	resp, err := p.RoundTrip(req, r)
	if err != nil {
		t.Fatalf("POST /sum: %v", err)
	}
	defer resp.Body.Close()
	h := sha256.New()
	got, err := io.Copy(h, resp.Body)
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	if want := forwardtest.PatternSum(seed, size); resp.Header.Get("X-Body-Sha256") != hex.EncodeToString(want[:]) {
		t.Errorf("the app received a body of SHA-256 %s, want %x (%d bytes)", resp.Header.Get("X-Body-Sha256"), want, size)
	}
	if want := forwardtest.PatternSum(seed+1, n); got != n || [32]byte(h.Sum(nil)) != want {
		t.Errorf("received %d response bytes of SHA-256 %x, want %d of %x", got, h.Sum(nil), n, want)
	}
}

func get(t *testing.T, p *Pool, r Route, path string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://sandbox"+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p.RoundTrip(req, r)
}

// poolEnv is a forwarder that allows loopback targets, an HTTP app, and a
// Pool of cfg dialing the forwarder, whose events ev records; it checks
// for leaks at the end.
func poolEnv(t *testing.T, cfg PoolConfig) (*forwarder, *httpApp, *poolEvents, *Pool) {
	t.Helper()
	forwardtest.CheckLeaks(t)
	pk := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	f := startForwarder(t, pk, gw, "127.0.0.0/8")
	ev := new(poolEvents)
	return f, startHTTPApp(t), ev, newPool(t, newDialer(t, pk, gw), ev, cfg)
}

// TestPoolExact: requests through a Pool reach the app, over HTTP/1.1 and
// h2c, with every byte both ways (SHA-256), on one pooled tunnel: one
// dial reported open, and one end, closed, once the Pool closes it idle.
func TestPoolExact(t *testing.T) {
	for _, h2c := range []bool{false, true} {
		t.Run(fmt.Sprintf("h2c=%v", h2c), func(t *testing.T) {
			f, app, ev, p := poolEnv(t, PoolConfig{H2C: h2c})
			r := Route{Forwarder: f.addr(), Sandbox: "sbx-pool", Target: app.addr}
			for i := range 3 {
				sum(t, p, r, 64<<10+int64(i), uint64(10*i), 256<<10-int64(i))
			}
			ev.waitCounts(t, "dials ok 1, failed 0; ends closed 0, refused 0, failed 0; failures 0")
			p.CloseIdleConnections()
			ev.waitCounts(t, "dials ok 1, failed 0; ends closed 1, refused 0, failed 0; failures 0")
			if res, errs := f.served(t, 1); len(res) != 1 || errs[0] != nil {
				t.Errorf("the forwarder served %d tunnels (%v), want 1 that ended cleanly", len(res), errs)
			}
		})
	}
}

// TestPoolDialOpenOnFirstByte: a tunnel's dial is reported open at its
// first byte from the forwarder, not when Dial returned: with TLS 1.3
// only that byte says the forwarder took the gateway's certificate.
func TestPoolDialOpenOnFirstByte(t *testing.T) {
	f, app, ev, p := poolEnv(t, PoolConfig{})
	r := Route{Forwarder: f.addr(), Sandbox: "sbx-pool", Target: app.addr}
	type result struct {
		body string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodGet, "http://sandbox/wait", nil)
		resp, err := p.RoundTrip(req, r)
		if err != nil {
			done <- result{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{string(b), err}
	}()
	select {
	case <-app.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not reach the app")
	}
	// The request went through the tunnel; nothing came back yet.
	if got := ev.counts(); got != "dials ok 0, failed 0; ends closed 0, refused 0, failed 0; failures 0" {
		t.Errorf("before the tunnel's first byte the pool reported %s, want nothing", got)
	}
	close(app.release)
	if res := <-done; res.err != nil || res.body != "released" {
		t.Fatalf("GET /wait: %q, %v", res.body, res.err)
	}
	ev.waitCounts(t, "dials ok 1, failed 0; ends closed 0, refused 0, failed 0; failures 0")
}

// TestPoolCertificateRefused: a forwarder that refuses the gateway's
// certificate does so after the client's TLS 1.3 handshake: the request
// fails with the refusal read before the tunnel's first byte, a
// *DialError safe to retry, reported once as a failed dial, and the
// tunnel, which never opened, has no end.
func TestPoolCertificateRefused(t *testing.T) {
	for _, h2c := range []bool{false, true} {
		t.Run(fmt.Sprintf("h2c=%v", h2c), func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			pk := newPKI(t)
			gw := forwardtest.NewGateway(t, "gw-1")
			strict := pk.server.Clone()
			strict.ClientCAs = testpki.NewCA(t, "another-ca").Pool
			f := startForwarder(t, pki{server: strict, client: pk.client}, gw, "127.0.0.0/8")
			app := startHTTPApp(t)
			var ev poolEvents
			p := newPool(t, newDialer(t, pk, gw), &ev, PoolConfig{H2C: h2c})
			r := Route{Forwarder: f.addr(), Sandbox: "sbx-pool", Target: app.addr}
			_, err := get(t, p, r, "/sum?n=1")
			var de *DialError
			var cre *CertificateRefusedError
			if !errors.As(err, &de) || de.Step != StepHandshake || !errors.As(err, &cre) || cre.Alert != "unknown_ca" || !RetrySafe(err) {
				t.Fatalf("request: %v, want a retry-safe *DialError with the refusal of the certificate (unknown_ca)", err)
			}
			p.CloseIdleConnections()
			ev.waitCounts(t, "dials ok 0, failed 1; ends closed 0, refused 0, failed 0; failures 0")
			ev.mu.Lock()
			if !errors.As(ev.dialErrs[0], &cre) {
				t.Errorf("the failed dial reported %v, want the refusal of the certificate", ev.dialErrs[0])
			}
			ev.mu.Unlock()
			f.served(t, 1)
		})
	}
}

// cuttingApp is a sandbox app that answers one request with the headers
// of a 100000-byte body and 10 bytes of it, then, once cut is closed,
// resets the connection.
func cuttingApp(t *testing.T) (netip.AddrPort, chan struct{}) {
	t.Helper()
	cut := make(chan struct{})
	addr := forwardtest.ServeTCP(t, func(c net.Conn) {
		defer c.Close()
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n0123456789")
		<-cut
		c.(*net.TCPConn).SetLinger(0)
	})
	return netip.MustParseAddrPort(addr), cut
}

// TestPoolEnds: a response cut short by the tunnel's failure ends the
// tunnel as failed and is reported as a failure mid-response; a tunnel
// that ran its requests and was closed idle ends closed; a forwarder's
// refusal (here: the target does not answer) ends it as refused, reported
// as a retry-safe failure. Each counts exactly once.
func TestPoolEnds(t *testing.T) {
	f, app, ev, p := poolEnv(t, PoolConfig{})

	cutAddr, cut := cuttingApp(t)
	resp, err := get(t, p, Route{Forwarder: f.addr(), Sandbox: "sbx-cut", Target: cutAddr}, "/")
	if err != nil {
		t.Fatal(err)
	}
	head := make([]byte, 10)
	if _, err := io.ReadFull(resp.Body, head); err != nil || string(head) != "0123456789" {
		t.Fatalf("the response's first bytes: %q, %v", head, err)
	}
	close(cut)
	if n, err := io.Copy(io.Discard, resp.Body); err == nil || EndOf(err) != EndFailed {
		t.Errorf("the cut response read %d more bytes and ended with %v, want a failure", n, err)
	}
	resp.Body.Close()
	ev.waitCounts(t, "dials ok 1, failed 0; ends closed 0, refused 0, failed 1; failures 1")
	ev.mu.Lock()
	if fl := ev.failures[0]; fl.End != EndFailed || !fl.MidResponse || fl.RetrySafe || fl.Route.Sandbox != "sbx-cut" {
		t.Errorf("failure %+v, want failed mid-response, not retry-safe, on sbx-cut", fl)
	}
	ev.mu.Unlock()

	sum(t, p, Route{Forwarder: f.addr(), Sandbox: "sbx-ok", Target: app.addr}, 1000, 1, 1000)
	p.CloseIdleConnections()
	ev.waitCounts(t, "dials ok 2, failed 0; ends closed 1, refused 0, failed 1; failures 1")

	closed := forwardtest.ClosedPort(t)
	_, err = get(t, p, Route{Forwarder: f.addr(), Sandbox: "sbx-refused", Target: closed}, "/")
	if !Refused(err) || !RetrySafe(err) {
		t.Fatalf("request to a target that does not answer: %v, want the forwarder's refusal, retry-safe", err)
	}
	ev.waitCounts(t, "dials ok 3, failed 0; ends closed 1, refused 1, failed 1; failures 2")
	ev.mu.Lock()
	if fl := ev.failures[1]; fl.End != EndRefused || fl.MidResponse || !fl.RetrySafe {
		t.Errorf("failure %+v, want refused before the response, retry-safe", fl)
	}
	ev.mu.Unlock()
	f.served(t, 3)
}

// TestPoolEvictsLeastRecentlyUsed: beyond MaxRoutes the least recently
// used route is dropped and its idle tunnel closed (ends closed), and the
// route dials anew when used again.
func TestPoolEvictsLeastRecentlyUsed(t *testing.T) {
	f, app, ev, p := poolEnv(t, PoolConfig{MaxRoutes: 2})
	a := Route{Forwarder: f.addr(), Sandbox: "sbx-a", Target: app.addr}
	b := Route{Forwarder: f.addr(), Sandbox: "sbx-b", Target: app.addr}
	c := Route{Forwarder: f.addr(), Sandbox: "sbx-c", Target: app.addr}
	sum(t, p, a, 100, 1, 100)
	sum(t, p, b, 100, 2, 100)
	sum(t, p, a, 100, 3, 100) // a is now the most recently used
	ev.waitCounts(t, "dials ok 2, failed 0; ends closed 0, refused 0, failed 0; failures 0")
	sum(t, p, c, 100, 4, 100) // evicts b
	ev.waitCounts(t, "dials ok 3, failed 0; ends closed 1, refused 0, failed 0; failures 0")
	if n := p.Routes(); n != 2 {
		t.Errorf("%d routes kept, want 2", n)
	}
	if res, _ := f.served(t, 1); res[0].Tunnel.Sandbox != "sbx-b" {
		t.Errorf("the forwarder's first tunnel to end was %q's, want sbx-b's", res[0].Tunnel.Sandbox)
	}
	sum(t, p, b, 100, 5, 100) // evicts a, dials b anew
	ev.waitCounts(t, "dials ok 4, failed 0; ends closed 2, refused 0, failed 0; failures 0")
	p.CloseIdleConnections()
	ev.waitCounts(t, "dials ok 4, failed 0; ends closed 4, refused 0, failed 0; failures 0")
	f.served(t, 4)
}

// A tunnel's end counts once, when it is closed and no request on it is
// in flight, and what a request saw wins over the tunnel's read error in
// either order: net/http closes a tunnel as soon as a body read fails,
// before the failure reaches the body's reader.
func TestTunnelEndOrder(t *testing.T) {
	for _, tc := range []struct {
		name string
		// steps on one tunnel whose peer closed (its read error is io.EOF):
		// 'b' a request begins, 'c' the transport closes the tunnel,
		// 'f' a request is done having seen the tunnel fail, 'r' refused,
		// 'o' done with nothing to say.
		steps string
		want  End
	}{
		{"closed while the failed body is still being read", "bcf", EndFailed},
		{"failure seen before the close", "bfc", EndFailed},
		{"refused before the response", "bcr", EndRefused},
		{"idle tunnel whose peer closed", "c", EndClosed},
		{"a response read to its end", "boc", EndClosed},
		{"two streams, the second fails after the close", "bbcof", EndFailed},
		{"the first failure is the tunnel's", "bbcrf", EndRefused},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := net.Pipe()
			b.Close()
			var ev poolEvents
			c := newTunnelConn(a, &Pool{cfg: ev.config(PoolConfig{})}, Route{})
			if _, err := c.Read(make([]byte, 1)); err != io.EOF {
				t.Fatalf("read from a closed pipe: %v", err)
			}
			for i, s := range tc.steps {
				switch s {
				case 'b':
					c.begin()
				case 'c':
					c.Close()
				case 'f':
					c.done(EndFailed)
				case 'r':
					c.done(EndRefused)
				case 'o':
					c.done(EndClosed)
				}
				ev.mu.Lock()
				counted := len(ev.ends) > 0
				ev.mu.Unlock()
				if last := i == len(tc.steps)-1; counted != last {
					t.Fatalf("after %q: counted %v, want %v", tc.steps[:i+1], counted, last)
				}
			}
			want := map[End]int{tc.want: 1}
			if fmt.Sprint(ev.ends) != fmt.Sprint(want) {
				t.Errorf("ends %v, want %v", ev.ends, want)
			}
			// A tunnel that was read from is open: reported once, at the
			// close (a net.Pipe is no *ktls.Conn: nothing to report it with).
			if ev.dialsOK != 0 || len(ev.dialErrs) != 0 {
				t.Errorf("dials reported: %s", ev.counts())
			}
		})
	}
}
