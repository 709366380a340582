package caddyktls

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// The whole path as deployed: a user's curl (HTTP/1.1 and HTTP/2, an
// upload and a download) and openssl s_client (raw TCP by server name)
// reach the sandbox through two Caddy processes, the edge gateway and the
// forwarder, exact to the byte.
func TestGatewayTwoProcesses(t *testing.T) { gatewayTwoProcesses(t, false) }

// TestKernelGatewayTwoProcesses is TestGatewayTwoProcesses on kTLS: both
// hops' sessions in the kernel (tls_stat) and the raw TCP tunnel spliced
// kTLS to kTLS at the gateway (its relay counters).
func TestKernelGatewayTwoProcesses(t *testing.T) {
	kerneltest.Require(t)
	gatewayTwoProcesses(t, true)
}

func gatewayTwoProcesses(t *testing.T, kernel bool) {
	curl := lwLookCurl(t)
	openssl, err := exec.LookPath("openssl")
	if err != nil {
		if kerneltest.Required() {
			t.Fatalf("openssl is needed in the VM: %v", err)
		}
		t.Skipf("SKIP: no openssl: %v", err)
	}
	app := startSandboxApp(t)
	echo := startEcho(t)

	// The forwarder: its own process.
	fwd := newSandboxConfig(t, nil)
	files := addGatewaySide(t, fwd)
	startCaddy(t, fwd, "")

	// The gateway: another process, an HTTPS site and a raw TCP port.
	gw := startGatewayProcess(t, fwd, files, app.addr, echo, false)
	dir, gwHTTPS, gwTCP, gwAdmin := gw.dir, gw.https, gw.tcp, gw.admin
	caFile := fwd.ca.WriteFile(t, dir, "ca.pem")
	_, httpsPort, _ := net.SplitHostPort(gwHTTPS)
	host := "sbx-procs.sandbox.test"

	var before kerneltest.Stat
	if kernel {
		if before, err = kerneltest.ReadStat(); err != nil {
			t.Fatal(err)
		}
	}
	// curl: an upload and a download per HTTP version.
	const size = 1 << 20
	upload := filepath.Join(dir, "upload")
	if err := os.WriteFile(upload, readAll(t, io.LimitReader(forwardtest.NewPattern(41), size)), 0o600); err != nil {
		t.Fatal(err)
	}
	wantUp := forwardtest.PatternSum(41, size)
	for _, version := range []string{"--http1.1", "--http2"} {
		out, headers := filepath.Join(dir, "out"), filepath.Join(dir, "headers")
		cmd := exec.Command(curl, "-sS", "--fail", version, "--cacert", caFile, "--resolve", host+":"+httpsPort+":127.0.0.1",
			"--data-binary", "@"+upload, "-D", headers, "-o", out, "https://"+host+":"+httpsPort+"/echo?size="+strconv.Itoa(size))
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("curl %s: %v\n%s", version, err, b)
		}
		h, _ := os.ReadFile(headers)
		if !strings.Contains(strings.ToLower(string(h)), "x-received-sha256: "+hex.EncodeToString(wantUp[:])) {
			t.Errorf("curl %s: the app did not receive the upload exact:\n%s", version, h)
		}
		if got := sha256.Sum256(readFile(t, out)); got != forwardtest.PatternSum(9, size) {
			t.Errorf("curl %s: the download differs", version)
		}
	}

	// openssl s_client: raw TCP by server name, echoed by the sandbox.
	cmd := exec.Command(openssl, "s_client", "-quiet", "-no_ign_eof", "-connect", gwTCP, "-servername", host, "-CAfile", caFile)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line := "hello through two Caddy processes"
	io.WriteString(stdin, line+"\n")
	got := make(chan string, 1)
	go func() { s, _ := bufio.NewReader(stdout).ReadString('\n'); got <- s }()
	select {
	case s := <-got:
		if strings.TrimSpace(s) != line {
			t.Errorf("openssl s_client read %q, want the echo %q", s, line)
		}
	case <-time.After(30 * time.Second):
		t.Error("openssl s_client: no echo within 30 s")
	}
	stdin.Close()
	cmd.Wait()

	metricsAt := func() map[string]float64 { return parseMetrics(t, adminGet(t, gwAdmin, "/metrics")) }
	waitUntil(t, 10*time.Second, func() bool {
		return metricsAt()[`caddy_ktls_gateway_tunnel_ends_total{end="closed",module="layer4.handlers.sandbox_proxy"}`] == 1
	}, "the gateway to count the raw TCP tunnel closed")
	m := metricsAt()
	spliced, copied := m[`caddy_ktls_gateway_relay_bytes_total{path="splice"}`], m[`caddy_ktls_gateway_relay_bytes_total{path="copy"}`]
	if spliced+copied != float64(2*(len(line)+1)) {
		t.Errorf("gateway relay: %v spliced + %v copied, want the %d bytes each way", spliced, copied, len(line)+1)
	}
	if kernel {
		after, err := kerneltest.ReadStat()
		if err != nil {
			t.Fatal(err)
		}
		// HTTP: the gateway's client and the forwarder's server sessions
		// (one pooled tunnel, or a few); raw TCP: three more.
		if tx, rx := after["TlsTxSw"]-before["TlsTxSw"], after["TlsRxSw"]-before["TlsRxSw"]; tx < 5 || rx < 5 {
			t.Errorf("tls_stat: %d TX and %d RX sessions, want at least 5 each (both hops)", tx, rx)
		}
		if copied != 0 {
			t.Errorf("the gateway copied %v bytes through userspace, want 0 (kTLS to kTLS)", copied)
		}
	}
}

