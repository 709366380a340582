package caddyktls

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/cputest"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// BenchmarkSandboxShed is what a connection costs the forwarder's process:
// shed for max_handshakes (one handshake held in progress, the bound 1)
// on each listener network, and, for scale, served: a gateway's call (mutual
// TLS, a signed preamble, 200 bytes up and 1 KiB down from a target). The
// client and the target run in another process, so cpu-ns/op (getrusage)
// is the forwarder's CPU alone:
//
//	go test -run '^$' -bench 'SandboxShed' -benchtime 2000x -count 3 .
//
// On `tcp/` the ktls handler sheds, behind caddy-l4's accept loop: an
// accepted connection, its goroutine and caddy-l4's per-connection state.
// On `tcp-retry/` and `tcp-handoff/` the listener sheds before caddy-l4
// sees the connection, and `tcp-handoff/` before Go's accept.
func BenchmarkSandboxShed(b *testing.B) {
	for _, arm := range []struct{ name, network, mode string }{
		{"served", "tcp", "served"},
		{"shed-tcp", "tcp", "shed"},
		{"shed-tcp-retry", "tcp-retry", "shed"},
		{"shed-tcp-handoff", "tcp-handoff", "shed"},
	} {
		b.Run(arm.name, func(b *testing.B) {
			e := newSandboxConfig(b, nil)
			ktlsHandler := e.route()["handle"].([]any)[0].(map[string]any)
			if arm.mode == "shed" {
				ktlsHandler["max_handshakes"] = 1
			}
			e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)["listen"] = []string{arm.network + "/" + e.addr}
			e.start(b)
			if arm.mode == "shed" {
				holdHandshakes(b, e.addr, 1)
				waitUntil(b, 30*time.Second, func() bool { return e.metric(b, `caddy_ktls_handshakes_in_progress`) == 1 }, "the held handshake")
			}
			key := e.gw.Key.Seed()
			client := exec.Command(os.Args[0])
			client.Env = append(os.Environ(),
				shedClientEnv+"="+strings.Join([]string{arm.mode, e.addr, strconv.Itoa(b.N),
					base64.StdEncoding.EncodeToString(e.ca.PEM), base64.StdEncoding.EncodeToString(e.client.CertPEM),
					base64.StdEncoding.EncodeToString(e.client.KeyPEM), base64.StdEncoding.EncodeToString(key)}, ","))
			var out bytes.Buffer
			client.Stdout, client.Stderr = &out, &out
			b.ResetTimer()
			cpuBefore := cputest.Used(b)
			if err := client.Run(); err != nil {
				b.Fatalf("client: %v\n%s", err, out.Bytes())
			}
			b.ReportMetric(float64(cputest.Used(b)-cpuBefore)/float64(b.N), "cpu-ns/op")
		})
	}
}

// shedClientEnv carries BenchmarkSandboxShed's arguments to its client
// process (TestMain): mode (shed or served), the forwarder's address, the number of
// connections, then base64 of the CA's PEM, the client certificate's and
// key's PEM, and the gateway's Ed25519 seed.
const shedClientEnv = "CADDY_KTLS_SHED_CLIENT"

// TestMain runs BenchmarkSandboxShed's client process when the benchmark
// started the test binary as one, and the tests otherwise.
func TestMain(m *testing.M) {
	if spec := os.Getenv(shedClientEnv); spec != "" {
		if err := shedCostClient(spec); err != nil {
			fmt.Fprintln(os.Stderr, "shed cost client:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// shedCostClient makes BenchmarkSandboxShed's connections (shedClientEnv
// is spec): shed ones, or served calls to a target of its own, which
// answers each with 1 KiB.
func shedCostClient(spec string) error {
	f := strings.Split(spec, ",")
	if len(f) != 7 {
		return fmt.Errorf("%s: %d fields, want 7", shedClientEnv, len(f))
	}
	mode, addr := f[0], f[1]
	n, err := strconv.Atoi(f[2])
	if err != nil {
		return err
	}
	if mode == "shed" {
		for i := range n {
			if err := shedOnce(addr); err != nil {
				return fmt.Errorf("connection %d: %w", i, err)
			}
		}
		return nil
	}
	var dec [7][]byte
	for k := 3; k < 7; k++ {
		if dec[k], err = base64.StdEncoding.DecodeString(f[k]); err != nil {
			return err
		}
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(dec[3])
	cert, err := tls.X509KeyPair(dec[4], dec[5])
	if err != nil {
		return err
	}
	signer, err := preamble.NewSigner(gatewayKeyID, ed25519.NewKeyFromSeed(dec[6]))
	if err != nil {
		return err
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: "localhost", MinVersion: tls.VersionTLS13,
		Certificates: []tls.Certificate{cert}, CurvePreferences: []tls.CurveID{tls.X25519}}
	target, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer target.Close()
	reply := make([]byte, 1<<10)
	go func() {
		for {
			c, err := target.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(io.Discard, c)
				c.Write(reply)
			}()
		}
	}()
	req := make([]byte, 200)
	for i := range n {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := gatewayDial(ctx, addr, cfg, signer, "sbx-bench", target.Addr().(*net.TCPAddr).AddrPort())
		cancel()
		if err != nil {
			return fmt.Errorf("call %d: %w", i, err)
		}
		_, werr := c.Write(req)
		cerr := c.CloseWrite()
		got, rerr := io.Copy(io.Discard, c)
		c.Close()
		if werr != nil || cerr != nil || rerr != nil || got != 1<<10 {
			return fmt.Errorf("call %d: read %d bytes (want 1024); write %v, close_notify %v, read %v", i, got, werr, cerr, rerr)
		}
	}
	return nil
}

// shedOnce connects to addr as a gateway would (a ClientHello's worth of
// bytes at once) and expects the plaintext access_denied alert, then the
// end: a reset, since the server read nothing.
func shedOnce(addr string) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(make([]byte, 300)); err != nil && !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
		return err
	}
	got, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		return err
	}
	if want := []byte{21, 3, 3, 0, 2, 2, 49}; !bytes.Equal(got, want) {
		return fmt.Errorf("read % x, want the access_denied alert % x", got, want)
	}
	return nil
}
