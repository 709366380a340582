package caddyktls

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// examplePKI is what README's certificate section makes with the real
// binary: one CA, the forwarder's certificate for forwarder.internal, the
// gateway's client certificate, the users' certificate for the gateway's
// sites, and the gateway's signing key with its keyring; ca.pem is also
// installed under the names README's snippets read it by.
func examplePKI(t *testing.T, caddyBin string) string {
	t.Helper()
	dir := t.TempDir()
	for _, args := range [][]string{
		{"sandbox", "certs", "ca", "--dir", dir},
		{"sandbox", "certs", "forwarder", "--dir", dir, "--san", "forwarder.internal"},
		{"sandbox", "certs", "gateway", "--dir", dir, "--cn", "gateway-1"},
		{"sandbox", "certs", "forwarder", "--dir", dir, "--name", "site", "--san", "*.sandbox.test"},
		{"sandbox", "keygen", "--key-out", filepath.Join(dir, "gateway-signing.pem"), "--pub-out", filepath.Join(dir, "gateways.pem"), "--key-id", "gw-1"},
	} {
		if out, err := exec.Command(caddyBin, args...).CombinedOutput(); err != nil {
			t.Fatalf("caddy %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	ca, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"gateway-ca.pem", "forwarders-ca.pem"} {
		if err := os.WriteFile(filepath.Join(dir, name), ca, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// portIn returns a free loopback port in [lo, hi] that no earlier call
// returned.
func portIn(t *testing.T, lo, hi int, taken map[int]bool) int {
	t.Helper()
	for p := lo; p <= hi; p++ {
		if taken[p] {
			continue
		}
		if ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p)); err == nil {
			ln.Close()
			taken[p] = true
			return p
		}
	}
	t.Fatalf("no free port in %d-%d", lo, hi)
	return 0
}

// http1App serves HTTP/1.1 only (as most apps do): GET /hello names the
// Host and protocol it was reached with, POST /echo answers the body.
func http1App(t *testing.T, addr string) {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s over %s", r.Host, r.Proto)
	})
	mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(w, r.Body)
	})
	srv := &http.Server{Handler: mux, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
}

// echoServer echoes every byte back and half-closes after the client does.
func echoServer(t *testing.T, addr string) {
	forwardtest.ServeTCPOn(t, addr, func(c net.Conn) {
		defer c.Close()
		io.Copy(c, c)
		c.(*net.TCPConn).CloseWrite()
	})
}

// listeningSockets lists the sockets the process pid listens on: "tcp
// ip:port" for each TCP socket in LISTEN, "udp ip:port" for each UDP
// socket, from /proc/net and the process's descriptors.
func listeningSockets(t *testing.T, pid int) []string {
	t.Helper()
	inodes := map[string]bool{}
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(target, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(target, "socket:["), "]")] = true
		}
	}
	var out []string
	for _, table := range []string{"tcp", "tcp6", "udp", "udp6"} {
		f, err := os.Open(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		sc.Scan() // the header
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) < 10 || !inodes[fields[9]] {
				continue
			}
			proto := strings.TrimSuffix(table, "6")
			if proto == "tcp" && fields[3] != "0A" { // TCP_LISTEN
				continue
			}
			out = append(out, proto+" "+forwardtest.ProcNetAddr(t, fields[1]))
		}
		f.Close()
	}
	slices.Sort(out)
	return out
}

// exampleForwarder is a forwarder under test: how to start it and what it
// must listen on.
type exampleForwarder struct {
	name string
	// start runs it with its gateway port at listen (127.0.0.1) and its
	// admin API at admin, the sandboxes at 127.0.0.1 on ports lo-hi; it
	// returns the sockets it must listen on, and no other.
	start func(t *testing.T, caddyBin, dir, listen, admin string, lo, hi int) (*caddyProcess, []string)
}

