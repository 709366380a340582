package caddyktls

import (
	"bytes"
	"crypto/x509"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// A gateway certificate the forwarder refuses, and what each side must
// say about it.
type refusedCertificate struct {
	name string
	leaf func(t *testing.T, ca *testpki.CA) *testpki.Leaf
	// alert is what the gateway reads; fix what its error must tell.
	alert, fix string
	// reason is the forwarder's caddy_ktls_handshake_failures_total reason.
	reason string
}

var refusedCertificates = []refusedCertificate{
	{
		name: "no-clientauth-eku",
		leaf: func(t *testing.T, ca *testpki.CA) *testpki.Leaf {
			return ca.Leaf(t, "gateway-1", x509.ExtKeyUsageServerAuth)
		},
		alert:  "(bad_certificate)",
		fix:    "it lacks the clientAuth extended key usage, which a forwarder requires of a client certificate: issue it with extKeyUsage clientAuth",
		reason: "untrusted-certificate",
	},
	{
		name: "ca-outside-trust-pool",
		leaf: func(t *testing.T, _ *testpki.CA) *testpki.Leaf {
			return testpki.NewCA(t, "other CA").Client(t, "gateway-1")
		},
		alert: "(unknown_ca)",
		fix:   `its issuer "CN=other CA" is not in the forwarder's client_auth trust_pool: add that CA there, or use a certificate a CA in it issued`,
		// Sent although its issuer is not among the CAs the forwarder
		// names: never no-client-certificate.
		reason: "untrusted-certificate",
	},
}

// reloaded loads e's configuration again and waits until the admin
// endpoint answers from the new one: until the replaced admin server has
// stopped, its socket takes a share of the connections and closes them
// unanswered.
func reloaded(t *testing.T, e *sandboxEnv) {
	t.Helper()
	e.load(t)
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	ok := 0
	waitUntil(t, 10*time.Second, func() bool {
		resp, err := client.Get("http://" + e.adminAddr + "/metrics")
		if err == nil {
			resp.Body.Close()
			ok++
		} else {
			ok = 0
		}
		return ok >= 20
	}, "the admin endpoint to answer 20 times in a row after the reload")
}

// useGatewayCertificate makes the gateway modules of e use leaf as their
// client certificate, from the next load.
func useGatewayCertificate(t *testing.T, files gatewayFiles, leaf *testpki.Leaf) {
	t.Helper()
	for path, data := range map[string][]byte{files.cert: leaf.CertPEM, files.key: leaf.KeyPEM} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func forwarderFailuresSeries(reason string) string {
	return `caddy_ktls_handshake_failures_total{module="layer4.handlers.ktls",reason="` + reason + `"}`
}

// checkRefusalLogs checks that msg was logged n times at WARN, each naming
// the alert and what to do, and that no line calls a refusal anything else.
func checkRefusalLogs(t *testing.T, e *sandboxEnv, msg string, n int, c refusedCertificate, never ...string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for len(e.logLines(t, msg)) < n && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	lines := e.logLines(t, msg)
	if len(lines) != n {
		log, _ := os.ReadFile(e.logFile)
		t.Errorf("%d log lines %q, want %d; the log:\n%s", len(lines), msg, n, log)
	}
	for _, l := range lines {
		errText, _ := l["error"].(string)
		if l["level"] != "warn" || !strings.Contains(errText, "handshake: the forwarder refused the gateway's client certificate "+c.alert) ||
			!strings.Contains(errText, c.fix) || !strings.Contains(errText, "nothing reached the sandbox") {
			t.Errorf("log line %v: want WARN naming %s and saying %q", l, c.alert, c.fix)
		}
	}
	for _, m := range never {
		if got := e.logLines(t, m); len(got) != 0 {
			t.Errorf("a certificate refusal was logged as %q: %v", m, got[0])
		}
	}
}

// A forwarder that refuses the gateway's certificate, which with TLS 1.3
// the gateway learns only after its handshake (from the tunnel, before the
// forwarder's first byte): every user connection through sandbox_proxy is
// a dial refused at its handshake step, counted as such (never ok, no
// tunnel end), logged at WARN with the alert and what to do; the user's
// session is refused (access_denied) and nothing reaches the sandbox. The
// forwarder counts the certificate as untrusted.
func TestSandboxProxyCertificateRefused(t *testing.T) { sandboxProxyCertificateRefused(t) }

func TestKernelSandboxProxyCertificateRefused(t *testing.T) {
	kerneltest.Require(t)
	sandboxProxyCertificateRefused(t)
}

func sandboxProxyCertificateRefused(t *testing.T) {
	const n = 10
	for _, c := range refusedCertificates {
		t.Run(c.name, func(t *testing.T) {
			up := forwardtest.NewUpstream(t, 1)
			e := newGatewayEnv(t, map[string]any{"target": up.Addr().String()})
			useGatewayCertificate(t, e.files, c.leaf(t, e.ca))
			reloaded(t, e.sandboxEnv)
			waitIdle(t)
			m0 := e.metrics(t)
			for i := range n {
				nread, err := userEnded(t, e.userDial(t, uniqueSandbox("sbx-cert")), 1024)
				if nread != 0 || err == nil || !strings.Contains(err.Error(), "access denied") {
					t.Errorf("user %d read %d bytes, ended with %v: want none, refused (access denied)", i, nread, err)
				}
			}
			checkRefusalLogs(t, e.sandboxEnv, "sandbox_proxy: cannot open the tunnel; refused, nothing reached the sandbox", n, c,
				"sandbox_proxy: tunnel failed", "sandbox_proxy: the forwarder refused the tunnel (its log names the reason); nothing reached the sandbox")
			want := map[string]int64{
				gatewayDialsSeries("handshake"): n, gatewayDialsSeries("ok"): 0, gatewayDialsSeries("preamble"): 0,
				gatewayEndsSeries("closed"): 0, gatewayEndsSeries("refused"): 0, gatewayEndsSeries("failed"): 0,
				forwarderFailuresSeries(c.reason): n, forwarderFailuresSeries("no-client-certificate"): 0,
				tunnelsTotalSeries: 0,
			}
			waitUntil(t, 10*time.Second, func() bool {
				return e.metrics(t)[forwarderFailuresSeries(c.reason)]-m0[forwarderFailuresSeries(c.reason)] >= n
			},
				"the forwarder to count the refused handshakes")
			checkMetricDeltas(t, m0, e.metrics(t), want)
			if up.Accepted() != 0 {
				t.Errorf("the sandbox was dialed %d times", up.Accepted())
			}
		})
	}
}

// The same refusal through the sandbox transport, HTTP/1.1 and h2c to the
// app: each request is a dial refused at its handshake step (never ok, no
// tunnel end), retried as a dial error (a DELETE, which reverse_proxy
// retries after nothing else), then answered 502; nothing reaches the app.
func TestSandboxTransportCertificateRefused(t *testing.T) { sandboxTransportCertificateRefused(t) }

func TestKernelSandboxTransportCertificateRefused(t *testing.T) {
	kerneltest.Require(t)
	sandboxTransportCertificateRefused(t)
}

func sandboxTransportCertificateRefused(t *testing.T) {
	dials := func(result string) string {
		return `caddy_ktls_gateway_dials_total{module="http.reverse_proxy.transport.sandbox",result="` + result + `"}`
	}
	ends := func(end string) string {
		return `caddy_ktls_gateway_tunnel_ends_total{end="` + end + `",module="http.reverse_proxy.transport.sandbox"}`
	}
	for _, v := range []string{"1.1", "h2c"} {
		for _, c := range refusedCertificates {
			t.Run(v+"/"+c.name, func(t *testing.T) { transportCertificateRefused(t, v, c, dials, ends) })
		}
	}
}

func transportCertificateRefused(t *testing.T, version string, c refusedCertificate, dials, ends func(string) string) {
	const n = 10
	app := startSandboxApp(t)
	e := newTransportEnv(t, app.addr, map[string]any{"versions": []string{version}}, map[string]any{"load_balancing": map[string]any{"retries": 1}})
	useGatewayCertificate(t, e.files, c.leaf(t, e.ca))
	reloaded(t, e.sandboxEnv)
	waitIdle(t)
	m0 := e.metrics(t)
	user := e.user(false)
	for i := range n {
		req, _ := http.NewRequest("DELETE", siteURL(uniqueSandbox("sbx-cert"), "/echo"), nil)
		resp, err := user.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway || resp.Header.Get("X-Remote") != "" {
			t.Errorf("request %d: %s from %q, want 502 and nothing from the app", i, resp.Status, resp.Header.Get("X-Remote"))
		}
	}
	user.CloseIdleConnections()
	// Each request and its retry.
	checkRefusalLogs(t, e.sandboxEnv, "sandbox transport: cannot open the tunnel; nothing reached the sandbox", 2*n, c,
		"sandbox transport: the tunnel failed before the response", "sandbox transport: the tunnel failed mid-response",
		"sandbox transport: the forwarder refused the tunnel (its log names the reason); nothing reached the sandbox")
	waitUntil(t, 10*time.Second, func() bool {
		return e.metrics(t)[forwarderFailuresSeries(c.reason)]-m0[forwarderFailuresSeries(c.reason)] >= 2*n
	},
		"the forwarder to count the refused handshakes")
	checkMetricDeltas(t, m0, e.metrics(t), map[string]int64{
		dials("handshake"): 2 * n, dials("ok"): 0, dials("preamble"): 0,
		ends("closed"): 0, ends("refused"): 0, ends("failed"): 0,
		forwarderFailuresSeries(c.reason): 2 * n, forwarderFailuresSeries("no-client-certificate"): 0,
		tunnelsTotalSeries: 0,
	})
}

// "caddy sandbox dial" with a certificate the forwarder refuses fails
// saying which alert it read and what to do, with nothing on stdout, exit
// status 1.
func TestSandboxDialCertificateRefused(t *testing.T) { sandboxDialCertificateRefused(t) }

func TestKernelSandboxDialCertificateRefused(t *testing.T) {
	kerneltest.Require(t)
	sandboxDialCertificateRefused(t)
}

func sandboxDialCertificateRefused(t *testing.T) {
	caddyBin := builtCaddy(t)
	up := forwardtest.NewUpstream(t, 1)
	e := newSandboxEnv(t, nil)
	dir := t.TempDir()
	signingKey := filepath.Join(dir, "signing.key")
	if _, err := runSandbox(t, nil, "keygen", "--key-out", signingKey, "--key-id", "gw-dial"); err != nil {
		t.Fatal(err)
	}
	caFile := e.ca.WriteFile(t, dir, "ca")
	for _, c := range refusedCertificates {
		t.Run(c.name, func(t *testing.T) {
			certFile, keyFile := c.leaf(t, e.ca).WriteFiles(t, t.TempDir(), "gateway")
			args := []string{"dial", "--addr", e.addr, "--server-name", "localhost", "--cert", certFile, "--key", keyFile, "--ca", caFile,
				"--signing-key", signingKey, "--sandbox", "sbx-dial", "--target", up.Addr().String()}
			for i := range 5 {
				out, err := runSandbox(t, strings.NewReader("hello"), args...)
				if out != "" || err == nil || !strings.Contains(err.Error(), "the forwarder refused the gateway's client certificate "+c.alert) ||
					!strings.Contains(err.Error(), c.fix) {
					t.Errorf("dial %d: %q on stdout, error %v; want nothing, and the alert %s with %q", i, out, err, c.alert, c.fix)
				}
			}
			stdout, stderr, code := runBinary(t, caddyBin, "hello", append([]string{"sandbox"}, args...)...)
			if code != 1 || stdout != "" || !strings.Contains(stderr, c.alert) || !strings.Contains(stderr, c.fix) {
				t.Errorf("caddy sandbox dial: exit %d, stdout %q, stderr %q; want 1, nothing, and the alert %s with %q", code, stdout, stderr, c.alert, c.fix)
			}
			if up.Accepted() != 0 {
				t.Errorf("the target was dialed %d times", up.Accepted())
			}
		})
	}
}

// runBinary runs bin with args and stdin, and returns its stdout, stderr
// and exit status.
func runBinary(t *testing.T, bin, stdin string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(stdin), &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return stdout.String(), stderr.String(), 0
	case errors.As(err, &exit):
		return stdout.String(), stderr.String(), exit.ExitCode()
	}
	t.Fatalf("%s: %v", bin, err)
	return "", "", 0
}