// gatewayProcess is a gateway Caddy run in its own process in front of a
// forwarder: an HTTPS site whose reverse_proxy reaches app through the
// sandbox transport (sandbox: the Host's third label), and a layer4 port
// whose ktls + sandbox_proxy reach echo (sandbox: the server name's).
type gatewayProcess struct {
	dir, https, tcp, admin, logFile string
}

// startGatewayProcess starts that gateway; wrapHTTPS puts the ktls
// listener wrapper on its HTTPS site.
func startGatewayProcess(t *testing.T, fwd *sandboxEnv, files gatewayFiles, app, echo string, wrapHTTPS bool) gatewayProcess {
	t.Helper()
	gw := gatewayProcess{dir: t.TempDir(), https: loopbackAddr(t), tcp: loopbackAddr(t), admin: loopbackAddr(t)}
	gw.logFile = filepath.Join(gw.dir, "gateway.log")
	transport := files.dialJSON()
	transport["protocol"], transport["sandbox"], transport["target"] = "sandbox", "{http.request.host.labels.2}", app
	proxy := files.dialJSON()
	proxy["handler"], proxy["forwarder"], proxy["sandbox"], proxy["target"] = "sandbox_proxy", fwd.addr, "{l4.tls.server_name.labels.2}", echo
	site := map[string]any{
		"listen": []string{gw.https}, "automatic_https": map[string]any{"disable": true},
		"tls_connection_policies": []any{map[string]any{}},
		"routes": []any{map[string]any{"handle": []any{map[string]any{
			"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": fwd.addr}}, "transport": transport}}}},
	}
	if wrapHTTPS {
		site["listener_wrappers"] = []any{map[string]any{"wrapper": "ktls"}}
	}
	cfg := cloneJSON(t, map[string]any{
		"admin":   map[string]any{"listen": gw.admin, "config": map[string]any{"persist": false}},
		"logging": fwd.cfg["logging"],
		"apps": map[string]any{
			"tls":  fwd.cfg["apps"].(map[string]any)["tls"],
			"http": map[string]any{"servers": map[string]any{"gateway": site}},
			"layer4": map[string]any{"servers": map[string]any{"edge": map[string]any{
				"listen": []string{gw.tcp},
				"routes": []any{map[string]any{"handle": []any{map[string]any{"handler": "ktls"}, proxy}}},
			}}},
		},
	})
	cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["writer"].(map[string]any)["filename"] = gw.logFile
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfgFile := filepath.Join(gw.dir, "gateway.json")
	if err := os.WriteFile(cfgFile, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	runCaddy(t, "", gw.tcp, gw.logFile, "--config", cfgFile)
	return gw
}

// startEcho is a sandbox's raw TCP service that echoes each connection.
func startEcho(t *testing.T) string {
	return forwardtest.ServeTCP(t, func(c net.Conn) {
		defer c.Close()
		io.Copy(c, c)
	})
}

func readAll(t *testing.T, r io.Reader) []byte {
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func readFile(t *testing.T, path string) []byte {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
