package caddyktls

import (
	"bytes"
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/ktlsingress/caddy-ktls/internal/cli"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// runSandbox runs "caddy sandbox <args>" on fresh commands with the given
// stdin and returns stdout.
func runSandbox(t *testing.T, stdin io.Reader, args ...string) (string, error) {
	t.Helper()
	root := &cobra.Command{Use: "sandbox", SilenceUsage: true, SilenceErrors: true}
	root.AddCommand(cli.SandboxSubcommands()...)
	var out bytes.Buffer
	root.SetIn(stdin)
	root.SetOut(&out)
	root.SetErr(io.Discard)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), err
}

// keygenIn runs `caddy sandbox keygen` for keyID into dir: the private
// key file gw.key and the keyring gateways.pem.
func keygenIn(t *testing.T, dir, keyID string) (key, ring string) {
	t.Helper()
	key, ring = filepath.Join(dir, "gw.key"), filepath.Join(dir, "gateways.pem")
	if _, err := runSandbox(t, nil, "keygen", "--key-out", key, "--pub-out", ring, "--key-id", keyID); err != nil {
		t.Fatal(err)
	}
	return key, ring
}

// runSandboxStderr is runSandbox that also returns what the command wrote
// to stderr.
func runSandboxStderr(t *testing.T, stdin io.Reader, args ...string) (string, string, error) {
	t.Helper()
	root := &cobra.Command{Use: "sandbox", SilenceUsage: true, SilenceErrors: true}
	root.AddCommand(cli.SandboxSubcommands()...)
	var out, errOut bytes.Buffer
	root.SetIn(stdin)
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), errOut.String(), err
}

// TestSandboxKeygenSignLongTTL: "sign --ttl" beyond what a default
// forwarder accepts still signs, and warns on stderr naming the default
// maximum and the forwarder option that raises it; a TTL within it signs
// without a word on stderr.
func TestSandboxKeygenSignLongTTL(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "gw.key")
	pubPEM, err := runSandbox(t, nil, "keygen", "--key-out", key, "--key-id", "gw-ttl")
	if err != nil {
		t.Fatal(err)
	}
	keyring := filepath.Join(dir, "keyring.pem")
	if err := os.WriteFile(keyring, []byte(pubPEM), 0o644); err != nil {
		t.Fatal(err)
	}
	sign := func(ttl string) (string, string) {
		t.Helper()
		frame, stderr, err := runSandboxStderr(t, nil, "sign", "--key", key, "--key-id", "gw-ttl",
			"--sandbox", "sbx-ttl", "--target", "10.1.2.3:80", "--ttl", ttl)
		if err != nil {
			t.Fatalf("--ttl %s: %v (stderr %q)", ttl, err, stderr)
		}
		return frame, stderr
	}
	frame, stderr := sign("10m")
	for _, want := range []string{"warning", "10m0s", preamble.DefaultMaxTTL.String(), "max_preamble_ttl", "ttl-too-long"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr %q does not name %q", stderr, want)
		}
	}
	// Signed all the same: a default verifier rejects it for its TTL only,
	// one whose max TTL covers it accepts it.
	_, err = runSandbox(t, strings.NewReader(frame), "verify", "--keyring", keyring)
	if preamble.ReasonOf(err) != string(preamble.ReasonTTLTooLong) {
		t.Fatalf("default verify of a 10m preamble: %v", err)
	}
	if _, err := runSandbox(t, strings.NewReader(frame), "verify", "--keyring", keyring, "--max-ttl", "10m"); err != nil {
		t.Fatalf("verify --max-ttl 10m: %v", err)
	}
	for _, ttl := range []string{"30s", preamble.DefaultMaxTTL.String()} {
		if _, stderr := sign(ttl); stderr != "" {
			t.Errorf("--ttl %s: stderr %q, want nothing", ttl, stderr)
		}
	}
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
	var got cli.VerifiedClaims
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
	// A key file that names no key ID (from openssl genpkey, or an older
	// keygen) signs under the ID derived from the key.
	keyData, err := os.ReadFile(key)
	if err != nil {
		t.Fatal(err)
	}
	anonKey := filepath.Join(dir, "anon.key")
	_, pemOnly, _ := bytes.Cut(keyData, []byte("\n"))
	if err := os.WriteFile(anonKey, pemOnly, 0o600); err != nil {
		t.Fatal(err)
	}
	hexFrame, err = runSandbox(t, nil, "sign", "--key", anonKey, "--sandbox", "sbx-42", "--target", "10.9.8.7:80")
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
	var got cli.VerifiedClaims
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

