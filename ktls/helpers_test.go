package ktls

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
	_ "unsafe" // go:linkname

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// testPKI is one CA with a server and a client certificate.
type testPKI struct {
	ca     *testpki.CA
	server *testpki.Leaf
	client *testpki.Leaf
}

func newTestPKI(t testing.TB) *testPKI {
	ca := testpki.NewCA(t, "ktls test CA")
	return &testPKI{ca: ca, server: ca.Server(t), client: ca.Client(t, "ktls test client")}
}

// connCase is one handshake shape.
type connCase struct {
	name       string
	version    uint16 // tls.VersionTLS12 or tls.VersionTLS13
	tickets    bool
	mutualAuth bool
	resume     bool   // handshake twice and transfer over the resumed one
	suite      uint16 // the only suite the client offers (TLS 1.3: onlyTLS13Suite); 0: crypto/tls's defaults
}

// connCases is the Go client's matrix: the default suite (AES-128-GCM)
// across tickets on/off × client auth × resumed for both versions, and
// each other suite full and resumed.
var connCases = []connCase{
	{name: "tls13", version: tls.VersionTLS13, tickets: true},
	{name: "tls13-no-tickets", version: tls.VersionTLS13},
	{name: "tls13-mtls", version: tls.VersionTLS13, tickets: true, mutualAuth: true},
	{name: "tls13-resumed", version: tls.VersionTLS13, tickets: true, resume: true},
	{name: "tls13-resumed-mtls", version: tls.VersionTLS13, tickets: true, mutualAuth: true, resume: true},
	{name: "tls13-aes256", version: tls.VersionTLS13, tickets: true, suite: tls.TLS_AES_256_GCM_SHA384},
	{name: "tls13-aes256-resumed", version: tls.VersionTLS13, tickets: true, resume: true, suite: tls.TLS_AES_256_GCM_SHA384},
	{name: "tls13-chacha20", version: tls.VersionTLS13, tickets: true, suite: tls.TLS_CHACHA20_POLY1305_SHA256},
	{name: "tls13-chacha20-resumed", version: tls.VersionTLS13, tickets: true, resume: true, suite: tls.TLS_CHACHA20_POLY1305_SHA256},
	{name: "tls12", version: tls.VersionTLS12, tickets: true},
	{name: "tls12-no-tickets", version: tls.VersionTLS12},
	{name: "tls12-mtls", version: tls.VersionTLS12, mutualAuth: true},
	{name: "tls12-resumed", version: tls.VersionTLS12, tickets: true, resume: true},
	{name: "tls12-resumed-mtls", version: tls.VersionTLS12, tickets: true, mutualAuth: true, resume: true},
	{name: "tls12-aes256", version: tls.VersionTLS12, tickets: true, suite: tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384},
	{name: "tls12-aes256-resumed", version: tls.VersionTLS12, tickets: true, resume: true, suite: tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384},
	{name: "tls12-chacha20", version: tls.VersionTLS12, tickets: true, suite: tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256},
	{name: "tls12-chacha20-resumed", version: tls.VersionTLS12, tickets: true, resume: true, suite: tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256},
}

// tls13Suites is crypto/tls's TLS 1.3 suite list: what a client offers and,
// with AES hardware, the server's preference order. Config.CipherSuites
// does not apply to TLS 1.3 and Go picks AES-128-GCM whenever both sides
// have AES hardware, so a Go client negotiates AES-256-GCM or
// ChaCha20-Poly1305 only with this list narrowed. crypto/tls keeps the
// variable reachable by linkname for such callers (defaults.go).
//
//go:linkname tls13Suites crypto/tls.defaultCipherSuitesTLS13
var tls13Suites []uint16

// onlyTLS13Suite makes every crypto/tls handshake of this process offer,
// and so agree on, only suite in TLS 1.3 until t ends (a client that
// offers no AES-GCM first gets the server's ChaCha20-first order). No test
// of this package runs in parallel.
func onlyTLS13Suite(t testing.TB, suite uint16) {
	saved := tls13Suites
	tls13Suites = []uint16{suite}
	t.Cleanup(func() { tls13Suites = saved })
}

