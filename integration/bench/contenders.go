package main

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"text/template"
)

// contender is one forwarder under test. Each terminates the gateway's TLS
// 1.3 (except floor-plain) and forwards plaintext to the same upstream.
type contender struct {
	name string
	// dialKind says how the gateway reaches it: "preamble" (TLS + signed
	// preamble), "tls", "https" (HTTP/1.1 over TLS) or "plain" (TCP).
	dialKind string
	// kernelTX, kernelRX: where its records must be sealed and opened,
	// checked against /proc/net/tls_stat (TlsTxSw/TlsRxSw count the sockets
	// that installed a kernel key).
	kernelTX, kernelRX bool
	// peer: one of the userspace peers the goals compare with (-peers-mtls
	// gives them client authentication).
	peer bool
	// zeroCopy: its forwarder moves no payload byte through userspace (it
	// splices both ways): in the traced pass, the bytes it reads or writes
	// on a socket after installing kernel keys there, or on one without
	// any, are at most its preambles and TLS alerts (zeroCopyError).
	zeroCopy bool
	// command writes the contender's configuration into env.dir and returns
	// the process to start; it must listen on env.listen.
	command func(env *runEnv) (*exec.Cmd, error)
}

// runEnv is what a contender's configuration refers to.
type runEnv struct {
	dir, caddy, self, listen string
	up                       *upstream
	pki                      *pki
	// countRequired: the VM's kernel (Debian's) has the syscall tracepoint,
	// so there a structural pass without its untraced count is a failure;
	// natively the host's kernel may lack it, and the count is left out.
	countRequired bool
	// gatewayKTLS: the gateway seals its records in its kernel (-gateway-ktls).
	gatewayKTLS bool
	// peersMTLS: the TLS peers verify the gateway's client certificate too
	// (-peers-mtls).
	peersMTLS bool
	// adminSock: with -pprof, the unix socket of a Caddy contender's admin
	// endpoint (its Go profiler); otherwise the admin endpoint is off.
	adminSock string
}

var contenders = []contender{
	{name: "ktls", dialKind: "preamble", kernelTX: true, kernelRX: true, zeroCopy: true, command: caddySandbox(nil)},
	{name: "ktls-rx-off", dialKind: "preamble", kernelTX: true, command: caddySandbox(map[string]any{"disable_rx": true})},
	{name: "ktls-off", dialKind: "preamble", command: caddySandbox(map[string]any{"disable_offload": true})},
	{name: "l4-proxy", dialKind: "tls", peer: true, command: caddyL4Proxy},
	{name: "reverse-proxy", dialKind: "https", peer: true, command: caddyReverseProxy},
	{name: "haproxy", dialKind: "tls", peer: true, command: haproxy},
	{name: "nginx", dialKind: "tls", peer: true, command: nginx},
	{name: "floor-ktls", dialKind: "tls", kernelTX: true, kernelRX: true, zeroCopy: true, command: floor("floor-ktls")},
	{name: "floor-plain", dialKind: "plain", zeroCopy: true, command: floor("floor-plain")},
	{name: "floor-rw-ktls", dialKind: "tls", kernelTX: true, kernelRX: true, command: floor("floor-rw-ktls")},
	{name: "floor-rw-plain", dialKind: "plain", command: floor("floor-rw-plain")},
}

func contenderNames() []string {
	var names []string
	for _, c := range contenders {
		names = append(names, c.name)
	}
	return names
}

// zeroCopyNames are the contenders whose forwarder claims zero copy.
func zeroCopyNames() []string {
	var names []string
	for _, c := range contenders {
		if c.zeroCopy {
			names = append(names, c.name)
		}
	}
	return names
}

func findContender(name string) (contender, bool) {
	for _, c := range contenders {
		if c.name == name {
			return c, true
		}
	}
	return contender{}, false
}

// caddyBase is the part every Caddy contender shares: no admin endpoint
// (but a unix socket with -pprof), no per-connection logging (HAProxy and nginx log nothing either), the server
// certificate loaded from files, storage in the run directory.
func caddyBase(env *runEnv, apps map[string]any) map[string]any {
	apps["tls"] = map[string]any{"certificates": map[string]any{
		"load_files": []any{map[string]any{"certificate": env.pki.certFile, "key": env.pki.keyFile}},
	}}
	admin := map[string]any{"disabled": true}
	if env.adminSock != "" {
		admin = map[string]any{"listen": "unix/" + env.adminSock}
	}
	return map[string]any{
		"admin":   admin,
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "ERROR"}}},
		"storage": map[string]any{"module": "file_system", "root": filepath.Join(env.dir, "caddy-storage")},
		"apps":    apps,
	}
}