// dialFixture is what "caddy sandbox dial" and an in-test forwarder need:
// a CA, the gateway's certificate files and a signing key whose public
// half the forwarder trusts.
type dialFixture struct {
	ca                                   *testpki.CA
	server                               *testpki.Leaf
	caFile, certFile, keyFile, signerKey string
	ring                                 map[string]ed25519.PublicKey
	verifier                             *preamble.Verifier
}

func newDialFixture(t *testing.T) *dialFixture {
	t.Helper()
	dir := t.TempDir()
	f := &dialFixture{ca: testpki.NewCA(t, "sandboxcmd-ca"), signerKey: filepath.Join(dir, "signing.key")}
	f.server = f.ca.Server(t)
	f.caFile = f.ca.WriteFile(t, dir, "ca")
	f.certFile, f.keyFile = f.ca.Client(t, "gateway").WriteFiles(t, dir, "gateway")
	pubPEM, err := runSandbox(t, nil, "keygen", "--key-out", f.signerKey)
	if err != nil {
		t.Fatal(err)
	}
	if f.ring, err = preamble.ParseKeyring([]byte(pubPEM)); err != nil {
		t.Fatal(err)
	}
	if f.verifier, err = preamble.NewVerifier(preamble.VerifierConfig{Keys: f.ring, RequireBinding: true}); err != nil {
		t.Fatal(err)
	}
	return f
}

// serverConfig is the forwarder's TLS: mutual, against the fixture's CA.
func (f *dialFixture) serverConfig() *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{f.server.TLS}, ClientCAs: f.ca.Pool, ClientAuth: tls.RequireAndVerifyClientCert}
}

// dial runs "caddy sandbox dial" to addr with stdin.
func (f *dialFixture) dial(t *testing.T, addr string, stdin io.Reader) (string, error) {
	t.Helper()
	return runSandbox(t, stdin, "dial", "--addr", addr,
		"--cert", f.certFile, "--key", f.keyFile, "--ca", f.caFile, "--server-name", "localhost",
		"--signing-key", f.signerKey, "--sandbox", "sbx-dial", "--target", "192.0.2.10:22")
}