// connections is how many connections the case makes: two when it
// resumes the first one's session.
func (cc connCase) connections() int64 {
	if cc.resume {
		return 2
	}
	return 1
}

func (p *testPKI) configs(cc connCase) (server, client *tls.Config) {
	server = &tls.Config{
		Certificates:           []tls.Certificate{p.server.TLS},
		SessionTicketsDisabled: !cc.tickets,
		MinVersion:             tls.VersionTLS12,
	}
	client = &tls.Config{
		RootCAs:    p.ca.Pool,
		ServerName: "localhost",
		MaxVersion: cc.version,
		MinVersion: cc.version,
	}
	if cc.mutualAuth {
		server.ClientAuth = tls.RequireAndVerifyClientCert
		server.ClientCAs = p.ca.Pool
		client.Certificates = []tls.Certificate{p.client.TLS}
	}
	if cc.suite != 0 && cc.version == tls.VersionTLS12 {
		client.CipherSuites = []uint16{cc.suite}
	}
	if cc.resume {
		client.ClientSessionCache = tls.NewLRUClientSessionCache(4)
	}
	return server, client
}

// heldConn holds back writes until flush, and flushes before every Read:
// the client's last handshake flight and its first application records
// then leave in one write(2), the case where an over-reading handshake
// would swallow data meant for the kernel.
type heldConn struct {
	net.Conn
	mu   sync.Mutex
	hold bool
	buf  bytes.Buffer
}

func (h *heldConn) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.hold {
		return h.buf.Write(p)
	}
	return h.Conn.Write(p)
}

func (h *heldConn) Read(p []byte) (int, error) {
	h.mu.Lock()
	hold := h.hold
	h.mu.Unlock()
	if err := h.flush(hold); err != nil {
		return 0, err
	}
	return h.Conn.Read(p)
}

// flush writes what is held; hold says whether later writes are held too.
func (h *heldConn) flush(hold bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.hold = hold
	if h.buf.Len() == 0 {
		return nil
	}
	_, err := h.Conn.Write(h.buf.Bytes())
	h.buf.Reset()
	return err
}

// pair is a server-side Conn and the client talking to it.
type pair struct {
	server *Conn
	client *tls.Conn
	held   *heldConn
}

// dialPair connects a crypto/tls client to a Server over loopback TCP and
// completes both handshakes. wrap may replace the accepted conn.
// tls13Pair is a connected TLS 1.3 pair with default options.
func tls13Pair(t testing.TB) *pair {
	t.Helper()
	scfg, ccfg := newTestPKI(t).configs(connCase{version: tls.VersionTLS13})
	pr, err := dialPair(t, scfg, ccfg, Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return pr
}

func dialPair(t testing.TB, scfg, ccfg *tls.Config, opts Options, wrap func(net.Conn) net.Conn) (*pair, error) {
	t.Helper()
	return dialPairOn(t, "tcp", scfg, ccfg, opts, wrap)
}

// dialPairOn is dialPair over network: "tcp" (loopback) or "unix" (a
// socket in a temporary directory).
func dialPairOn(t testing.TB, network string, scfg, ccfg *tls.Config, opts Options, wrap func(net.Conn) net.Conn) (*pair, error) {
	t.Helper()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "sock")
	}
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
	}()
	raw, err := net.Dial(network, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	held := &heldConn{Conn: raw, hold: true}
	client := tls.Client(held, ccfg)
	srvRaw := <-accepted
	if srvRaw == nil {
		t.Fatal("accept failed")
	}
	if wrap != nil {
		srvRaw = wrap(srvRaw)
	}
	server := Server(srvRaw, scfg, opts)
	// Nothing may hang a test run: bound the handshake.
	raw.SetDeadline(time.Now().Add(time.Minute))
	srvRaw.SetDeadline(time.Now().Add(time.Minute))
	srvErr := make(chan error, 1)
	go func() { srvErr <- server.Handshake() }()
	fail := func(err error) (*pair, error) {
		client.Close()
		server.Close()
		return nil, err
	}
	if err := client.Handshake(); err != nil {
		held.flush(false) // the client's alert
		client.Close()
		<-srvErr
		return fail(err)
	}
	// The client's last flight is still held: its first application
	// record joins it in one write(2). Where the client cannot send it,
	// the server's error says why (a refusal resets the connection).
	clientErr := func(err error) (*pair, error) {
		if serr := <-srvErr; serr != nil {
			return fail(serr)
		}
		return fail(err)
	}
	if _, err := client.Write(earlyData); err != nil {
		return clientErr(err)
	}
	if err := held.flush(false); err != nil {
		return clientErr(err)
	}
	if err := <-srvErr; err != nil {
		return fail(err)
	}
	got := make([]byte, len(earlyData))
	if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, earlyData) {
		return fail(fmt.Errorf("data sent with the client's Finished: got %q, %v", got, err))
	}
	raw.SetDeadline(time.Time{})
	srvRaw.SetDeadline(time.Time{})
	pr := &pair{server: server, client: client, held: held}
	t.Cleanup(pr.close) // also when the test stops early
	return pr, nil
}

