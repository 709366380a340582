package caddyktls

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// The HTTPS site behind the `ktls` listener wrapper (lwSite) and its
// clients: HTTP/1.1, HTTP/2, HTTP/3, downloads and uploads checked by
// SHA-256, metrics and logs.

// loopbackPort is loopbackAddr's port.
func loopbackPort(t testing.TB) int {
	t.Helper()
	return int(netip.MustParseAddrPort(loopbackAddr(t)).Port())
}

// caddyMaxWriteChunk is the size of the chunks in which Caddy's
// IdleTimeoutWriter (modules/caddyhttp/idletimeout.go, MaxWriteChunk)
// hands a response body to the connection's ReadFrom.
const caddyMaxWriteChunk = 64 << 10

// lwKTLSSeries are the metric families whose every series the metrics test
// accounts for.
var lwKTLSSeries = []string{"caddy_ktls_handshakes_total{", "caddy_ktls_offload_directions_total{", "caddy_ktls_http_body_",
	`caddy_ktls_connections_closed_total{event="refused",module="caddy.listeners.ktls"}`}

// lwCheckSeries checks that every kTLS series of after moved from before
// by exactly want (absent: 0), that want's series exist, and that none of
// before's disappeared.
func lwCheckSeries(t *testing.T, stage string, before, after, want map[string]float64) {
	t.Helper()
	for series := range want {
		if _, ok := after[series]; !ok {
			t.Errorf("%s: /metrics has no %s", stage, series)
		}
	}
	for series, v := range after {
		if !lwIsKTLSSeries(series) {
			continue
		}
		if d := v - before[series]; d != want[series] {
			t.Errorf("%s: %s moved by %v, want %v", stage, series, d, want[series])
		}
	}
	for series := range before {
		if _, ok := after[series]; lwIsKTLSSeries(series) && !ok {
			t.Errorf("%s: %s disappeared from /metrics", stage, series)
		}
	}
}

func lwIsKTLSSeries(series string) bool {
	for _, p := range lwKTLSSeries {
		if strings.HasPrefix(series, p) {
			return true
		}
	}
	return false
}

// lwTestMiB is the download and upload size: kerneltest.BulkMiB
// (KTLS_TEST_MIB), default 2.
func lwTestMiB(t testing.TB) int {
	t.Helper()
	return kerneltest.BulkMiB(t, 2)
}