// TestSandboxDial runs "caddy sandbox dial" against an in-test forwarder that
// requires a bound preamble and echoes: the bytes piped through stdin come
// back on stdout intact.
func TestSandboxDial(t *testing.T) {
	fdsBefore := kerneltest.OpenFDs(t)
	f := newDialFixture(t)
	v, ring := f.verifier, f.ring
	ln, err := tls.Listen("tcp", "127.0.0.1:0", f.serverConfig())
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
	out, err := f.dial(t, ln.Addr().String(), bytes.NewReader(payload))
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

// A forwarder that refuses the preamble: "caddy sandbox dial" fails saying
// so, with nothing on stdout. In userspace TLS 1.3 the refusal is the
// access_denied alert too. A forwarder that can only reset (a crypto/tls
// conn, or one that already wrote; Abort here) gets a reset, and the
// command says what a reset before the first byte can mean.
func TestSandboxDialRefused(t *testing.T) {
	sandboxDialRefused(t, false, (*ktls.Conn).Refuse, "the forwarder refused the tunnel before its first byte (remote error: tls: access denied): nothing reached the target")
	sandboxDialRefused(t, false, (*ktls.Conn).Abort, "the forwarder reset the tunnel before its first byte", syscall.ECONNRESET.Error())
	sandboxDialRefused(t, false, (*ktls.Conn).Abort, "the forwarder reset the tunnel before its first byte (connection reset by peer): a refusal")
}

// TestKernelSandboxDialRefused is TestSandboxDialRefused against a
// forwarder on kernel TLS TX, whose refusal is the alert access_denied.
func TestKernelSandboxDialRefused(t *testing.T) {
	kerneltest.Require(t)
	sandboxDialRefused(t, true, (*ktls.Conn).Refuse, "the forwarder refused the tunnel before its first byte (remote error: tls: access denied): nothing reached the target")
}

// sandboxDialRefused runs a dial that the forwarder ends with end after
// reading the preamble; the command's error must contain each of want.
func sandboxDialRefused(t *testing.T, kernel bool, end func(*ktls.Conn) error, want ...string) {
	// stdin stays open, so the command writes nothing after the preamble
	// that could meet the reset first.
	stdin, stdinW := io.Pipe()
	defer stdinW.Close()
	sandboxDialRefusedStdin(t, kernel, stdin, end, want...)
}

func sandboxDialRefusedStdin(t *testing.T, kernel bool, stdin io.Reader, end func(*ktls.Conn) error, want ...string) {
	fdsBefore := kerneltest.OpenFDs(t)
	f := newDialFixture(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// The forwarder reads the frame, finds the wrong sandbox in it and
	// refuses, as forward.Serve does for any rejection.
	refused := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			refused <- err
			return
		}
		conn := ktls.Server(c, f.serverConfig(), ktls.Options{RequireOffload: kernel})
		defer conn.Close()
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		frame, err := preamble.ReadFrame(conn, f.verifier.MaxFrameLen())
		if err != nil {
			refused <- err
			return
		}
		binding, _ := preamble.ChannelBinding(conn.ConnectionState())
		if claims, err := f.verifier.Verify(frame, binding); err != nil || claims.SandboxID != "sbx-dial" {
			refused <- fmt.Errorf("claims %+v, %v", claims, err)
			return
		}
		refused <- end(conn)
	}()
	out, err := f.dial(t, ln.Addr().String(), stdin)
	if rerr := <-refused; rerr != nil {
		t.Fatalf("forwarder: %v", rerr)
	}
	if err == nil || out != "" {
		t.Fatalf("dial of a refused tunnel: %q on stdout, error %v; want nothing and an error", out, err)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("dial of a refused tunnel: %q, want it to say %q", err, w)
		}
	}
	t.Logf("dial: %v", err)
	if c, ok := stdin.(io.Closer); ok {
		c.Close()
	}
	ln.Close()
	if fds := kerneltest.OpenFDs(t); fds > fdsBefore {
		t.Fatalf("%d fds open after dial, %d before", fds, fdsBefore)
	}
}

// TestSandboxKeygenKeepsKeyID: keygen keeps the key ID with the private key,
// so sign needs no --key-id; a --key-id that matches is accepted, one that
// does not is an error naming both.
func TestSandboxKeygenKeepsKeyID(t *testing.T) {
	key, ring := keygenIn(t, t.TempDir(), "gw-1")
	data, err := os.ReadFile(key)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(data, []byte("Key-Id: gw-1\n-----BEGIN PRIVATE KEY-----\n")) {
		t.Fatalf("private key file does not start with its key ID:\n%s", data)
	}
	for _, args := range [][]string{nil, {"--key-id", "gw-1"}} {
		frame, err := runSandbox(t, nil, append([]string{"sign", "--key", key, "--sandbox", "sbx-1", "--target", "10.0.0.1:22"}, args...)...)
		if err != nil {
			t.Fatalf("sign %v: %v", args, err)
		}
		out, err := runSandbox(t, strings.NewReader(frame), "verify", "--keyring", ring)
		if err != nil || !strings.Contains(out, `"key_id": "gw-1"`) {
			t.Fatalf("sign %v, verify: %v\n%s", args, err, out)
		}
	}
	_, err = runSandbox(t, nil, "sign", "--key", key, "--key-id", "gw-2", "--sandbox", "sbx-1", "--target", "10.0.0.1:22")
	want := `--key-id "gw-2" does not match the key ID "gw-1" kept with the key in ` + key
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("sign with a mismatched --key-id: %v, want %q", err, want)
	}
	// dial checks the same before it connects anywhere.
	_, err = runSandbox(t, nil, "dial", "--addr", "127.0.0.1:1", "--cert", "c", "--key", "k", "--ca", "ca",
		"--signing-key", key, "--key-id", "gw-2", "--sandbox", "sbx-1", "--target", "10.0.0.1:22")
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("dial with a mismatched --key-id: %v, want %q", err, want)
	}
}