// earlyData is what the client sends in the same write as its Finished.
var earlyData = []byte("first application bytes, in the segment of the client's Finished")

func (p *pair) close() {
	p.client.Close()
	p.server.Close()
}

// bulkSize is the bytes a bulk transfer moves each way: KTLS_TEST_MIB MiB
// (kerneltest.BulkMiB), else defMiB.
func bulkSize(t testing.TB, defMiB int) int {
	t.Helper()
	return kerneltest.BulkMiB(t, defMiB) << 20
}

// payload returns a deterministic pseudo-random stream of n bytes.
func payload(seed uint64, n int) io.Reader {
	var key [32]byte
	key[0] = byte(seed)
	key[1] = byte(seed >> 8)
	return io.LimitReader(rand.NewChaCha8(key), int64(n))
}

func sum256(r io.Reader) ([32]byte, int64, error) {
	h := sha256.New()
	n, err := io.Copy(h, r)
	return [32]byte(h.Sum(nil)), n, err
}

// exchange moves n bytes each way at the same time and checks the SHA-256
// of both. Then both sides close with close_notify; each must see io.EOF.
func exchange(t testing.TB, p *pair, n int) {
	t.Helper()
	want, _, _ := sum256(payload(1, n))
	wantBack, _, _ := sum256(payload(2, n))
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	wg.Add(4)
	go func() { // client → server
		defer wg.Done()
		if _, err := io.Copy(p.client, payload(1, n)); err != nil {
			errs <- err
			return
		}
		errs <- p.client.CloseWrite()
	}()
	go func() { // server reads until close_notify
		defer wg.Done()
		got, m, err := sum256(p.server)
		switch {
		case err != nil:
			errs <- err
		case m != int64(n) || got != want:
			errs <- errors.New("client→server data corrupted: " + strconv.FormatInt(m, 10) + " bytes")
		default:
			errs <- nil
		}
	}()
	go func() { // server → client
		defer wg.Done()
		if _, err := io.Copy(p.server, payload(2, n)); err != nil {
			errs <- err
			return
		}
		errs <- p.server.CloseWrite()
	}()
	go func() { // client reads until close_notify
		defer wg.Done()
		got, m, err := sum256(p.client)
		switch {
		case err != nil:
			errs <- err
		case m != int64(n) || got != wantBack:
			errs <- errors.New("server→client data corrupted: " + strconv.FormatInt(m, 10) + " bytes")
		default:
			errs <- nil
		}
	}()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Minute):
		t.Fatal("exchange timed out")
	}
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// eventRecorder collects what Options.Observer reports, from any goroutine.
type eventRecorder struct {
	mu     sync.Mutex
	events []Event
}

func (r *eventRecorder) observe(e Event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
}

// seen returns the events so far.
func (r *eventRecorder) seen() []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// checkNoFDLeak fails t if the fd count grew over the test.
func checkNoFDLeak(t *testing.T, openFDs func(testing.TB) int) {
	before := openFDs(t)
	t.Cleanup(func() {
		// Closed sockets leave the netpoller asynchronously.
		deadline := time.Now().Add(5 * time.Second)
		for openFDs(t) > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if after := openFDs(t); after > before {
			t.Errorf("fd leak: %d open before, %d after", before, after)
		}
	})
}
