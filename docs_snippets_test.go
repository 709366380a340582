package caddyktls

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// docSnippet is one ```caddyfile block of a Markdown file.
type docSnippet struct {
	where string // file:line of the opening fence
	body  string
}

// docSnippets returns every Caddyfile block in README.md and docs/.
func docSnippets(t *testing.T) []docSnippet {
	t.Helper()
	files := []string{"README.md"}
	err := filepath.WalkDir("docs", func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(path, ".md") {
			files = append(files, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []docSnippet
	for _, file := range files {
		f, err := os.Open(file)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		var cur *docSnippet
		for n := 1; sc.Scan(); n++ {
			line := sc.Text()
			switch {
			case cur == nil && line == "```caddyfile":
				cur = &docSnippet{where: fmt.Sprintf("%s:%d", file, n)}
			case cur != nil && line == "```":
				out = append(out, *cur)
				cur = nil
			case cur != nil:
				cur.body += line + "\n"
			}
		}
		f.Close()
		if cur != nil {
			t.Errorf("%s: the Caddyfile block never ends", cur.where)
		}
	}
	return out
}

// snippetFiles makes the files the snippets name under /etc/caddy, in dir:
// a gateway CA and the gateway certificates it issued (the allowlists), the
// gateways' signing keyring, the forwarder's and a server's certificates.
type snippetFiles struct {
	dir     string
	ca      *testpki.CA
	gateway *testpki.Leaf // /etc/caddy/gateway.pem, the allowlisted gateway
	signer  *forwardtest.Gateway
}

func newSnippetFiles(t *testing.T) *snippetFiles {
	t.Helper()
	s := &snippetFiles{dir: t.TempDir(), ca: testpki.NewCA(t, "gateway CA"), signer: forwardtest.NewGateway(t, "gw-1")}
	s.gateway = s.ca.Client(t, "gateway-1")
	write := func(name string, data []byte) {
		if err := os.WriteFile(filepath.Join(s.dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("gateway-ca.pem", s.ca.PEM)
	write("gateway.pem", s.gateway.CertPEM)
	write("gateway-1.pem", s.gateway.CertPEM)
	write("gateway-2.pem", s.ca.Client(t, "gateway-2").CertPEM)
	keyring, err := preamble.MarshalPublicKey("gw-1", s.signer.Pub)
	if err != nil {
		t.Fatal(err)
	}
	write("gateways.pem", keyring)
	for _, name := range []string{"forwarder", "server"} {
		leaf := s.ca.Server(t, "forwarder.internal")
		write(name+".pem", leaf.CertPEM)
		write(name+"-key.pem", leaf.KeyPEM)
	}
	return s
}

var etcCaddy = regexp.MustCompile(`/etc/caddy/[A-Za-z0-9._-]+`)

// local points the snippet's /etc/caddy files and its admin socket at dir;
// a file the snippets name that newSnippetFiles does not make fails t.
func (s *snippetFiles) local(t *testing.T, where, body string) string {
	t.Helper()
	body = etcCaddy.ReplaceAllStringFunc(body, func(p string) string {
		local := filepath.Join(s.dir, filepath.Base(p))
		if _, err := os.Stat(local); err != nil {
			t.Errorf("%s names %s, which this test does not make (newSnippetFiles)", where, p)
		}
		return local
	})
	return strings.ReplaceAll(body, "/run/caddy/admin.sock", filepath.Join(s.dir, "admin.sock"))
}

// Every Caddyfile snippet in README.md and docs/ is `caddy fmt`-clean,
// adapts, and validates (Caddy provisions every module it names) with the
// files it names made for it. README's forwarder runs: a gateway whose
// certificate is the allowlisted one dials it with mutual TLS and a signed,
// bound preamble, and the sandbox target gets the exact bytes.
func TestDocSnippets(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	files := newSnippetFiles(t)
	snippets := docSnippets(t)
	if len(snippets) < 5 {
		t.Fatalf("found %d Caddyfile snippets in README.md and docs/, want at least 5", len(snippets))
	}
	var forwarder *docSnippet
	for i, sn := range snippets {
		t.Run(sn.where, func(t *testing.T) {
			if got := string(caddyfile.Format([]byte(sn.body))); got != sn.body {
				t.Errorf("%s is not `caddy fmt`-clean; formatted:\n%s", sn.where, got)
			}
			raw, err := adaptCaddyfile(t, files.local(t, sn.where, sn.body))
			if err != nil {
				t.Fatalf("%s does not adapt: %v", sn.where, err)
			}
			if err := caddy.Validate(mustConfig(t, raw)); err != nil {
				t.Errorf("%s does not validate: %v", sn.where, err)
			}
		})
		if strings.HasPrefix(sn.where, "README.md:") && strings.Contains(sn.body, "sandbox {") && forwarder == nil {
			forwarder = &snippets[i]
		}
	}
	if forwarder == nil {
		t.Fatal("README.md has no forwarder snippet (a Caddyfile block with a sandbox handler)")
	}
	runReadmeForwarder(t, files, forwarder)
}

func mustConfig(t *testing.T, raw []byte) *caddy.Config {
	t.Helper()
	var cfg caddy.Config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	return &cfg
}

// runReadmeForwarder runs README's forwarder with its listeners on free
// loopback ports and its sandbox network (10.0.0.0/8) replaced by
// loopback, and carries one tunnel to a target on a port it allows.
func runReadmeForwarder(t *testing.T, files *snippetFiles, sn *docSnippet) {
	t.Helper()
	listen, site := loopbackAddr(t), loopbackAddr(t)
	_, sitePort, _ := net.SplitHostPort(site)
	body := files.local(t, sn.where, sn.body)
	// The site that loads the certificate moves to a free port too.
	body = strings.ReplaceAll(body, "https://forwarder.internal:9444 {", "https://forwarder.internal:"+sitePort+" {")
	for old, repl := range map[string]string{
		"tcp-retry/:9443":  "tcp-retry/" + listen,
		"allow 10.0.0.0/8": "allow 127.0.0.0/8",
	} {
		if !strings.Contains(body, old) {
			t.Fatalf("%s: no %q to substitute: update runReadmeForwarder with the snippet", sn.where, old)
		}
		body = strings.ReplaceAll(body, old, repl)
	}
	raw, err := adaptCaddyfile(t, body)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["admin"] = map[string]any{"disabled": true}
	run, _ := json.Marshal(cfg)
	if err := caddy.Load(run, true); err != nil {
		t.Fatalf("%s does not run: %v", sn.where, err)
	}
	t.Cleanup(func() { caddy.Load([]byte(unloadConfig), true) })

	// A target on a port the snippet allows (allow_ports 8000-8999).
	var up *forwardtest.Upstream
	for port := 8000; port < 9000 && up == nil; port++ {
		if ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
			ln.Close()
			up = forwardtest.NewUpstreamOn(t, ln.Addr().String(), 4096+3)
		}
	}
	if up == nil {
		t.Fatal("no free port in 8000-8999 for the target")
	}
	tlsCfg := (&sandboxEnv{ca: files.ca}).tlsConfig(files.gateway)
	tlsCfg.ServerName = "forwarder.internal"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := preamble.Dial(ctx, "tcp", listen, tlsCfg, files.signer.Signer, preamble.Claims{SandboxID: "sbx-readme", Target: netip.MustParseAddrPort(up.Addr().String())})
	if err != nil {
		t.Fatalf("dial README's forwarder: %v", err)
	}
	n, sum, err := transfer(c, 4096, 77)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	checkTunnelTransfer(t, up, 4096, 77, n, sum)
	t.Logf("%s ran and carried a tunnel: %d bytes up, %d down", sn.where, 4096, n)
}