// TestSandboxKeygenPubOut: --pub-out never overwrites an existing file;
// --append adds to a keyring, refusing a duplicate key ID and a file that
// is no keyring.
func TestSandboxKeygenPubOut(t *testing.T) {
	dir := t.TempDir()
	ring := filepath.Join(dir, "gateways.pem")
	keyFile := func(name string) string { return filepath.Join(dir, name) }
	if _, err := runSandbox(t, nil, "keygen", "--key-out", keyFile("a.key"), "--pub-out", ring, "--key-id", "gw-a"); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(ring)
	if err != nil {
		t.Fatal(err)
	}
	expectErr := func(want string, args ...string) {
		t.Helper()
		_, err := runSandbox(t, nil, append([]string{"keygen"}, args...)...)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("keygen %v: %v, want an error saying %q", args, err, want)
		}
	}
	expectErr("--pub-out "+ring+" exists: keygen never overwrites a keyring; give --append to add the new public key to it, or remove the file first",
		"--key-out", keyFile("b.key"), "--pub-out", ring, "--key-id", "gw-b")
	if _, err := os.Stat(keyFile("b.key")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused keygen left a private key behind: %v", err)
	}
	expectErr(`already holds a key with ID "gw-a"`, "--key-out", keyFile("dup.key"), "--pub-out", ring, "--key-id", "gw-a", "--append")
	expectErr("not a keyring", "--key-out", keyFile("c.key"), "--pub-out", keyFile("a.key"), "--append")
	expectErr("--append adds to a keyring file", "--key-out", keyFile("d.key"), "--append")
	if after, _ := os.ReadFile(ring); !bytes.Equal(after, before) {
		t.Fatalf("refused keygens changed the keyring:\n%s", after)
	}

	if _, err := runSandbox(t, nil, "keygen", "--key-out", keyFile("b.key"), "--pub-out", ring, "--key-id", "gw-b", "--append"); err != nil {
		t.Fatal(err)
	}
	// --append to a missing keyring makes it.
	fresh := filepath.Join(dir, "fresh.pem")
	if _, err := runSandbox(t, nil, "keygen", "--key-out", keyFile("e.key"), "--pub-out", fresh, "--append"); err != nil {
		t.Fatal(err)
	}
	for file, ids := range map[string][]string{ring: {"gw-a", "gw-b"}, fresh: nil} {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		keys, err := preamble.ParseKeyring(data)
		if err != nil || (ids != nil && len(keys) != len(ids)) || (ids == nil && len(keys) != 1) {
			t.Fatalf("%s: %d keys, %v", file, len(keys), err)
		}
		for _, id := range ids {
			if keys[id] == nil {
				t.Errorf("%s lacks %s", file, id)
			}
		}
	}
	// The appended key signs preambles the keyring accepts.
	frame, err := runSandbox(t, nil, "sign", "--key", keyFile("b.key"), "--sandbox", "sbx-1", "--target", "10.0.0.1:22")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := runSandbox(t, strings.NewReader(frame), "verify", "--keyring", ring); err != nil || !strings.Contains(out, `"key_id": "gw-b"`) {
		t.Fatalf("verify: %v\n%s", err, out)
	}
}

