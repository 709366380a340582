package caddyktls

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// runSandbox runs "caddy sandbox <args>" on fresh commands with the given
// stdin and returns stdout.
func runSandbox(t *testing.T, stdin io.Reader, args ...string) (string, error) {
	t.Helper()
	root := &cobra.Command{Use: "sandbox", SilenceUsage: true, SilenceErrors: true}
	root.AddCommand(sandboxSubcommands()...)
	var out bytes.Buffer
	root.SetIn(stdin)
	root.SetOut(&out)
	root.SetErr(io.Discard)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), err
}

func TestSandboxCommandRegistered(t *testing.T) {
	if _, ok := caddycmd.Commands()["sandbox"]; !ok {
		t.Fatal(`"sandbox" is not registered with caddycmd`)
	}
}

// TestSandboxKeygenSignVerify round-trips keygen → sign → verify in both
// output formats and checks rejections surface their stable reason.
func TestSandboxKeygenSignVerify(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "gw.key")
	pubPEM, err := runSandbox(t, nil, "keygen", "--key-out", key, "--key-id", "gw-2026")
	if err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(key); err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("private key file: %v %v", info, err)
	}
	ring, err := preamble.ParseKeyring([]byte(pubPEM))
	if err != nil || len(ring) != 1 || ring["gw-2026"] == nil {
		t.Fatalf("keygen printed %q: %v", pubPEM, err)
	}
	keyring := filepath.Join(dir, "keyring.pem")
	if err := os.WriteFile(keyring, []byte(pubPEM), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := runSandbox(t, nil, "keygen", "--key-out", key); err == nil {
		t.Fatal("keygen overwrote an existing key file")
	}

	hexFrame, err := runSandbox(t, nil, "sign", "--key", key, "--key-id", "gw-2026",
		"--sandbox", "sbx-42", "--target", "[fd00::7]:9000", "--ttl", "20s")
	if err != nil {
		t.Fatal(err)
	}
	out, err := runSandbox(t, strings.NewReader(hexFrame), "verify", "--keyring", keyring)
	if err != nil {
		t.Fatal(err)
	}
	var got verifiedClaims
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("verify printed %q: %v", out, err)
	}
	if got.KeyID != "gw-2026" || got.SandboxID != "sbx-42" || got.Target != "[fd00::7]:9000" ||
		got.ExpiresAt.Sub(got.IssuedAt) != 20*time.Second || len(got.Nonce) != 32 || got.Binding != "" {
		t.Fatalf("claims %+v", got)
	}

	// Raw output to a file, bound to a binding; verify needs the same binding.
	raw := filepath.Join(dir, "frame.bin")
	binding := strings.Repeat("ab", 32)
	if _, err := runSandbox(t, nil, "sign", "--key", key, "--key-id", "gw-2026", "--sandbox", "sbx-42",
		"--target", "10.9.8.7:80", "--binding", binding, "--format", "raw", "--out", raw); err != nil {
		t.Fatal(err)
	}
	frame, err := os.ReadFile(raw)
	if err != nil || !bytes.HasPrefix(frame, []byte(preamble.Magic)) {
		t.Fatalf("raw frame %x: %v", frame, err)
	}
	if out, err = runSandbox(t, nil, "verify", "--keyring", keyring, "--in", raw, "--binding", binding, "--require-binding"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `"binding": "`+binding+`"`) {
		t.Fatalf("verify printed %s", out)
	}
	_, err = runSandbox(t, nil, "verify", "--keyring", keyring, "--in", raw)
	if preamble.ReasonOf(err) != "binding-mismatch" || !strings.Contains(err.Error(), "rejected: binding-mismatch") {
		t.Fatalf("verify without the binding: %v", err)
	}

	// A flipped signature bit and a key the keyring lacks.
	frame[len(frame)-1] ^= 1
	_, err = runSandbox(t, bytes.NewReader(frame), "verify", "--keyring", keyring, "--binding", binding)
	if preamble.ReasonOf(err) != "bad-signature" {
		t.Fatalf("tampered frame: %v", err)
	}
	hexFrame, err = runSandbox(t, nil, "sign", "--key", key, "--sandbox", "sbx-42", "--target", "10.9.8.7:80")
	if err != nil {
		t.Fatal(err)
	}
	_, err = runSandbox(t, strings.NewReader(hexFrame), "verify", "--keyring", keyring)
	if preamble.ReasonOf(err) != "unknown-key" {
		t.Fatalf("frame under the derived key ID: %v", err)
	}

	for _, bad := range [][]string{
		{"sign", "--key", key, "--sandbox", "sbx-42", "--target", "sandbox.internal:80"},
		{"sign", "--key", key, "--sandbox", "sbx 42", "--target", "10.0.0.1:80"},
		{"sign", "--key", key, "--sandbox", "sbx-42"},
		{"sign", "--key", key, "--sandbox", "sbx-42", "--target", "10.0.0.1:80", "--format", "base64"},
		{"verify", "--keyring", keyring, "--format", "hex", "--in", raw},
		{"keygen"},
	} {
		if _, err := runSandbox(t, strings.NewReader(""), bad...); err == nil {
			t.Errorf("%v: no error", bad)
		}
	}
}