// readmeForwarder runs README's forwarder snippet (the Caddyfile the user
// copies) with its /etc/caddy files in dir, its ports on loopback, its
// sandbox network (10.0.0.0/8) replaced by loopback and an admin address.
func readmeForwarder(t *testing.T, caddyBin, dir, listen, admin string, lo, hi int) (*caddyProcess, []string) {
	t.Helper()
	var body string
	for _, sn := range docSnippets(t) {
		if sn.run == "forwarder" && strings.HasPrefix(sn.where, "README.md:") {
			body = sn.body
		}
	}
	if body == "" {
		t.Fatal("README.md has no forwarder snippet (<!-- snippet: run forwarder -->)")
	}
	site := loopbackAddr(t)
	_, sitePort, _ := net.SplitHostPort(site)
	for old, repl := range map[string]string{
		"/etc/caddy/":     dir + "/",
		"tcp-retry/:9443": "tcp-retry/" + listen,
		"10.0.0.0/8":      "127.0.0.1",
		"8000-8999":       fmt.Sprintf("%d-%d", lo, hi),
		":9444 {":         ":" + sitePort + " {",
	} {
		if !strings.Contains(body, old) {
			t.Fatalf("README's forwarder snippet has no %q to substitute: update this test with the snippet", old)
		}
		body = strings.ReplaceAll(body, old, repl)
	}
	if !strings.HasPrefix(body, "{\n") {
		t.Fatal("README's forwarder snippet starts with no global options block: update this test with the snippet")
	}
	body = "{\n\tadmin " + admin + "\n" + body[2:]
	file := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(file, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	p := runCaddy(t, examplePrelude(t, nil), listen, "", "--adapter", "caddyfile", "--config", file)
	return p, []string{"tcp " + admin, "tcp " + listen, "tcp " + site}
}

// examplePrelude exports env, and XDG directories of the test's own, for
// a Caddy process.
func examplePrelude(t *testing.T, env map[string]string) string {
	t.Helper()
	var b strings.Builder
	xdg := t.TempDir()
	fmt.Fprintf(&b, "export XDG_DATA_HOME=%s/data XDG_CONFIG_HOME=%s/config\n", xdg, xdg)
	for k, v := range env {
		fmt.Fprintf(&b, "export %s='%s'\n", k, v)
	}
	return b.String()
}

// TestExamples runs what a user copies, as written, with the certificates
// `caddy sandbox certs` makes: examples/gateway.Caddyfile in front of
// README's forwarder snippet, examples/forwarder.Caddyfile and
// examples/http-forwarder.Caddyfile, each with its environment variables
// (listed at the top of each file) and nothing else, to a sandbox app that
// speaks HTTP/1.1 only and a raw TCP echo service: HTTP/1.1 and HTTP/2
// requests, a 1 MiB upload and a raw TCP tunnel, every byte checked by
// SHA-256, and the forwarder's activity names the sandbox. Each forwarder
// listens on exactly its gateway port, its loopback site and its admin
// API: no HTTP->HTTPS redirect server, no HTTP/3 socket.
func TestExamples(t *testing.T) {
	caddyBin := builtCaddy(t)
	dir := examplePKI(t, caddyBin)
	taken := map[int]bool{}
	lo := portIn(t, 8000, 8999, taken)
	hi := portIn(t, lo+1, 8999, taken)
	appAddr := fmt.Sprintf("127.0.0.1:%d", lo)
	echoAddr := fmt.Sprintf("127.0.0.1:%d", hi)
	http1App(t, appAddr)
	echoServer(t, echoAddr)
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)

	forwarders := []exampleForwarder{
		{"README", readmeForwarder},
		{"examples/forwarder.Caddyfile", func(t *testing.T, caddyBin, dir, listen, admin string, lo, hi int) (*caddyProcess, []string) {
			site := loopbackAddr(t)
			_, sitePort, _ := net.SplitHostPort(site)
			p := runCaddy(t, examplePrelude(t, map[string]string{"FWD_DIR": dir, "FWD_LISTEN": listen, "FWD_SITE_PORT": sitePort,
				"FWD_ADMIN": admin, "FWD_ALLOW": "127.0.0.1", "FWD_ALLOW_PORTS": fmt.Sprintf("%d-%d", lo, hi)}),
				listen, "", "--adapter", "caddyfile", "--config", "examples/forwarder.Caddyfile")
			return p, []string{"tcp " + admin, "tcp " + listen, "tcp " + site}
		}},
		{"examples/http-forwarder.Caddyfile", func(t *testing.T, caddyBin, dir, listen, admin string, lo, hi int) (*caddyProcess, []string) {
			_, port, _ := net.SplitHostPort(listen)
			p := runCaddy(t, examplePrelude(t, map[string]string{"FWD_DIR": dir, "FWD_PORT": port,
				"FWD_ADMIN": admin, "FWD_ALLOW": "127.0.0.1", "FWD_ALLOW_PORTS": fmt.Sprintf("%d-%d", lo, hi)}),
				listen, "", "--adapter", "caddyfile", "--config", "examples/http-forwarder.Caddyfile")
			// It listens on every address (":PORT"), as written.
			return p, []string{"tcp " + admin, "tcp [::]:" + port}
		}},
	}
	for _, fwd := range forwarders {
		t.Run(fwd.name, func(t *testing.T) {
			listen, admin := loopbackAddr(t), loopbackAddr(t)
			p, sockets := fwd.start(t, caddyBin, dir, listen, admin, lo, hi)
			slices.Sort(sockets)
			var got []string
			// The admin API and the site come up after the gateway port
			// (a liveness bound for a loaded machine).
			waitUntil(t, 2*time.Minute, func() bool {
				got = listeningSockets(t, p.cmd.Process.Pid)
				return len(got) >= len(sockets) && connectable(admin)
			}, "the forwarder's listeners")
			if !slices.Equal(got, sockets) {
				t.Errorf("%s listens on %q, want exactly %q", fwd.name, got, sockets)
			}

			https, tcp, gwAdmin := loopbackAddr(t), loopbackAddr(t), loopbackAddr(t)
			_, httpsPort, _ := net.SplitHostPort(https)
			runCaddy(t, examplePrelude(t, map[string]string{"GW_DIR": dir, "GW_FORWARDER": listen,
				"GW_APP_TARGET": appAddr, "GW_TCP_TARGET": echoAddr, "GW_HTTPS_PORT": httpsPort, "GW_TCP": tcp, "GW_ADMIN": gwAdmin}),
				https, "", "--adapter", "caddyfile", "--config", "examples/gateway.Caddyfile")

			host := "sbx-1.sandbox.test:" + httpsPort
			for _, h2 := range []bool{false, true} {
				tr := &http.Transport{
					TLSClientConfig: &tls.Config{RootCAs: roots},
					DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
						return (&net.Dialer{}).DialContext(ctx, network, https)
					},
					ForceAttemptHTTP2: h2,
				}
				if !h2 {
					tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
				}
				client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
				res, err := client.Get("https://" + host + "/hello")
				if err != nil {
					t.Fatalf("GET through the gateway (HTTP/2 %v): %v", h2, err)
				}
				body, _ := io.ReadAll(res.Body)
				res.Body.Close()
				if want := "hello from " + host + " over HTTP/1.1"; res.StatusCode != 200 || string(body) != want {
					t.Errorf("GET through the gateway over %s: %s %q, want 200 %q", res.Proto, res.Status, body, want)
				}
				if wantMajor := map[bool]int{false: 1, true: 2}[h2]; res.ProtoMajor != wantMajor {
					t.Errorf("the user's request went over %s, want HTTP/%d", res.Proto, wantMajor)
				}
				if h2 {
					up := make([]byte, 1<<20)
					rand.Read(up)
					res, err := client.Post("https://"+host+"/echo", "application/octet-stream", bytes.NewReader(up))
					if err != nil {
						t.Fatalf("POST through the gateway: %v", err)
					}
					back, err := io.ReadAll(res.Body)
					res.Body.Close()
					if err != nil || res.StatusCode != 200 || sha256.Sum256(back) != sha256.Sum256(up) {
						t.Errorf("POST of 1 MiB through the gateway: %s, %d bytes back (%v), SHA-256 equal %v", res.Status, len(back), err, sha256.Sum256(back) == sha256.Sum256(up))
					}
				}
				client.CloseIdleConnections()
			}

			// Raw TCP, routed by the server name.
			c, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", tcp, &tls.Config{RootCAs: roots, ServerName: "sbx-2.sandbox.test"})
			if err != nil {
				t.Fatalf("raw TCP to the gateway: %v", err)
			}
			c.SetDeadline(time.Now().Add(30 * time.Second))
			up := make([]byte, 256<<10)
			rand.Read(up)
			go func() {
				c.Write(up)
				c.CloseWrite()
			}()
			back, err := io.ReadAll(c)
			c.Close()
			if err != nil || sha256.Sum256(back) != sha256.Sum256(up) {
				t.Errorf("raw TCP echo through the gateway: %d of %d bytes back (%v), SHA-256 equal %v", len(back), len(up), err, sha256.Sum256(back) == sha256.Sum256(up))
			}

			// The forwarder carried both sandboxes' tunnels.
			var activity struct {
				Sandboxes []struct {
					Sandbox         string `json:"sandbox"`
					BytesToSandbox  int64  `json:"bytes_to_sandbox"`
					BytesFromSandbx int64  `json:"bytes_from_sandbox"`
				} `json:"sandboxes"`
			}
			waitUntil(t, 10*time.Second, func() bool {
				activity.Sandboxes = nil
				json.Unmarshal(adminGet(t, admin, "/sandbox/activity"), &activity)
				return len(activity.Sandboxes) == 2
			}, "both sandboxes in the forwarder's activity")
			for _, s := range activity.Sandboxes {
				if s.Sandbox == "sbx-2" && (s.BytesToSandbox != int64(len(up)) || s.BytesFromSandbx != int64(len(up))) {
					t.Errorf("sandbox sbx-2 moved %d bytes in and %d out, want %d each", s.BytesToSandbox, s.BytesFromSandbx, len(up))
				}
				if s.Sandbox != "sbx-1" && s.Sandbox != "sbx-2" {
					t.Errorf("the forwarder's activity names sandbox %q", s.Sandbox)
				}
			}
		})
	}
}

// TestExampleHTTPKTLS runs examples/http-ktls.Caddyfile as README's
// listener-wrapper snippet runs: its site on a free loopback port with a
// certificate of the test CA instead of ACME's, its root a directory with
// one file, which it serves through the ktls listener wrapper.
func TestExampleHTTPKTLS(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	raw, err := os.ReadFile("examples/http-ktls.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := adaptCaddyfile(t, string(raw))
	if err != nil {
		t.Fatalf("examples/http-ktls.Caddyfile does not adapt: %v", err)
	}
	runListenerWrapperSnippet(t, newSnippetFiles(t), "examples/http-ktls.Caddyfile", cfg)
}