// TestSandboxKeyFileMixups: a private key given as a keyring, and a keyring
// given as a private key, are errors that say exactly that.
func TestSandboxKeyFileMixups(t *testing.T) {
	key, ring := keygenIn(t, t.TempDir(), "gw-1")
	frame, err := runSandbox(t, nil, "sign", "--key", key, "--sandbox", "sbx-1", "--target", "10.0.0.1:22")
	if err != nil {
		t.Fatal(err)
	}
	_, err = runSandbox(t, strings.NewReader(frame), "verify", "--keyring", key)
	if want := "--keyring " + key + ": preamble: this is a private key (PEM PRIVATE KEY), not a keyring"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("verify --keyring <private key>: %v, want %q", err, want)
	}
	for _, args := range [][]string{
		{"sign", "--key", ring, "--sandbox", "sbx-1", "--target", "10.0.0.1:22"},
		{"dial", "--addr", "127.0.0.1:1", "--cert", "c", "--key", "k", "--ca", "ca", "--signing-key", ring, "--sandbox", "sbx-1", "--target", "10.0.0.1:22"},
	} {
		flag := "--key "
		if args[0] == "dial" {
			flag = "--signing-key "
		}
		_, err := runSandbox(t, nil, args...)
		if want := flag + ring + ": preamble: this is a keyring or public key (PEM PUBLIC KEY), not a private key"; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s with a keyring as its key: %v, want %q", args[0], err, want)
		}
	}
}

// TestSandboxHelpPointsToSpec: "caddy sandbox --help" and every
// subcommand's long help but certs' give the preamble specification's URL.
func TestSandboxHelpPointsToSpec(t *testing.T) {
	const url = "https://github.com/ktlsingress/caddy-ktls/blob/main/docs/preamble.md"
	c, ok := caddycmd.Commands()["sandbox"]
	if !ok {
		t.Fatal(`"sandbox" is not registered`)
	}
	if !strings.Contains(c.Long, url) {
		t.Errorf("caddy sandbox --help lacks %s:\n%s", url, c.Long)
	}
	for _, sub := range cli.SandboxSubcommands() {
		if sub.Name() == "certs" {
			continue // the TLS certificates, not the preamble: TestSandboxCertsHelp
		}
		if sub.Name() == "upgrade" {
			// Replacing the process, not the preamble: the upgrade's steps.
			const deploy = "https://github.com/ktlsingress/caddy-ktls/blob/main/docs/deploy.md#upgrading-without-dropping-a-tunnel"
			if !strings.Contains(sub.Long, deploy) {
				t.Errorf("caddy sandbox upgrade --help lacks %s", deploy)
			}
			continue
		}
		if !strings.Contains(sub.Long, url) {
			t.Errorf("caddy sandbox %s --help lacks %s", sub.Name(), url)
		}
	}
}

// TestSandboxDialEnd: a refusal before the first byte reads the same, and
// states itself once, whether the read or the upload met it.
func TestSandboxDialEnd(t *testing.T) {
	alert := &net.OpError{Op: "remote error", Err: tls.AlertError(ktls.AlertAccessDenied)}
	resetOn := func(op string) error {
		return &net.OpError{Op: op, Net: "tcp", Err: os.NewSyscallError(op, syscall.ECONNRESET)}
	}
	const (
		refusedMsg = `the forwarder refused the tunnel before its first byte (remote error: tls: access denied): nothing reached the target; its log ("sandbox tunnel rejected") and metrics name the reason`
		resetMsg   = "the forwarder reset the tunnel before its first byte (connection reset by peer): a refusal (a forwarder that cannot send the alert, such as one behind caddy-l4's tls handler, refuses this way) or a failure; its log names which"
	)
	for _, tc := range []struct {
		name       string
		received   int64
		rerr, werr error
		want       string
	}{
		{"refused-on-read", 0, alert, nil, refusedMsg},
		{"refused-on-read-upload-reset", 0, alert, resetOn("write"), refusedMsg},
		{"refused-on-write", 0, nil, alert, refusedMsg},
		{"reset-on-read", 0, resetOn("read"), nil, resetMsg},
		{"reset-on-read-upload-broken", 0, resetOn("read"), &net.OpError{Op: "write", Err: syscall.EPIPE}, resetMsg},
		{"reset-on-write", 0, nil, resetOn("write"), resetMsg},
		{"reset-after-bytes", 10, resetOn("read"), nil, "reading from the tunnel: read tcp: read: connection reset by peer"},
		{"upload-failed-after-bytes", 10, nil, resetOn("write"), "writing to the tunnel: write tcp: write: connection reset by peer"},
		{"clean", 0, nil, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := cli.DialEnd(tc.received, tc.rerr, tc.werr)
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tc.want {
				t.Fatalf("got  %q\nwant %q", got, tc.want)
			}
			if strings.Count(got, "refused") > 1 || strings.Count(got, "access denied") > 1 || strings.Count(got, "reset") > 2 {
				t.Errorf("the reason is stated more than once: %q", got)
			}
		})
	}
}

