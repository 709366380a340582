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

	gw "github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/preamble"
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
	// chain, instead of command: an edge-gateway path of several processes
	// (the gateway first, listening on env.listen, then the hop behind it,
	// on env.hopListen). The CPU of every hop is measured, summed and per
	// hop; the structural passes trace the first (the gateway).
	chain func(env *runEnv) ([]hop, error)
	// keySockets: for a chain, the sockets per tunnel (a TCP connection
	// the app or upstream accepts: one per forwarder tunnel) that must
	// install a kernel key in each kernel direction; tls_stat must show
	// that many per tunnel at least. Single-process contenders: 1.
	keySockets int
	// alertSockets: for a zero-copy chain, the kTLS sockets per tunnel of
	// the traced hop, each of which moves a close_notify each way through
	// userspace (recvmsg/sendmsg with the record type).
	alertSockets int
}

// hop is one process of a contender: its name in the results ("gateway",
// "forwarder"), the address it listens on and its command; admin is the
// unix socket of its admin endpoint where it has one (runEnv.hopAdmin).
type hop struct {
	name, listen string
	cmd          *exec.Cmd
	admin        string
}

// gatewayFrameLen is the length of the preamble frame an edge gateway of
// this run writes per tunnel (same key ID, sandbox and target, a 32-byte
// channel binding, and the user's loopback address, which sandbox_proxy
// signs in): l4-l4's zero-copy allowance.
func (env *runEnv) gatewayFrameLen() int {
	user, err := gw.ClientFrom("127.0.0.1:40000", "").Extension()
	if err != nil {
		panic(err)
	}
	frame, err := env.pki.signer.Sign(preamble.Claims{SandboxID: "bench", Target: env.up.raw.Addr().(*net.TCPAddr).AddrPort(),
		Binding: make([]byte, 32), Extensions: []preamble.Extension{user}})
	if err != nil {
		panic(err) // the same claims the bench's own preambles carry
	}
	return len(frame)
}

// hops returns the processes of c, the user-facing one first.
func (c contender) hops(env *runEnv) ([]hop, error) {
	if c.chain != nil {
		return c.chain(env)
	}
	he := *env
	if env.hopAdmin && he.adminSock == "" {
		// A Caddy contender's admin endpoint (caddyBase); the others have
		// none, and their socket never appears.
		he.adminSock = filepath.Join(env.dir, "caddy-"+c.name+".admin.sock")
	}
	cmd, err := c.command(&he)
	if err != nil {
		return nil, err
	}
	return []hop{{name: "forwarder", listen: env.listen, cmd: cmd, admin: he.adminSock}}, nil
}

// runEnv is what a contender's configuration refers to.
type runEnv struct {
	dir, caddy, self, listen string
	// hopListen: the address of a chain's second hop (the forwarder, or
	// l7-l7's dataplane reverse_proxy).
	hopListen string
	up        *upstream
	pki       *pki
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
	// allowCIDRs: the forwarder's target networks (default 127.0.0.1);
	// a load run's targets span 127.0.0.0/8.
	allowCIDRs []string
	// maxConns: nginx's worker_connections (default 1024).
	maxConns int
	// maxHandshakes: the ktls contenders' max_handshakes, and an l4-l4
	// gateway's (0: the handler's default).
	maxHandshakes int
	// maxSchedulingDelay: the ktls contenders' max_scheduling_delay, and
	// an l4-l4 gateway's, a Go duration ("": none).
	maxSchedulingDelay string
	// gatewayStandby: the standby option of an l4-l4 gateway (0: none).
	gatewayStandby int
	// hopAdmin: every hop of a chain has its admin endpoint on a unix
	// socket of its own in dir (hop.admin), whose /metrics a load run
	// reads; otherwise a chain's hops have none.
	hopAdmin bool
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
	// The edge-gateway paths of issue 19: the bench's client is the user
	// (plain TLS, no preamble, no client certificate); the gateway Caddy
	// reaches the sandbox's host over mutual TLS.
	{name: "l7-l7", dialKind: "https", chain: l7l7},
	{name: "l7-l4", dialKind: "https", kernelTX: true, kernelRX: true, keySockets: 2, chain: l7l4},
	{name: "l4-l4", dialKind: "tls", kernelTX: true, kernelRX: true, keySockets: 3, zeroCopy: true, alertSockets: 2, chain: l4l4},
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
	return layer4At(env.listen, handlers...)
}

func layer4At(listen string, handlers ...any) map[string]any {
	return map[string]any{"layer4": map[string]any{"servers": map[string]any{"bench": map[string]any{
		"listen": []string{listen},
		"routes": []any{map[string]any{"handle": handlers}},
	}}}}
}

