package caddyktls

import (
	"bufio"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestListenerWrapperCurl downloads through the wrapper with curl (OpenSSL,
// nghttp2) over HTTP/1.1 and HTTP/2, on userspace TLS here.
func TestListenerWrapperCurl(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperCurl covers this kernel")
	}
	lwCurl(t, false)
}

// TestKernelListenerWrapperCurl is the curl download on a kTLS kernel:
// offloaded, and the HTTP/1.1 body sent with sendfile. KTLS_TEST_MIB=256 is
// the full-size run.
func TestKernelListenerWrapperCurl(t *testing.T) {
	kerneltest.Require(t)
	lwCurl(t, true)
}

func lwCurl(t *testing.T, kernel bool) {
	curl := lwLookCurl(t)
	s := lwStartSite(t, map[string]any{"sendfile": true})
	caFile := s.ca.WriteFile(t, t.TempDir(), "ca")
	for _, proto := range []string{"--http1.1", "--http2"} {
		t.Run(strings.TrimPrefix(proto, "--"), func(t *testing.T) {
			before, rf := ktls.Stats().Outcomes[ktls.ReasonNone], lwReadFromNow()
			lwCurlDownload(t, s, curl, caFile, proto)
			if !kernel {
				return
			}
			if ktls.Stats().Outcomes[ktls.ReasonNone] == before {
				t.Error("curl's connection was not offloaded")
			}
			if d := lwReadFromNow().sub(rf); proto == "--http1.1" && d.sendfileBytes < uint64(len(s.file)-512) {
				t.Errorf("HTTP/1.1 body: %d bytes by sendfile, want >= %d", d.sendfileBytes, len(s.file)-512)
			}
		})
	}
}

// lwLookCurl finds curl: missing, it skips on the host and fails in the VM.
func lwLookCurl(t *testing.T) string {
	t.Helper()
	curl, err := exec.LookPath("curl")
	if err != nil {
		if kerneltest.Required() {
			t.Fatalf("curl is needed in the VM: %v", err)
		}
		t.Skipf("SKIP: no curl: %v", err)
	}
	return curl
}

// lwCurlRun runs curl with args over proto (--http1.1, --http2) for path on
// the site (trusting caFile) and returns its output.
func lwCurlRun(t *testing.T, s *lwSite, curl, caFile, proto, path string, args ...string) string {
	t.Helper()
	cmd := exec.Command(curl, append(append([]string{"--silent", "--show-error", "--fail", proto, "--cacert", caFile,
		"--resolve", fmt.Sprintf("localhost:%d:127.0.0.1", s.port)}, args...), s.url("localhost", path))...)
	got, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("curl %s %s: %v: %s", proto, path, err, got)
	}
	return string(got)
}

// lwCurlVersion is how curl's %{http_version} names proto.
var lwCurlVersion = map[string]string{"--http1.1": "1.1", "--http2": "2"}

// lwCurlDownload downloads the site's file with curl over proto
// (--http1.1, --http2) and checks the protocol, size and SHA-256. The
// copy is hashed as it is read and removed, so a full-size (256 MiB) run
// keeps one copy of the file in the VM's memory besides the site's.
func lwCurlDownload(t *testing.T, s *lwSite, curl, caFile, proto string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "blob")
	got := lwCurlRun(t, s, curl, caFile, proto, "/files/blob.bin", "--output", out, "--write-out", "%{http_version} %{size_download}")
	if want := fmt.Sprintf("%s %d", lwCurlVersion[proto], len(s.file)); got != want {
		t.Errorf("curl reports %q, want %q", got, want)
	}
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(out)
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		t.Fatal(err)
	}
	if hex.EncodeToString(h.Sum(nil)) != lwSHA(s.file) {
		t.Fatalf("curl downloaded %d bytes with a different SHA-256 (want %d bytes)", n, len(s.file))
	}
}