// TestSandboxDialRefusedWhileWriting is TestSandboxDialRefused with a
// client that is still writing when the refusal comes: the alert arrives
// all the same (the forwarder drains the upload), and a reset may meet the
// upload first, which dial reports as it does when the read meets it.
func TestSandboxDialRefusedWhileWriting(t *testing.T) {
	upload := func() io.Reader { return bytes.NewReader(bytes.Repeat([]byte("x"), 16<<20)) }
	for i := range 3 {
		t.Run(fmt.Sprint("refused ", i), func(t *testing.T) {
			sandboxDialRefusedStdin(t, false, upload(), (*ktls.Conn).Refuse,
				"the forwarder refused the tunnel before its first byte (remote error: tls: access denied)")
		})
	}
	for i := range 5 {
		t.Run(fmt.Sprint("reset ", i), func(t *testing.T) {
			sandboxDialRefusedStdin(t, false, upload(), (*ktls.Conn).Abort,
				"the forwarder reset the tunnel before its first byte (connection reset by peer): a refusal")
		})
	}
}

// TestKernelSandboxDialRefusedWhileWriting is TestSandboxDialRefusedWhileWriting
// against a forwarder on kernel TLS TX, whose refusal is the alert.
func TestKernelSandboxDialRefusedWhileWriting(t *testing.T) {
	kerneltest.Require(t)
	sandboxDialRefusedStdin(t, true, bytes.NewReader(bytes.Repeat([]byte("x"), 16<<20)), (*ktls.Conn).Refuse,
		"the forwarder refused the tunnel before its first byte (remote error: tls: access denied)")
}

// TestSandboxSignClientIdentity: sign --client-addr/--client-id writes the
// client identity extension (0x0010), which verify decodes; bad values are
// refused with what is wrong, before anything is signed.
func TestSandboxSignClientIdentity(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "gw.key")
	pubPEM, err := runSandbox(t, nil, "keygen", "--key-out", key, "--key-id", "gw-1")
	if err != nil {
		t.Fatal(err)
	}
	keyring := filepath.Join(dir, "keyring.pem")
	if err := os.WriteFile(keyring, []byte(pubPEM), 0o644); err != nil {
		t.Fatal(err)
	}
	hexFrame, err := runSandbox(t, nil, "sign", "--key", key, "--sandbox", "sbx-42", "--target", "10.9.8.7:80",
		"--client-addr", "192.0.2.7:50000", "--client-id", "alice@example.com")
	if err != nil {
		t.Fatal(err)
	}
	out, err := runSandbox(t, strings.NewReader(hexFrame), "verify", "--keyring", keyring)
	if err != nil {
		t.Fatal(err)
	}
	var got cli.VerifiedClaims
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatal(err)
	}
	if got.ClientAddr != "192.0.2.7:50000" || got.ClientID != "alice@example.com" ||
		len(got.Extensions) != 1 || got.Extensions[0] != "0x0010:04c0000207c350"+hex.EncodeToString([]byte("alice@example.com")) {
		t.Fatalf("verify printed %s", out)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--client-id", "alice"}, "--client-id needs --client-addr"},
		{[]string{"--client-addr", "user.example:5"}, `--client-addr "user.example:5": want an IP address and port`},
		{[]string{"--client-addr", "192.0.2.7:0"}, "--client-addr/--client-id: preamble rejected (bad-extension): client identity 0x0010: address: port 0"},
		{[]string{"--client-addr", "192.0.2.7:5", "--client-id", "a\nb"}, "control character U+000A"},
	} {
		args := append([]string{"sign", "--key", key, "--sandbox", "sbx-42", "--target", "10.9.8.7:80"}, tc.args...)
		if _, err := runSandbox(t, nil, args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
}