func caddyCommand(env *runEnv, name string, cfg map[string]any) (*exec.Cmd, error) {
	data, err := json.MarshalIndent(cfg, "", "\t")
	if err != nil {
		return nil, err
	}
	file := filepath.Join(env.dir, name+".json")
	if err := os.WriteFile(file, data, 0o644); err != nil {
		return nil, err
	}
	cmd := exec.Command(env.caddy, "run", "--config", file)
	cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+filepath.Join(env.dir, "xdg-data"), "XDG_CONFIG_HOME="+filepath.Join(env.dir, "xdg-config"))
	return cmd, nil
}

func layer4(env *runEnv, handlers ...any) map[string]any {
	return map[string]any{"layer4": map[string]any{"servers": map[string]any{"bench": map[string]any{
		"listen": []string{env.listen},
		"routes": []any{map[string]any{"handle": handlers}},
	}}}}
}

// caddySandbox is this project's forwarder: layer4 ktls (mutual TLS: the
// sandbox handler carries no tunnel for a client it did not verify) +
// sandbox, with the given offload options on the ktls handler. The loopback
// upstream must be allowed explicitly.
func caddySandbox(offload map[string]any) func(*runEnv) (*exec.Cmd, error) {
	return func(env *runEnv) (*exec.Cmd, error) {
		ktlsHandler := map[string]any{"handler": "ktls", "connection_policies": []any{map[string]any{
			"client_authentication": map[string]any{"mode": "require_and_verify", "trusted_ca_certs": []string{env.pki.caDER}},
		}}}
		for k, v := range offload {
			ktlsHandler[k] = v
		}
		sandbox := map[string]any{
			"handler":                 "sandbox",
			"keys":                    []any{map[string]any{"id": env.pki.signer.KeyID(), "public_key": env.pki.signingPub}},
			"require_channel_binding": true,
			"allow_cidrs":             []string{"127.0.0.1"},
		}
		return caddyCommand(env, "caddy-sandbox", caddyBase(env, layer4(env, ktlsHandler, sandbox)))
	}
}

// clientAuth is a Caddy connection policy's client authentication as the
// ktls contenders have it, for the peers with -peers-mtls (else nil).
func clientAuth(env *runEnv) map[string]any {
	if !env.peersMTLS {
		return nil
	}
	return map[string]any{"mode": "require_and_verify", "trusted_ca_certs": []string{env.pki.caDER}}
}

// policy is a Caddy connection policy with the fields given, and the
// gateway's client authentication with -peers-mtls.
func policy(env *runEnv, fields map[string]any) map[string]any {
	if ca := clientAuth(env); ca != nil {
		fields["client_authentication"] = ca
	}
	return fields
}

func caddyL4Proxy(env *runEnv) (*exec.Cmd, error) {
	return caddyCommand(env, "caddy-l4-proxy", caddyBase(env, layer4(env,
		map[string]any{"handler": "tls", "connection_policies": []any{policy(env, map[string]any{})}},
		map[string]any{"handler": "proxy", "upstreams": []any{map[string]any{"dial": []string{env.up.rawAddr()}}}},
	)))
}

func caddyReverseProxy(env *runEnv) (*exec.Cmd, error) {
	return caddyCommand(env, "caddy-reverse-proxy", caddyBase(env, map[string]any{"http": map[string]any{"servers": map[string]any{"bench": map[string]any{
		"listen":                  []string{env.listen},
		"protocols":               []string{"h1"},
		"automatic_https":         map[string]any{"disable": true},
		"tls_connection_policies": []any{policy(env, map[string]any{"protocol_min": "tls1.3"})},
		"routes": []any{map[string]any{"handle": []any{map[string]any{
			"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": env.up.webAddr()}},
		}}}},
	}}}}))
}

