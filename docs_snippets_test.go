package caddyktls

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// docSnippet is one ```caddyfile or ```json block of a Markdown file.
type docSnippet struct {
	where string // file:line of the opening fence
	lang  string // caddyfile or json
	body  string
	// run names the runner (snippetRunners) of a snippet marked
	// `<!-- snippet: run NAME -->` on the line before its fence.
	run string
}

// snippetMarker marks the snippet after it as one a test runs.
var snippetMarker = regexp.MustCompile(`^<!-- snippet: run ([a-z-]+) -->$`)

// docSnippets returns every Caddyfile and JSON block in README.md and docs/.
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
		run, prev := "", ""
		for n := 1; sc.Scan(); n++ {
			line := sc.Text()
			switch {
			case cur == nil && (line == "```caddyfile" || line == "```json"):
				cur = &docSnippet{where: fmt.Sprintf("%s:%d", file, n), lang: strings.TrimPrefix(line, "```"), run: run}
			case cur == nil && snippetMarker.MatchString(prev):
				t.Errorf("%s:%d: %q is not followed by a ```caddyfile or ```json block", file, n-1, prev)
			case cur != nil && line == "```":
				out = append(out, *cur)
				cur = nil
			case cur != nil:
				cur.body += line + "\n"
			}
			run = ""
			if m := snippetMarker.FindStringSubmatch(line); m != nil {
				run = m[1]
			}
			prev = line
		}
		f.Close()
		if cur != nil {
			t.Errorf("%s: the %s block never ends", cur.where, cur.lang)
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
	// The edge gateway's side: its client key, the forwarders' CA, its
	// preamble signing key.
	write("gateway-key.pem", s.gateway.KeyPEM)
	write("forwarders-ca.pem", s.ca.PEM)
	// The CA of the users' client certificates, whose subject an HTTP
	// gateway signs as the client's identity.
	write("users-ca.pem", s.ca.PEM)
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	signing, err := preamble.MarshalSigningKey("gw-edge", priv)
	if err != nil {
		t.Fatal(err)
	}
	write("gateway-signing.pem", signing)
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

// snippetRunners run the snippets marked `<!-- snippet: run NAME -->`:
// each gets the snippet's configuration as JSON, its /etc/caddy files made
// and substituted, and runs it with its listeners on free loopback ports.
var snippetRunners = map[string]func(t *testing.T, files *snippetFiles, where string, cfg []byte){
	"forwarder":        runForwarderSnippet,
	"listener-wrapper": runListenerWrapperSnippet,
}

// Every Caddyfile snippet in README.md and docs/ is `caddy fmt`-clean,
// adapts, and validates (Caddy provisions every module it names) with the
// files it names made for it; every JSON snippet that is a Caddy
// configuration (it has "apps") loads as one and validates. The snippets
// marked to run run (snippetRunners): at least README's forwarder, which
// carries a tunnel, and its listener wrapper, which serves a file.
func TestDocSnippets(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	files := newSnippetFiles(t)
	snippets := docSnippets(t)
	if len(snippets) < 5 {
		t.Fatalf("found %d Caddyfile and JSON snippets in README.md and docs/, want at least 5", len(snippets))
	}
	ran := map[string]bool{}
	configs := map[string]int{}
	for _, sn := range snippets {
		t.Run(sn.where, func(t *testing.T) {
			var raw []byte
			switch sn.lang {
			case "caddyfile":
				if got := string(caddyfile.Format([]byte(sn.body))); got != sn.body {
					t.Errorf("%s is not `caddy fmt`-clean; formatted:\n%s", sn.where, got)
				}
				var err error
				raw, err = adaptCaddyfile(t, files.local(t, sn.where, sn.body))
				if err != nil {
					t.Fatalf("%s does not adapt: %v", sn.where, err)
				}
			case "json":
				if !strings.Contains(sn.body, `"apps"`) {
					if sn.run != "" {
						t.Fatalf("%s is marked to run but is no Caddy configuration (no \"apps\")", sn.where)
					}
					return // a request or report body, not a configuration
				}
				raw = []byte(files.local(t, sn.where, sn.body))
			}
			configs[sn.lang]++
			cfg := mustConfig(t, raw)
			if err := caddy.Validate(cfg); err != nil {
				t.Fatalf("%s does not validate: %v", sn.where, err)
			}
			if sn.run == "" {
				return
			}
			run := snippetRunners[sn.run]
			if run == nil {
				t.Fatalf("%s is marked `snippet: run %s`, which no runner in snippetRunners runs", sn.where, sn.run)
			}
			if strings.HasPrefix(sn.where, "README.md:") {
				ran[sn.run] = true
			}
			run(t, files, sn.where, raw)
		})
	}
	if configs["json"] == 0 {
		t.Error("no JSON snippet with \"apps\" in README.md and docs/: the JSON check has nothing to check")
	}
	for name := range snippetRunners {
		if !ran[name] {
			t.Errorf("README.md has no snippet marked `<!-- snippet: run %s -->`", name)
		}
	}
}

// mustConfig decodes raw as a Caddy configuration, refusing unknown fields
// at its top level (a misspelled "apps" would otherwise load as nothing).
func mustConfig(t *testing.T, raw []byte) *caddy.Config {
	t.Helper()
	var cfg caddy.Config
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cfg); err != nil {
		t.Fatalf("not a Caddy configuration: %v", err)
	}
	return &cfg
}