// caddySandbox is this project's forwarder: layer4 ktls (mutual TLS: the
// sandbox handler carries no tunnel for a client it did not verify) +
// sandbox, with the given offload options on the ktls handler. The loopback
// upstream must be allowed explicitly.
func caddySandbox(offload map[string]any) func(*runEnv) (*exec.Cmd, error) {
	return func(env *runEnv) (*exec.Cmd, error) {
		return caddyCommand(env, "caddy-sandbox", caddyBase(env, sandboxForwarder(env, env.listen, offload)))
	}
}

// sandboxForwarder is the layer4 app of this project's forwarder on listen,
// a `tcp-retry/` address as deployed (examples/forwarder.Caddyfile): its
// listener sheds past max_handshakes before caddy-l4 accepts.
func sandboxForwarder(env *runEnv, listen string, offload map[string]any) map[string]any {
	ktlsHandler := map[string]any{"handler": "ktls", "connection_policies": []any{map[string]any{
		"client_authentication": map[string]any{"mode": "require_and_verify", "trusted_ca_certs": []string{env.pki.caDER}},
	}}}
	for k, v := range offload {
		ktlsHandler[k] = v
	}
	withShedding(env, ktlsHandler)
	sandbox := map[string]any{
		"handler":                 "sandbox",
		"keys":                    []any{map[string]any{"id": env.pki.signer.KeyID(), "public_key": env.pki.signingPub}},
		"require_channel_binding": true,
		"allow_cidrs":             []string{"127.0.0.1"},
	}
	if len(env.allowCIDRs) > 0 {
		sandbox["allow_cidrs"] = env.allowCIDRs
	}
	return layer4At("tcp-retry/"+listen, ktlsHandler, sandbox)
}

// withShedding sets env's bounds on a layer4 ktls handler (the forwarder's,
// and an l4-l4 gateway's, which terminates the user's TLS) and returns it.
func withShedding(env *runEnv, ktlsHandler map[string]any) map[string]any {
	if env.maxHandshakes != 0 {
		ktlsHandler["max_handshakes"] = env.maxHandshakes
	}
	if env.maxSchedulingDelay != "" {
		ktlsHandler["max_scheduling_delay"] = env.maxSchedulingDelay
	}
	return ktlsHandler
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

// The edge-gateway chains (issue 19). Every hop is a Caddy of its own,
// without admin endpoint (no -pprof), started back to front. The gateway
// reaches the second hop over mutual TLS (its client certificate, the
// run's CA, server name localhost), HTTP/1.1 on the L7 hops; the app (the
// upstream's HTTP listener, or its raw one for l4-l4) is the sandbox.

// gatewayTLSConfig is the gateway's side of the mutual TLS to the second
// hop, as reverse_proxy's http transport and the gateway modules take it.
func gatewayTLSConfig(env *runEnv) map[string]any {
	return map[string]any{
		"client_certificate_file":     env.pki.clientCertFile,
		"client_certificate_key_file": env.pki.clientKeyFile,
		"ca":                          map[string]any{"provider": "file", "pem_files": []string{env.pki.certFile}},
		"server_name":                 "localhost",
	}
}

// gatewayDial is the part of the gateway modules' JSON that says how the
// forwarder is reached: mutual TLS, the preamble's key, and kernel TLS on
// the forwarder connection or a failed tunnel (require_offload).
func gatewayDial(env *runEnv, fields map[string]any) map[string]any {
	fields["tls"] = gatewayTLSConfig(env)
	fields["signing_key_file"] = env.pki.signingKeyFile
	fields["require_offload"] = true
	return fields
}

// httpsServer is a Caddy HTTP server on listen: TLS 1.3, HTTP/1.1 (the
// bench's client speaks it, and so do the L7 hops), one route of handlers.
func httpsServer(listen string, policy map[string]any, handlers ...any) map[string]any {
	policy["protocol_min"] = "tls1.3"
	return map[string]any{"http": map[string]any{"servers": map[string]any{"bench": map[string]any{
		"listen":                  []string{listen},
		"protocols":               []string{"h1"},
		"automatic_https":         map[string]any{"disable": true},
		"tls_connection_policies": []any{policy},
		"routes":                  []any{map[string]any{"handle": handlers}},
	}}}}
}

// poolConns is how many idle connections an L7 gateway keeps to its one
// upstream: Caddy's http transport default (32), given to the sandbox
// transport too (its default is 8 per route), so that 16 concurrent
// small-call connections reuse their tunnels on both L7 paths alike.
const poolConns = 32

// chainHops starts the second hop's config, then the gateway's.
func chainHops(env *runEnv, name string, gatewayApps, hopApps map[string]any, hopName string) ([]hop, error) {
	back, err := chainHop(env, name, hopName, env.hopListen, hopApps)
	if err != nil {
		return nil, err
	}
	front, err := chainHop(env, name, "gateway", env.listen, gatewayApps)
	if err != nil {
		return nil, err
	}
	return []hop{front, back}, nil
}

// chainHop is the hop of chain name called hopName, listening on listen;
// with env.hopAdmin its admin endpoint is a unix socket of its own.
func chainHop(env *runEnv, chain, hopName, listen string, apps map[string]any) (hop, error) {
	file := "caddy-" + chain + "-" + hopName
	he := *env
	he.adminSock = ""
	if env.hopAdmin {
		he.adminSock = filepath.Join(env.dir, file+".admin.sock")
	}
	cmd, err := caddyCommand(&he, file, caddyBase(&he, apps))
	return hop{name: hopName, listen: listen, cmd: cmd, admin: he.adminSock}, err
}

// l7l7 is the old path: the gateway's reverse_proxy over mutual TLS to a
// dataplane Caddy's reverse_proxy, and from it to the app; HTTP parsed and
// re-sent on both hops, every record sealed and opened in userspace.
func l7l7(env *runEnv) ([]hop, error) {
	gw := httpsServer(env.listen, map[string]any{}, map[string]any{
		"handler":   "reverse_proxy",
		"upstreams": []any{map[string]any{"dial": env.hopListen}},
		// The user's Host (localhost, the name the TLS client sends), not
		// the TLS upstream's address, which reverse_proxy sends by
		// default: the dataplane authenticates the gateway, and Caddy then
		// answers 421 to a Host that differs from the server name.
		"headers": map[string]any{"request": map[string]any{"set": map[string]any{"Host": []string{"{http.request.host}"}}}},
		"transport": map[string]any{
			"protocol":   "http",
			"versions":   []string{"1.1"},
			"tls":        gatewayTLSConfig(env),
			"keep_alive": map[string]any{"max_idle_conns_per_host": poolConns},
		},
	})
	dataplane := httpsServer(env.hopListen, map[string]any{
		"client_authentication": map[string]any{"mode": "require_and_verify", "trusted_ca_certs": []string{env.pki.caDER}},
	}, map[string]any{
		"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": env.up.webAddr()}},
	})
	return chainHops(env, "l7-l7", gw, dataplane, "forwarder")
}