// TestKernelListenerWrapperSendfileSyscalls checks with the kernel's own
// records, not only our counters, that sendfile mode sends file bodies with
// sendfile(2). curl (another process, so this one is only the server)
// downloads the same file over HTTP/1.1 in the default mode and in sendfile
// mode while strace records this process's sendfile calls: their results
// must add up to exactly the bytes our ReadFrom counter claims, the whole
// body, and to nothing in the default mode. The kernel's per-thread I/O
// accounting gives the read and write syscalls per MiB of both modes (one
// sendfile counts as one of each), which the test logs. It asserts no ratio
// between them: on a kTLS socket a sendfile call moves at most what fits in
// the socket's send buffer, so it takes about as many calls as copying
// 32 KiB buffers through write(2); what it saves is the copy and the
// file's read(2) calls.
func TestKernelListenerWrapperSendfileSyscalls(t *testing.T) {
	kerneltest.Require(t)
	curl := lwLookCurl(t)
	strace, err := exec.LookPath("strace")
	if err != nil {
		t.Fatalf("strace is needed in the VM: %v", err)
	}
	for _, sendfile := range []bool{false, true} {
		t.Run("sendfile="+strconv.FormatBool(sendfile), func(t *testing.T) {
			s := lwStartSite(t, map[string]any{"sendfile": sendfile})
			caFile := s.ca.WriteFile(t, t.TempDir(), "ca")
			stopTrace := lwTraceSendfile(t, strace)
			ioBefore, rf := lwProcIO(t), lwReadFromNow()
			lwCurlDownload(t, s, curl, caFile, "--http1.1")
			used, counted := lwProcIO(t).sub(ioBefore), lwReadFromNow().sub(rf)
			calls, traced := stopTrace()
			mib := float64(len(s.file)) / (1 << 20)
			t.Logf("%.1f MiB: %d sendfile calls moving %d bytes; %d read and %d write syscalls (%.1f and %.1f per MiB), %d bytes read and %d written",
				mib, calls, traced, used.syscr, used.syscw, float64(used.syscr)/mib, float64(used.syscw)/mib, used.rchar, used.wchar)
			// sendfile(2) counts its bytes as written too, so in both
			// modes the whole body went through the write counter.
			if used.wchar < uint64(len(s.file)) {
				t.Errorf("the kernel counted %d bytes written for a %d-byte body", used.wchar, len(s.file))
			}
			if !sendfile {
				if calls != 0 {
					t.Errorf("default mode: %d sendfile calls moved %d bytes", calls, traced)
				}
				return
			}
			if traced != counted.sendfileBytes || traced < uint64(len(s.file)-512) {
				t.Errorf("sendfile calls moved %d bytes, the sendfile counter says %d, want both equal and >= %d",
					traced, counted.sendfileBytes, len(s.file)-512)
			}
		})
	}
}

// lwTraceSendfile attaches strace to every thread of this process and
// returns a function that detaches it and returns the successful
// sendfile(2) calls it saw and the bytes they moved. strace follows the
// children too (curl), which never call sendfile.
func lwTraceSendfile(t *testing.T, strace string) (stop func() (calls int, bytes uint64)) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "strace")
	cmd := exec.Command(strace, "-f", "-e", "trace=sendfile", "-e", "status=successful", "-e", "signal=none", "-o", out,
		"-p", strconv.Itoa(os.Getpid()))
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// strace says "Process N attached with M threads" once it traces them.
	var said []string
	sc := bufio.NewScanner(stderr)
	for sc.Scan() && !strings.Contains(sc.Text(), " attached") {
		said = append(said, sc.Text())
	}
	if sc.Err() != nil || !strings.Contains(sc.Text(), " attached") {
		cmd.Wait()
		t.Fatalf("strace did not attach: %v %q", sc.Err(), said)
	}
	drained := make(chan struct{})
	go func() { io.Copy(io.Discard, stderr); close(drained) }()
	return func() (int, uint64) {
		t.Helper()
		if err := cmd.Process.Signal(os.Interrupt); err != nil {
			t.Fatal(err)
		}
		<-drained
		cmd.Wait() // exits with the interrupt
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		// Whole calls end in ") = N" (strace pads before the "="); a call
		// interrupted by another thread's line ends in "<unfinished ...>"
		// and its result is on a later "<... sendfile resumed>) = N".
		var calls int
		var bytes uint64
		for _, m := range lwSendfileResult.FindAllSubmatch(b, -1) {
			n, err := strconv.ParseUint(string(m[1]), 10, 64)
			if err != nil {
				t.Fatalf("strace line %q: %v", m[0], err)
			}
			calls++
			bytes += n
		}
		return calls, bytes
	}
}

// lwSendfileResult matches the result of a sendfile call in strace's output.
var lwSendfileResult = regexp.MustCompile(`(?m)sendfile.*\)\s+= (\d+)$`)