// TestSandboxBinaryRoundTrip runs keygen → sign → verify with the built
// binary, as an operator does: the subcommands are registered in the real
// caddy main, the files pass between the processes, and a rejection exits 1
// with its stable reason on stderr.
func TestSandboxBinaryRoundTrip(t *testing.T) {
	caddy := builtCaddy(t)
	dir := t.TempDir()
	key, ring := filepath.Join(dir, "gw.key"), filepath.Join(dir, "gateways.pem")
	run := func(stdin string, args ...string) (string, string, error) {
		cmd := exec.Command(caddy, append([]string{"sandbox"}, args...)...)
		var stdout, stderr bytes.Buffer
		cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(stdin), &stdout, &stderr
		err := cmd.Run()
		return stdout.String(), stderr.String(), err
	}
	if _, stderr, err := run("", "keygen", "--key-out", key, "--pub-out", ring, "--key-id", "gw-bin"); err != nil {
		t.Fatalf("keygen: %v\n%s", err, stderr)
	}
	frame, stderr, err := run("", "sign", "--key", key, "--key-id", "gw-bin", "--sandbox", "sbx-bin", "--target", "10.1.2.3:8080")
	if err != nil {
		t.Fatalf("sign: %v\n%s", err, stderr)
	}
	out, stderr, err := run(frame, "verify", "--keyring", ring)
	if err != nil {
		t.Fatalf("verify: %v\n%s", err, stderr)
	}
	var got verifiedClaims
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("verify printed %q: %v", out, err)
	}
	if got.KeyID != "gw-bin" || got.SandboxID != "sbx-bin" || got.Target != "10.1.2.3:8080" ||
		got.ExpiresAt.Sub(got.IssuedAt) != preamble.DefaultTTL || len(got.Nonce) != 2*preamble.NonceLen {
		t.Fatalf("claims %+v", got)
	}

	// The last hex digit is in the signature.
	frame = strings.TrimSpace(frame)
	last := "0"
	if strings.HasSuffix(frame, "0") {
		last = "1"
	}
	_, stderr, err = run(frame[:len(frame)-1]+last, "verify", "--keyring", ring)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(stderr, "rejected: bad-signature") {
		t.Fatalf("tampered frame: %v, stderr %q", err, stderr)
	}
}

// TestSandboxDial runs "caddy sandbox dial" against an in-test forwarder that
// requires a bound preamble and echoes: the bytes piped through stdin come
// back on stdout intact.
func TestSandboxDial(t *testing.T) {
	fdsBefore := kerneltest.OpenFDs(t)
	dir := t.TempDir()
	ca := testpki.NewCA(t, "sandboxcmd-ca")
	serverLeaf, clientLeaf := ca.Server(t), ca.Client(t, "gateway")
	caFile := ca.WriteFile(t, dir, "ca")
	certFile, keyFile := clientLeaf.WriteFiles(t, dir, "gateway")
	signingKey := filepath.Join(dir, "signing.key")
	pubPEM, err := runSandbox(t, nil, "keygen", "--key-out", signingKey)
	if err != nil {
		t.Fatal(err)
	}
	ring, err := preamble.ParseKeyring([]byte(pubPEM))
	if err != nil {
		t.Fatal(err)
	}
	v, err := preamble.NewVerifier(preamble.VerifierConfig{Keys: ring, RequireBinding: true})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{serverLeaf.TLS}, ClientCAs: ca.Pool, ClientAuth: tls.RequireAndVerifyClientCert,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	claimed := make(chan preamble.Claims, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		conn := c.(*tls.Conn)
		defer conn.Close()
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		frame, err := preamble.ReadFrame(conn, v.MaxFrameLen())
		if err != nil {
			served <- err
			return
		}
		binding, _ := preamble.ChannelBinding(conn.ConnectionState())
		claims, err := v.Verify(frame, binding)
		if err != nil {
			served <- err
			return
		}
		claimed <- claims
		conn.SetReadDeadline(time.Time{})
		if _, err := io.Copy(conn, conn); err != nil {
			served <- err
			return
		}
		served <- conn.CloseWrite()
	}()

	payload := bytes.Repeat([]byte("through the tunnel\n"), 256<<10/19)
	out, err := runSandbox(t, bytes.NewReader(payload), "dial", "--addr", ln.Addr().String(),
		"--cert", certFile, "--key", keyFile, "--ca", caFile, "--server-name", "localhost",
		"--signing-key", signingKey, "--sandbox", "sbx-dial", "--target", "192.0.2.10:22")
	if err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Fatalf("forwarder: %v", err)
	}
	if sha256.Sum256([]byte(out)) != sha256.Sum256(payload) || len(out) != len(payload) {
		t.Fatalf("got %d bytes back, want %d with the same SHA-256", len(out), len(payload))
	}
	c := <-claimed
	if c.SandboxID != "sbx-dial" || c.Target.String() != "192.0.2.10:22" || len(c.Binding) != preamble.BindingLen ||
		c.KeyID != preamble.KeyIDFor(ring[c.KeyID]) || hex.EncodeToString(c.Binding) == strings.Repeat("00", 32) {
		t.Fatalf("forwarder saw claims %+v", c)
	}
	ln.Close()
	if fds := kerneltest.OpenFDs(t); fds > fdsBefore {
		t.Fatalf("%d fds open after dial, %d before", fds, fdsBefore)
	}
}