// substituteJSON replaces in cfg, a snippet's JSON configuration, each
// required string (the snippet must hold it: otherwise the runner no
// longer matches the snippet) and each optional one it holds.
func substituteJSON(t *testing.T, where string, cfg []byte, required, optional map[string]string) []byte {
	t.Helper()
	s := string(cfg)
	for old, repl := range required {
		if !strings.Contains(s, old) {
			t.Fatalf("%s: no %s to substitute: update the runner with the snippet", where, old)
		}
		s = strings.ReplaceAll(s, old, repl)
	}
	for old, repl := range optional {
		s = strings.ReplaceAll(s, old, repl)
	}
	return []byte(s)
}

// loadSnippet runs cfg with the admin API off until the test ends.
func loadSnippet(t *testing.T, where string, cfg []byte, edit func(map[string]any)) {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(cfg, &m); err != nil {
		t.Fatal(err)
	}
	m["admin"] = map[string]any{"disabled": true}
	if edit != nil {
		edit(m)
	}
	run, _ := json.Marshal(m)
	if err := caddy.Load(run, true); err != nil {
		t.Fatalf("%s does not run: %v", where, err)
	}
	t.Cleanup(func() { caddy.Load([]byte(unloadConfig), true) })
}

// runForwarderSnippet runs a forwarder snippet (README's Caddyfile, the
// JSON one of docs/configuration.md) with its listeners on free loopback
// ports and its sandbox network (10.0.0.0/8) replaced by loopback, and
// carries one tunnel to a target on a port it allows.
func runForwarderSnippet(t *testing.T, files *snippetFiles, where string, cfg []byte) {
	t.Helper()
	listen, site := loopbackAddr(t), loopbackAddr(t)
	_, sitePort, _ := net.SplitHostPort(site)
	cfg = substituteJSON(t, where, cfg,
		map[string]string{`"tcp-retry/:9443"`: `"tcp-retry/` + listen + `"`, `"10.0.0.0/8"`: `"127.0.0.0/8"`},
		// The site that loads the certificate, where there is one.
		map[string]string{`:9444"`: ":" + sitePort + `"`})
	loadSnippet(t, where, cfg, nil)

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
	c, err := gatewayDial(ctx, listen, tlsCfg, files.signer.Signer, "sbx-readme", netip.MustParseAddrPort(up.Addr().String()))
	if err != nil {
		t.Fatalf("dial %s's forwarder: %v", where, err)
	}
	n, sum, err := transfer(c, 4096, 77)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	checkTunnelTransfer(t, up, 4096, 77, n, sum)
	t.Logf("%s ran and carried a tunnel: %d bytes up, %d down", where, 4096, n)
}

// runListenerWrapperSnippet runs README's listener wrapper: its site
// (example.com) on a free loopback port with a certificate of the test CA
// instead of ACME's, its root a directory with one file, and fetches the
// file over HTTPS through the wrapper.
func runListenerWrapperSnippet(t *testing.T, files *snippetFiles, where string, cfg []byte) {
	t.Helper()
	addr := loopbackAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	root := t.TempDir()
	body := []byte("served through the ktls listener wrapper\n")
	if err := os.WriteFile(filepath.Join(root, "hello.txt"), body, 0o644); err != nil {
		t.Fatal(err)
	}
	rootJSON, _ := json.Marshal(root)
	cfg = substituteJSON(t, where, cfg, map[string]string{
		`"example.com"`:          `"forwarder.internal"`,
		`":443"`:                 `"` + addr + `"`,
		`"/var/www/example.com"`: string(rootJSON),
	}, nil)
	loadSnippet(t, where, cfg, func(m map[string]any) {
		apps := m["apps"].(map[string]any)
		// No ACME: the site's certificate is the test CA's, and the
		// HTTP->HTTPS redirect listens on another free port, not :80.
		apps["tls"] = map[string]any{"certificates": map[string]any{"load_files": []any{map[string]any{
			"certificate": filepath.Join(files.dir, "server.pem"), "key": filepath.Join(files.dir, "server-key.pem"),
		}}}}
		_, redirect, _ := net.SplitHostPort(loopbackAddr(t))
		p, _ := strconv.Atoi(port)
		r, _ := strconv.Atoi(redirect)
		apps["http"].(map[string]any)["https_port"] = p
		apps["http"].(map[string]any)["http_port"] = r
	})

	// The listener wrapper's completed handshakes, offloaded or not.
	wrapped := func() (n uint64) {
		for k, v := range offload.HandshakeOutcomeCounts() {
			if k.Module == moduleid.ListenerWrapper && k.Reason != ktls.ReasonHandshakeFailed {
				n += v
			}
		}
		return n
	}
	before := wrapped()
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		ForceAttemptHTTP2: true,
		TLSClientConfig:   &tls.Config{RootCAs: files.ca.Pool, ServerName: "forwarder.internal"},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}}
	defer client.CloseIdleConnections()
	res, err := client.Get("https://forwarder.internal:" + port + "/hello.txt")
	if err != nil {
		t.Fatalf("GET through %s's listener wrapper: %v", where, err)
	}
	got, err := io.ReadAll(res.Body)
	res.Body.Close()
	if err != nil || res.StatusCode != http.StatusOK || !bytes.Equal(got, body) {
		t.Fatalf("GET through %s's listener wrapper: %s %q, %v; want 200 %q", where, res.Status, got, err, body)
	}
	if wrapped() == before {
		t.Errorf("%s served the file, but no handshake of the ktls listener wrapper was counted", where)
	}
	t.Logf("%s ran and served %d bytes over %s through the ktls listener wrapper", where, len(got), res.Proto)
}