// l7l4 is the new HTTP path: the gateway's reverse_proxy with the sandbox
// transport (a tunnel per pooled connection, kTLS on it) to this project's
// forwarder, which splices to the app.
func l7l4(env *runEnv) ([]hop, error) {
	gw := httpsServer(env.listen, map[string]any{}, map[string]any{
		"handler":   "reverse_proxy",
		"upstreams": []any{map[string]any{"dial": env.hopListen}},
		"transport": gatewayDial(env, map[string]any{
			"protocol":                 "sandbox",
			"sandbox":                  "bench",
			"target":                   env.up.webAddr(),
			"versions":                 []string{"1.1"},
			"max_idle_conns_per_route": poolConns,
		}),
	})
	return chainHops(env, "l7-l4", gw, sandboxForwarder(env, env.hopListen, nil), "forwarder")
}

// l4l4 is the raw TCP path: the gateway's ktls handler terminates the
// user's TLS, sandbox_proxy opens the tunnel (kTLS) and splices between
// the two kTLS sockets; the forwarder splices to the upstream. With
// env.gatewayStandby, sandbox_proxy keeps that many standby connections
// to the forwarder (the forwarder's sandbox handler takes them by
// default).
func l4l4(env *runEnv) ([]hop, error) {
	proxy := gatewayDial(env, map[string]any{
		"handler":   "sandbox_proxy",
		"forwarder": env.hopListen,
		"sandbox":   "bench",
		"target":    env.up.rawAddr(),
	})
	name := "l4-l4"
	if env.gatewayStandby > 0 {
		proxy["standby"] = env.gatewayStandby
		name += "-standby"
	}
	gw := layer4At(env.listen, withShedding(env, map[string]any{"handler": "ktls"}), proxy)
	return chainHops(env, name, gw, sandboxForwarder(env, env.hopListen, nil), "forwarder")
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
events { worker_connections {{.MaxConns}}; }
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
		"MTLS": env.peersMTLS, "MaxConns": max(env.maxConns, 1024),
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