type lwIOCounters struct{ rchar, wchar, syscr, syscw uint64 }

// lwProcIO sums the I/O accounting of this process's threads,
// /proc/self/task/*/io. Not /proc/self/io: that one also adds the counts of
// reaped children (curl) to the process's.
func lwProcIO(t *testing.T) lwIOCounters {
	t.Helper()
	files, err := filepath.Glob("/proc/self/task/*/io")
	if err != nil || len(files) == 0 {
		t.Fatalf("the kernel's per-thread I/O accounting: %v %v", files, err)
	}
	var total lwIOCounters
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatalf("the kernel's per-thread I/O accounting: %v", err)
		}
		var c lwIOCounters
		fields := map[string]*uint64{"rchar": &c.rchar, "wchar": &c.wchar, "syscr": &c.syscr, "syscw": &c.syscw}
		for line := range strings.Lines(string(b)) {
			name, value, _ := strings.Cut(strings.TrimSpace(line), ": ")
			if p, ok := fields[name]; ok {
				if *p, err = strconv.ParseUint(value, 10, 64); err != nil {
					t.Fatalf("%s: %q: %v", f, line, err)
				}
				delete(fields, name)
			}
		}
		if len(fields) != 0 {
			t.Fatalf("%s lacks %d of rchar, wchar, syscr, syscw:\n%s", f, len(fields), b)
		}
		total = total.add(c)
	}
	return total
}

func (c lwIOCounters) add(o lwIOCounters) lwIOCounters {
	return lwIOCounters{c.rchar + o.rchar, c.wchar + o.wchar, c.syscr + o.syscr, c.syscw + o.syscw}
}

func (c lwIOCounters) sub(o lwIOCounters) lwIOCounters {
	return lwIOCounters{c.rchar - o.rchar, c.wchar - o.wchar, c.syscr - o.syscr, c.syscw - o.syscw}
}

// TestListenerWrapperBinary runs the real binary (cmd/caddy) with a
// Caddyfile that turns the wrapper on with `listener_wrappers { ktls }`:
// curl downloads a file_server file and uploads a body through
// reverse_proxy, over HTTP/1.1 and HTTP/2 (SHA-256 both ways); a Go client
// resumes its TLS session on a second connection; on a site with
// client_auth a client with a certificate gets its CN from a placeholder
// and one without is refused. The binary's /metrics count exactly those
// connections and the HTTP/1.1 body's ReadFrom calls. On this kernel they
// fall back to userspace TLS. KTLS_BINARY_DOWNLOAD_MIB sets the download's
// size (default KTLS_TEST_MIB, 2); the upload stays KTLS_TEST_MIB.
func TestListenerWrapperBinary(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperBinary covers this kernel")
	}
	lwBinary(t, false)
}

// TestKernelListenerWrapperBinary is the same on a kTLS kernel: every
// connection that completes its handshake gets TX and RX keys in the
// kernel (tls_stat), the resumed one too, and the HTTP/1.1 body goes out
// with sendfile. KTLS_BINARY_DOWNLOAD_MIB=256 is the full-size
// download.
func TestKernelListenerWrapperBinary(t *testing.T) {
	kerneltest.Require(t)
	lwBinary(t, true)
}