func lwSHA(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// lwStartSite loads the configuration and waits until HTTPS answers.
// protocols, when given, are the HTTPS server's `protocols`.
func lwStartSite(t *testing.T, wrapper map[string]any, protocols ...string) *lwSite {
	t.Helper()
	return lwStart(t, &lwSite{wrapper: wrapper, protocols: protocols})
}

// lwStart is lwStartSite for a site whose wrapper, protocols and
// cipherSuites are set in s; it fills in the rest of s.
func lwStart(t *testing.T, s *lwSite) *lwSite {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	s.ca = testpki.NewCA(t, "ktls wrapper test CA")
	s.port, s.plainPort = loopbackPort(t), loopbackPort(t)
	s.adminAddr = loopbackAddr(t)
	s.logFile = filepath.Join(dir, "caddy.log")
	s.client = s.ca.Client(t, "gateway-7")
	s.file = make([]byte, lwTestMiB(t)<<20+123) // not a multiple of a record
	rand.Read(s.file)
	if err := os.MkdirAll(filepath.Join(dir, "www", "files"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "www", "files", "blob.bin"), s.file, 0o644); err != nil {
		t.Fatal(err)
	}
	s.upstream = lwHashUpstream(t)
	cfg := s.config(t, filepath.Join(dir, "www"), "v1")
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		// caddy.Stop would leave the admin server running; loading a
		// config with admin disabled stops it and the apps.
		if err := caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}}}`), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	if s.refusesAll {
		waitUntil(t, 10*time.Second, func() bool { return connectable(fmt.Sprintf("127.0.0.1:%d", s.port)) }, "the HTTPS port to accept")
		return s
	}
	probe := s.h1(nil)
	defer probe.CloseIdleConnections()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := probe.Get(s.url("localhost", "/tls"))
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("server did not come up: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return s
}

// lwHashUpstream is a reverse_proxy upstream that answers with the
// SHA-256 and length of the request body.
func lwHashUpstream(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		fmt.Fprintf(w, "%x %d", h.Sum(nil), n)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

const lwStaterWarning = "doesn't implement connectionStater"

type lwReadFromTotals struct{ sendfileCalls, sendfileBytes, copyCalls, copyBytes uint64 }

func lwReadFromNow() lwReadFromTotals {
	var r lwReadFromTotals
	r.sendfileCalls, r.sendfileBytes = readFromSendfile.load()
	r.copyCalls, r.copyBytes = readFromCopy.load()
	return r
}

func (r lwReadFromTotals) sub(o lwReadFromTotals) lwReadFromTotals {
	return lwReadFromTotals{r.sendfileCalls - o.sendfileCalls, r.sendfileBytes - o.sendfileBytes,
		r.copyCalls - o.copyCalls, r.copyBytes - o.copyBytes}
}

// lwSettle collects garbage and returns the open file descriptors and
// goroutines.
func lwSettle(t *testing.T) (fds, goroutines int) {
	runtime.GC()
	return kerneltest.OpenFDs(t), runtime.NumGoroutine()
}

// lwWaitReleased waits up to 10 s for closed connections to release their
// file descriptors and goroutines: until at most fds descriptors and
// goroutines goroutines (when not negative) remain.
func lwWaitReleased(t *testing.T, fds, goroutines int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		nowFDs, nowG := lwSettle(t)
		if nowFDs <= fds && (goroutines < 0 || nowG <= goroutines) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("connections closed but %d fds remain (%d before), %d goroutines (%d before)", nowFDs, fds, nowG, goroutines)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// h3Transport is an HTTP/3 client for s that dials 127.0.0.1 whatever the
// URL's host, like transport. Close it to release its UDP sockets.
func (s *lwSite) h3Transport() *http3.Transport {
	return &http3.Transport{
		TLSClientConfig: s.tlsConfig(nil, false),
		Dial: func(ctx context.Context, addr string, tlsCfg *tls.Config, cfg *quic.Config) (*quic.Conn, error) {
			_, port, _ := net.SplitHostPort(addr)
			return quic.DialAddrEarly(ctx, net.JoinHostPort("127.0.0.1", port), tlsCfg, cfg)
		},
	}
}

// lwSite is an in-process Caddy with the ktls wrapper on one HTTPS server,
// and the same wrapper on a plain-HTTP server (which must pass through).
type lwSite struct {
	ca                 *testpki.CA
	client             *testpki.Leaf
	port, plainPort    int
	adminAddr, logFile string
	file               []byte // served at /files/blob.bin
	wrapper            map[string]any
	upstream           string
	protocols          []string // of the HTTPS server; empty is Caddy's default
	// cipherSuites, when set, are the cipher_suites of the policy for
	// every SNI but mtls.localhost.
	cipherSuites []string
	// refusesAll: the wrapper refuses every connection (fallback refuse
	// without kTLS), so the site is up once its port accepts.
	refusesAll bool
}

// config renders the JSON configuration; version tags the /tls response
// so a reload is visible.
func (s *lwSite) config(t *testing.T, root, version string) []byte {
	t.Helper()
	serverLeaf := s.ca.Server(t, "mtls.localhost")
	wrapper := map[string]any{"wrapper": "ktls"}
	for k, v := range s.wrapper {
		wrapper[k] = v
	}
	tlsBody := version + " {http.request.scheme} {http.request.tls.version} {http.request.tls.cipher_suite} " +
		"{http.request.tls.proto} {http.request.tls.resumed} {http.request.tls.server_name} cn={http.request.tls.client.subject}"
	routes := []any{
		map[string]any{"match": []any{map[string]any{"path": []string{"/files/*"}}},
			"handle": []any{map[string]any{"handler": "file_server", "root": root}}},
		map[string]any{"match": []any{map[string]any{"path": []string{"/tls"}}},
			"handle": []any{map[string]any{"handler": "static_response", "body": tlsBody}}},
		// The `protocol https` matcher reads r.TLS too.
		map[string]any{"match": []any{map[string]any{"path": []string{"/https-only"}, "protocol": "https"}},
			"handle": []any{map[string]any{"handler": "static_response", "body": "https matched"}}},
		map[string]any{"match": []any{map[string]any{"path": []string{"/upload"}}},
			"handle": []any{map[string]any{"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": s.upstream}}}}},
	}
	defaultPolicy := map[string]any{}
	if len(s.cipherSuites) > 0 {
		defaultPolicy["cipher_suites"] = s.cipherSuites
	}
	tlsServer := map[string]any{
		"listen":            []string{fmt.Sprintf("127.0.0.1:%d", s.port)},
		"listener_wrappers": []any{wrapper},
		"automatic_https":   map[string]any{"disable": true},
		"tls_connection_policies": []any{
			map[string]any{
				"match": map[string]any{"sni": []string{"mtls.localhost"}},
				"client_authentication": map[string]any{
					"ca": map[string]any{"provider": "inline",
						"trusted_ca_certs": []string{base64.StdEncoding.EncodeToString(s.ca.Cert.Raw)}},
					"mode": "require_and_verify",
				},
			},
			defaultPolicy,
		},
		"routes": routes,
	}
	if len(s.protocols) > 0 {
		tlsServer["protocols"] = s.protocols
	}
	cfg := map[string]any{
		"admin": map[string]any{"listen": s.adminAddr, "config": map[string]any{"persist": false}},
		// Caddy's default storage path is fixed at init, before t.Setenv.
		"storage": map[string]any{"module": "file_system", "root": filepath.Join(filepath.Dir(s.logFile), "storage")},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{
			"level":   "DEBUG",
			"writer":  map[string]any{"output": "file", "filename": s.logFile},
			"encoder": map[string]any{"format": "json"},
		}}},
		"apps": map[string]any{
			"tls": map[string]any{"certificates": map[string]any{"load_pem": []any{
				map[string]any{"certificate": string(serverLeaf.CertPEM), "key": string(serverLeaf.KeyPEM)},
			}}},
			"http": map[string]any{
				"http_port":  s.plainPort,
				"https_port": s.port,
				"servers": map[string]any{
					"tls": tlsServer,
					"plain": map[string]any{
						"listen":            []string{fmt.Sprintf("127.0.0.1:%d", s.plainPort)},
						"listener_wrappers": []any{wrapper},
						"routes":            routes,
					},
				},
			},
		},
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func (s *lwSite) url(host, path string) string {
	return fmt.Sprintf("https://%s:%d%s", host, s.port, path)
}

func (s *lwSite) tlsConfig(cache tls.ClientSessionCache, withCert bool) *tls.Config {
	cfg := &tls.Config{RootCAs: s.ca.Pool, ClientSessionCache: cache}
	if withCert {
		cfg.Certificates = []tls.Certificate{s.client.TLS}
	}
	return cfg
}

// transport dials 127.0.0.1 whatever the URL's host, so SNI can vary.
func (s *lwSite) transport(cfg *tls.Config, h2 bool) *http.Transport {
	tr := &http.Transport{
		TLSClientConfig:   cfg,
		ForceAttemptHTTP2: h2,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			_, port, _ := net.SplitHostPort(addr)
			var d net.Dialer
			return d.DialContext(ctx, network, net.JoinHostPort("127.0.0.1", port))
		},
	}
	if !h2 {
		// Without HTTP/2 the transport offers no ALPN at all; offer
		// http/1.1 like browsers and curl do.
		tr.TLSClientConfig = cfg.Clone()
		tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	return tr
}

func (s *lwSite) h1(cfg *tls.Config) *http.Client {
	if cfg == nil {
		cfg = s.tlsConfig(nil, false)
	}
	return &http.Client{Transport: s.transport(cfg, false), Timeout: 2 * time.Minute}
}

func (s *lwSite) h2(cfg *tls.Config) *http.Client {
	if cfg == nil {
		cfg = s.tlsConfig(nil, false)
	}
	return &http.Client{Transport: s.transport(cfg, true), Timeout: 2 * time.Minute}
}

// xnetH2 is an HTTP/2-only client on golang.org/x/net/http2's own
// Transport (the framer and flow control gRPC and many Go clients use),
// not net/http's bundled copy behind ForceAttemptHTTP2.
func (s *lwSite) xnetH2(cfg *tls.Config) *http.Client {
	if cfg == nil {
		cfg = s.tlsConfig(nil, false)
	}
	tr := &http2.Transport{
		TLSClientConfig: cfg,
		DialTLSContext: func(ctx context.Context, network, addr string, cfg *tls.Config) (net.Conn, error) {
			_, port, _ := net.SplitHostPort(addr)
			d := tls.Dialer{Config: cfg}
			return d.DialContext(ctx, network, net.JoinHostPort("127.0.0.1", port))
		},
	}
	return &http.Client{Transport: tr, Timeout: 2 * time.Minute}
}

// get fetches url and returns the body, failing t on any error or non-200.
func lwGet(t *testing.T, c *http.Client, url string, wantProto int) []byte {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: reading body: %v", url, err)
	}
	if resp.StatusCode != http.StatusOK || resp.ProtoMajor != wantProto {
		t.Fatalf("GET %s: %s over HTTP/%d, want 200 over HTTP/%d: %q", url, resp.Status, resp.ProtoMajor, wantProto, body)
	}
	return body
}

// lwPost POSTs body to url and returns the response body, failing t on
// any error or non-200.
func lwPost(t *testing.T, c *http.Client, url string, body []byte, wantProto int) []byte {
	t.Helper()
	resp, err := c.Post(url, "application/octet-stream", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK || resp.ProtoMajor != wantProto {
		t.Fatalf("POST %s: %s over HTTP/%d (%v), want 200 over HTTP/%d: %q", url, resp.Status, resp.ProtoMajor, err, wantProto, got)
	}
	return got
}

// exercise runs every check on one lwSite and returns the number of TLS
// connections it opened to the HTTPS server.
func (s *lwSite) exercise(t *testing.T) (conns int) {
	t.Helper()
	for _, proto := range []struct {
		name   string
		major  int
		client func(*tls.Config) *http.Client
	}{{"h1", 1, s.h1}, {"h2", 2, s.h2}, {"h2-x-net", 2, s.xnetH2}} {
		t.Run(proto.name, func(t *testing.T) {
			c := proto.client(nil)
			defer c.CloseIdleConnections()
			conns++
			// Download through file_server.
			if got := lwGet(t, c, s.url("localhost", "/files/blob.bin"), proto.major); lwSHA(got) != lwSHA(s.file) || len(got) != len(s.file) {
				t.Fatalf("download: %d bytes sha %s, want %d bytes sha %s", len(got), lwSHA(got), len(s.file), lwSHA(s.file))
			}
			// Upload through reverse_proxy.
			body := lwPost(t, c, s.url("localhost", "/upload"), s.file, proto.major)
			if want := fmt.Sprintf("%s %d", lwSHA(s.file), len(s.file)); string(body) != want {
				t.Fatalf("upload: upstream saw %q, want %q", body, want)
			}
			// r.TLS for placeholders and matchers.
			wantALPN := map[int]string{1: "http/1.1", 2: "h2"}[proto.major]
			got := string(lwGet(t, c, s.url("localhost", "/tls"), proto.major))
			want := "v1 https tls1.3 TLS_AES_128_GCM_SHA256 " + wantALPN + " false localhost cn="
			if got != want {
				t.Errorf("TLS placeholders: %q, want %q", got, want)
			}
			if got := string(lwGet(t, c, s.url("localhost", "/https-only"), proto.major)); got != "https matched" {
				t.Errorf("protocol https matcher: %q", got)
			}
		})
	}
	t.Run("client-auth", func(t *testing.T) {
		c := s.h1(s.tlsConfig(nil, true))
		defer c.CloseIdleConnections()
		conns++
		got := string(lwGet(t, c, s.url("mtls.localhost", "/tls"), 1))
		if !strings.HasSuffix(got, " mtls.localhost cn=CN=gateway-7") {
			t.Errorf("client certificate placeholder: %q", got)
		}
		// Without a certificate the handshake must fail.
		noCert := s.h1(s.tlsConfig(nil, false))
		defer noCert.CloseIdleConnections()
		conns++
		if resp, err := noCert.Get(s.url("mtls.localhost", "/tls")); err == nil {
			resp.Body.Close()
			t.Errorf("request without client certificate succeeded: %s", resp.Status)
		}
	})
	t.Run("resumption", func(t *testing.T) {
		cache := tls.NewLRUClientSessionCache(4)
		for i, want := range []string{"false", "true"} {
			c := s.h1(s.tlsConfig(cache, false))
			conns++
			got := strings.Fields(string(lwGet(t, c, s.url("localhost", "/tls"), 1)))
			c.CloseIdleConnections()
			if len(got) < 6 || got[5] != want {
				t.Errorf("connection %d: resumed placeholder in %q, want %s", i, got, want)
			}
		}
	})
	t.Run("plain-http-passes-through", func(t *testing.T) {
		c := &http.Client{Timeout: 10 * time.Second}
		resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/tls", s.plainPort))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.HasPrefix(string(body), "v1 http ") {
			t.Errorf("plain HTTP: %q", body)
		}
	})
	return conns
}

// logLines returns the JSON log entries whose message contains substr.
func (s *lwSite) logLines(t *testing.T, substr string) []map[string]any {
	t.Helper()
	return jsonLogLines(t, s.logFile, substr)
}

// jsonLogLines returns the entries of a JSON log file whose message
// contains substr.
func jsonLogLines(t *testing.T, logFile, substr string) []map[string]any {
	t.Helper()
	f, err := os.Open(logFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var e map[string]any
		if json.Unmarshal(sc.Bytes(), &e) != nil {
			continue
		}
		if msg, _ := e["msg"].(string); strings.Contains(msg, substr) {
			out = append(out, e)
		}
	}
	return out
}

// lwPausedDownload is a download whose client stopped reading after the
// first bytes of the body.
type lwPausedDownload struct {
	name   string
	client *http.Client
	tcp    *net.TCPConn // the client's socket
	resp   *http.Response
	head   []byte
}

// startDownload GETs url over a new connection (h2 or HTTP/1.1 with a
// 32 KiB receive buffer), reads the first 64 KiB of the body and stops.
func (s *lwSite) startDownload(t *testing.T, name, url string, h2 bool) *lwPausedDownload {
	t.Helper()
	d := &lwPausedDownload{name: name}
	tr := s.transport(s.tlsConfig(nil, false), h2)
	dial := tr.DialContext
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		d.tcp = c.(*net.TCPConn)
		if !h2 {
			err = d.tcp.SetReadBuffer(32 << 10)
		}
		return c, err
	}
	d.client = &http.Client{Transport: tr, Timeout: 2 * time.Minute}
	t.Cleanup(d.client.CloseIdleConnections)
	var err error
	if d.resp, err = d.client.Get(url); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	t.Cleanup(func() { d.resp.Body.Close() })
	if major := map[bool]int{false: 1, true: 2}[h2]; d.resp.ProtoMajor != major {
		t.Fatalf("%s: HTTP/%d, want HTTP/%d", name, d.resp.ProtoMajor, major)
	}
	d.head = make([]byte, 64<<10)
	if _, err := io.ReadFull(d.resp.Body, d.head); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return d
}

// received is what the client's kernel has received on the connection so
// far (TCP_INFO tcpi_bytes_received): TLS records, so at least the
// plaintext bytes they carry.
func (d *lwPausedDownload) received(t *testing.T) uint64 {
	t.Helper()
	rc, err := d.tcp.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var info *unix.TCPInfo
	var ierr error
	if err := rc.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil || ierr != nil {
		t.Fatalf("%s: TCP_INFO: %v %v", d.name, err, ierr)
	}
	return info.Bytes_received
}

// finish reads the rest of the body and returns the whole of it.
func (d *lwPausedDownload) finish() ([]byte, error) {
	rest, err := io.ReadAll(d.resp.Body)
	return append(d.head, rest...), err
}

// reload loads the site's configuration tagged version through the admin
// API (POST /load), as an operator would.
func (s *lwSite) reload(t *testing.T, version string) {
	t.Helper()
	root := filepath.Join(filepath.Dir(s.logFile), "www")
	admin := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	lr, err := admin.Post("http://"+s.adminAddr+"/load", "application/json", bytes.NewReader(s.config(t, root, version)))
	if err != nil {
		t.Fatalf("POST /load: %v", err)
	}
	msg, _ := io.ReadAll(lr.Body)
	lr.Body.Close()
	if lr.StatusCode != http.StatusOK {
		t.Fatalf("POST /load: %s %s", lr.Status, msg)
	}
}