// HAProxy 2.6: TLS termination, mode tcp, one thread, no master process.
var haproxyConfig = template.Must(template.New("haproxy").Parse(`global
	nbthread 1
	ssl-default-bind-ciphersuites TLS_AES_128_GCM_SHA256
	ssl-default-bind-options ssl-min-ver TLSv1.3
defaults
	mode tcp
	timeout connect 10s
	timeout client 10m
	timeout server 10m
frontend bench
	bind {{.Listen}} ssl crt {{.Bundle}}{{if .MTLS}} verify required ca-file {{.Cert}}{{end}}
	default_backend upstream
backend upstream
	server up {{.Upstream}}
`))

func haproxy(env *runEnv) (*exec.Cmd, error) {
	file, err := writeTemplate(env, "haproxy.cfg", haproxyConfig)
	if err != nil {
		return nil, err
	}
	return exec.Command("haproxy", "-db", "-f", file), nil
}

// nginx stream proxy with ssl: one process (no master), not daemonized;
// proxy_half_close, because the gateway ends its side of an upload and
// reads the upstream's answer after.
var nginxConfig = template.Must(template.New("nginx").Parse(`load_module /usr/lib/nginx/modules/ngx_stream_module.so;
worker_processes 1;
daemon off;
master_process off;
pid {{.Dir}}/nginx.pid;
error_log stderr warn;
events { worker_connections 1024; }
stream {
	server {
		listen {{.Listen}} ssl;
		ssl_certificate {{.Cert}};
		ssl_certificate_key {{.Key}};
		ssl_protocols TLSv1.3;
		ssl_conf_command Ciphersuites TLS_AES_128_GCM_SHA256;
{{- if .MTLS}}
		ssl_verify_client on;
		ssl_client_certificate {{.Cert}};
{{- end}}
		proxy_pass {{.Upstream}};
		proxy_half_close on;
	}
}
`))

func nginx(env *runEnv) (*exec.Cmd, error) {
	file, err := writeTemplate(env, "nginx.conf", nginxConfig)
	if err != nil {
		return nil, err
	}
	// -e: the compiled-in error log (/var/log/nginx) is opened before the
	// configuration is read, and the VM's root is read-only.
	return exec.Command("nginx", "-p", env.dir, "-e", "stderr", "-c", file), nil
}

func writeTemplate(env *runEnv, name string, t *template.Template) (string, error) {
	var b strings.Builder
	err := t.Execute(&b, map[string]any{
		"Dir": env.dir, "Listen": env.listen, "Upstream": env.up.rawAddr(),
		"Cert": env.pki.certFile, "Key": env.pki.keyFile, "Bundle": env.pki.bundleFile,
		"MTLS": env.peersMTLS,
	})
	if err != nil {
		return "", err
	}
	file := filepath.Join(env.dir, name)
	return file, os.WriteFile(file, []byte(b.String()), 0o644)
}

// floor runs this binary's own floor subcommand (floor.go).
func floor(sub string) func(*runEnv) (*exec.Cmd, error) {
	return func(env *runEnv) (*exec.Cmd, error) {
		return exec.Command(env.self, sub, "-listen", env.listen, "-upstream", env.up.rawAddr(),
			"-cert", env.pki.certFile, "-key", env.pki.keyFile), nil
	}
}

// gateway returns the gateway that reaches c; resume gives it a TLS session
// cache of its own (small-per-call-resumed).
func (c contender) gateway(env *runEnv, resume bool) *gateway {
	g := &gateway{tls: gatewayTLS(env.pki), kernelTX: env.gatewayKTLS && c.dialKind != "plain"}
	// The certificate goes to a server that asks for it, and is counted.
	cert := g.tls.Certificates[0]
	g.tls.Certificates = nil
	g.tls.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		g.certAsked.Add(1)
		return &cert, nil
	}
	if resume {
		g.tls.ClientSessionCache = tls.NewLRUClientSessionCache(0)
	}
	switch c.dialKind {
	case "preamble":
		target := env.up.raw.Addr().(*net.TCPAddr).AddrPort()
		g.dial = g.preambleDialer(env.listen, env.pki.signer, target)
	case "tls":
		g.dial = g.tlsDialer(env.listen)
	case "https":
		// The address, not "localhost": no resolver and no ::1 attempt
		// first; the TLS config names the server.
		g.base = "https://" + env.listen
	case "plain":
		g.dial = plainDialer(env.listen)
	default:
		panic(fmt.Sprintf("contender %s: unknown dial kind %q", c.name, c.dialKind))
	}
	if g.dial != nil {
		g.dial = g.counted(g.dial)
	}
	return g
}