func lwBinary(t *testing.T, kernel bool) {
	curl := lwLookCurl(t)
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	ca := testpki.NewCA(t, "binary test CA")
	certFile, keyFile := ca.Server(t, "mtls.localhost").WriteFiles(t, dir, "server")
	caFile := ca.WriteFile(t, dir, "ca")
	s := &lwSite{ca: ca, client: ca.Client(t, "binary-gateway"), port: loopbackPort(t), adminAddr: loopbackAddr(t),
		logFile: filepath.Join(dir, "caddy.log"), file: make([]byte, kerneltest.PositiveEnv(t, "KTLS_BINARY_DOWNLOAD_MIB", lwTestMiB(t))<<20+123)}
	rand.Read(s.file)
	download := filepath.Join(dir, "www", "files", "blob.bin")
	if err := os.MkdirAll(filepath.Dir(download), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(download, s.file, 0o644); err != nil {
		t.Fatal(err)
	}
	uploadBody := make([]byte, lwTestMiB(t)<<20+45)
	rand.Read(uploadBody)
	upload := filepath.Join(dir, "upload.bin")
	if err := os.WriteFile(upload, uploadBody, 0o644); err != nil {
		t.Fatal(err)
	}
	caddyfile := filepath.Join(dir, "Caddyfile")
	// The client_auth site's access log: r.TLS as Caddy logs it.
	accessLog := filepath.Join(dir, "access.log")
	if err := os.WriteFile(caddyfile, fmt.Appendf(nil, `{
	admin %[1]s
	persist_config off
	storage file_system %[2]s
	auto_https disable_redirects
	log {
		output file %[3]s {
			roll_disabled
		}
		format json
	}
	servers {
		listener_wrappers {
			ktls {
				sendfile
			}
		}
	}
}

https://localhost:%[4]d {
	tls %[5]s %[6]s
	root * %[7]s
	file_server /files/*
	reverse_proxy /upload %[8]s
	respond /tls "{http.request.tls.version} resumed={http.request.tls.resumed}"
}

https://mtls.localhost:%[4]d {
	tls %[5]s %[6]s {
		client_auth {
			mode require_and_verify
			trust_pool file %[9]s
		}
	}
	log {
		output file %[10]s {
			roll_disabled
		}
		format json
	}
	@gateway expression {http.request.tls.client.subject} == "CN=binary-gateway"
	respond @gateway "cn={http.request.tls.client.subject}"
	respond "not the gateway" 403
}
`, s.adminAddr, filepath.Join(dir, "storage"), s.logFile, s.port, certFile, keyFile, filepath.Join(dir, "www"), lwHashUpstream(t), caFile, accessLog), 0o600); err != nil {
		t.Fatal(err)
	}
	runCaddy(t, "", fmt.Sprintf("127.0.0.1:%d", s.port), s.logFile, "--config", caddyfile, "--adapter", "caddyfile")

	metrics := func() map[string]float64 { return parseMetrics(t, adminGet(t, s.adminAddr, "/metrics")) }
	protos := []string{"--http1.1", "--http2"}
	// Connections that complete their handshake: a download and an upload
	// per protocol, two for resumption, one with a client certificate.
	const goConns = 3
	conns := 2*len(protos) + goConns
	var downloadTime time.Duration
	exchange := func() {
		for _, proto := range protos {
			start := time.Now()
			lwCurlDownload(t, s, curl, caFile, proto)
			downloadTime += time.Since(start)
			got := lwCurlRun(t, s, curl, caFile, proto, "/upload", "--data-binary", "@"+upload, "--write-out", " %{http_version}")
			if want := fmt.Sprintf("%s %d %s", lwSHA(uploadBody), len(uploadBody), lwCurlVersion[proto]); got != want {
				t.Errorf("curl %s upload: %q, want %q (SHA-256, length, HTTP version)", proto, got, want)
			}
		}
		lwResumeAndClientAuth(t, s)
	}
	// runCaddy's readiness probe connected and closed without a
	// handshake: wait until the binary has counted it, so that it is
	// outside the deltas.
	const failed = `caddy_ktls_handshakes_total{module="caddy.listeners.ktls",reason="handshake-failed"}`
	before := metrics()
	for deadline := time.Now().Add(15 * time.Second); before[failed] < 1; before = metrics() {
		if time.Now().After(deadline) {
			t.Fatalf("the readiness probe's connection was never counted: %s = %v", failed, before[failed])
		}
		time.Sleep(20 * time.Millisecond)
	}
	if kernel {
		// The binary's kernel TLS installs show up in the shared tls_stat.
		delta := kerneltest.StatDelta(t, exchange)
		if delta["TlsTxSw"] != int64(conns) || delta["TlsRxSw"] != int64(conns) {
			t.Errorf("tls_stat TlsTxSw +%d TlsRxSw +%d, want +%d each (one per connection past its handshake)", delta["TlsTxSw"], delta["TlsRxSw"], conns)
		}
		t.Logf("tls_stat delta: %v", delta)
	} else {
		exchange()
	}
	after := metrics()
	t.Logf("%d-byte download with curl over %v: %v in all", len(s.file), protos, downloadTime)
	reason, path, summary := "no-kernel-support", "copy", "kernel TLS unavailable"
	if kernel {
		reason, path, summary = "none", "sendfile", "kernel TLS available"
	}
	// Only the HTTP/1.1 download, once per Caddy chunk, less the 512
	// bytes net/http sniffs; without kTLS sendfile is not in effect, and
	// nothing goes through ReadFrom.
	writes, bytes := float64((len(s.file)+caddyMaxWriteChunk-1)/caddyMaxWriteChunk), float64(len(s.file)-512)
	if !kernel {
		writes, bytes = 0, 0
	}
	for series, want := range map[string]float64{
		`caddy_ktls_handshakes_total{module="caddy.listeners.ktls",reason="` + reason + `"}`: float64(conns),
		failed: 1, // the client without a certificate
		`caddy_ktls_http_body_writes_total{path="` + path + `"}`: writes,
		`caddy_ktls_http_body_bytes_total{path="` + path + `"}`:  bytes,
	} {
		if got := after[series] - before[series]; got != want {
			t.Errorf("binary's /metrics: %s moved by %v, want %v", series, got, want)
		} else {
			t.Logf("binary's /metrics: %s +%.0f", series, got)
		}
	}
	if lines := jsonLogLines(t, s.logFile, summary); len(lines) != 1 {
		t.Errorf("%d %q start summaries in the binary's log, want 1", len(lines), summary)
	} else if l := lines[0]; l["server"] == nil || l["listener"] == nil || (!kernel && l["rx_in_kernel"] != nil) {
		t.Errorf("start summary %v: want the server and listener it is about, and no rx_in_kernel where nothing is offloaded", l)
	}
	// sendfile is on, and on a host without kTLS not in effect: no WARN
	// for each connection.
	if warns := jsonLogLines(t, s.logFile, lwStaterWarning); !kernel && len(warns) != 0 {
		t.Errorf("%d per-connection connectionStater WARNs on a host without kTLS, want none", len(warns))
	}
	checkAccessLogTLS(t, accessLog)
}

// checkAccessLogTLS checks the client_auth site's access log: one request,
// matched by the client-certificate expression (status 200, not the 403
// fallback), logged with the TLS state of the kernel-TLS connection: TLS
// 1.3, its SNI and the client certificate's common name.
func checkAccessLogTLS(t *testing.T, accessLog string) {
	t.Helper()
	entries := jsonLogLines(t, accessLog, "handled request")
	if len(entries) != 1 {
		t.Fatalf("%d access log entries on the client_auth site, want 1: %v", len(entries), entries)
	}
	request, _ := entries[0]["request"].(map[string]any)
	state, _ := request["tls"].(map[string]any)
	for field, want := range map[string]any{
		"version":            float64(tls.VersionTLS13),
		"server_name":        "mtls.localhost",
		"client_common_name": "binary-gateway",
	} {
		if state[field] != want {
			t.Errorf("access log request.tls.%s = %v, want %v (entry %v)", field, state[field], want, entries[0])
		}
	}
	if entries[0]["status"] != float64(200) {
		t.Errorf("access log status %v, want 200: the client-certificate matcher did not match", entries[0]["status"])
	}
}

// lwResumeAndClientAuth makes the binary test's Go-client connections
// (HTTP/1.1): two sharing a session cache, the second of which must
// resume the first's TLS 1.3 session, then on mtls.localhost one with the
// site's client certificate, which must see its CN in the response, and
// one without, which must be refused.
func lwResumeAndClientAuth(t *testing.T, s *lwSite) {
	t.Helper()
	cache := tls.NewLRUClientSessionCache(4)
	for i, want := range []string{"tls1.3 resumed=false", "tls1.3 resumed=true"} {
		c := s.h1(s.tlsConfig(cache, false))
		if got := string(lwGet(t, c, s.url("localhost", "/tls"), 1)); got != want {
			t.Errorf("Go client, connection %d with a session cache: %q, want %q", i+1, got, want)
		}
		c.CloseIdleConnections()
	}
	withCert := s.h1(s.tlsConfig(nil, true))
	defer withCert.CloseIdleConnections()
	if got, want := string(lwGet(t, withCert, s.url("mtls.localhost", "/"), 1)), "cn=CN=binary-gateway"; got != want {
		t.Errorf("client_auth site with a client certificate: %q, want %q", got, want)
	}
	noCert := s.h1(nil)
	defer noCert.CloseIdleConnections()
	if resp, err := noCert.Get(s.url("mtls.localhost", "/")); err == nil {
		resp.Body.Close()
		t.Errorf("client_auth site without a client certificate: %s, want the handshake refused", resp.Status)
	}
}
