package caddyktls

import (
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
	"github.com/dustin/go-humanize"
)

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens: the offload
// options (unmarshalCaddyfileOption) and connection_policy in caddy-l4's
// `tls` handler syntax:
//
//	ktls {
//		connection_policy {
//			client_auth {
//				mode require_and_verify
//				trust_pool inline <base64_der>
//				verifier leaf pem <cert_pem>
//			}
//		}
//		resumption on|off   # default on: session tickets scoped to the policy that verified the client
//		<offload option> ...
//	}
func (h *KTLSHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the handler name
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := h.unmarshalCaddyfileOption(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		switch opt := d.Val(); opt {
		case "connection_policy":
			cp := new(caddytls.ConnectionPolicy)
			if err := cp.UnmarshalCaddyfile(d.NewFromNextSegment()); err != nil {
				return err
			}
			h.ConnectionPolicies = append(h.ConnectionPolicies, cp)
		case "resumption":
			v, err := oneOf(d, "on", "off")
			if err != nil {
				return err
			}
			h.DisableResumption = v == "off"
		default:
			return d.Errf("unknown ktls handler option %q", opt)
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the wrapper from Caddyfile tokens: the offload
// options (unmarshalCaddyfileOption) and sendfile:
//
//	ktls {
//		<offload option> ...
//		sendfile          # sendfile for file bodies; Caddy then WARNs per connection
//	}
func (lw *ListenerWrapper) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the wrapper name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		if handled, err := lw.unmarshalCaddyfileOption(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		switch opt := d.Val(); opt {
		case "sendfile":
			if err := noArgs(d); err != nil {
				return err
			}
			lw.Sendfile = true
		default:
			return d.Errf("unknown ktls listener wrapper option %q", opt)
		}
	}
	return nil
}

// unmarshalCaddyfileOption reads the offload option d is on, if it is one,
// and reports whether it was. The offload options, the same in the layer4
// `ktls` handler and the `ktls` listener wrapper:
//
//	offload           on|off        # default on; off keeps the whole session in userspace TLS
//	rx                on|off        # default on; off keeps decryption in Go (kTLS RX is where CVEs cluster)
//	fallback          allow|refuse  # default allow: userspace TLS when offload is impossible
//	expect_no_pad                   # TLS_RX_EXPECT_NO_PAD (trusted peers only)
//	tx_zerocopy_ro                  # TLS_TX_ZEROCOPY_RO (with the wrapper's sendfile, device offload)
//	keyupdate_rate    <per_second> [<burst>]
//	key_record_limit  <records>     # default 8388608 (2^23), at most 2^24: renew the key, or end, before a key protects more
//	handshake_timeout <duration>
func (o *OffloadOptions) unmarshalCaddyfileOption(d *caddyfile.Dispenser) (handled bool, err error) {
	switch opt := d.Val(); opt {
	case "offload":
		v, err := oneOf(d, "on", "off")
		if err != nil {
			return true, err
		}
		o.DisableOffload = v == "off"
	case "rx":
		v, err := oneOf(d, "on", "off")
		if err != nil {
			return true, err
		}
		o.DisableRX = v == "off"
	case "fallback":
		v, err := oneOf(d, "allow", "refuse")
		if err != nil {
			return true, err
		}
		o.RequireOffload = v == "refuse"
	case "expect_no_pad":
		if err := noArgs(d); err != nil {
			return true, err
		}
		o.ExpectNoPad = true
	case "tx_zerocopy_ro":
		if err := noArgs(d); err != nil {
			return true, err
		}
		o.TXZeroCopyRO = true
	case "keyupdate_rate":
		args := d.RemainingArgs()
		if len(args) < 1 || len(args) > 2 {
			return true, d.Errf("keyupdate_rate takes a rate per second and an optional burst, got %d arguments", len(args))
		}
		rate, err := strconv.ParseFloat(args[0], 64)
		// ParseFloat takes "NaN" and "Inf", which JSON cannot carry.
		if err != nil || !(rate > 0) || math.IsInf(rate, 1) {
			return true, d.Errf("keyupdate_rate: %q is not a positive number", args[0])
		}
		o.KeyUpdateRate = rate
		if len(args) == 2 {
			burst, err := strconv.Atoi(args[1])
			if err != nil || burst <= 0 {
				return true, d.Errf("keyupdate_rate: burst %q is not a positive integer", args[1])
			}
			o.KeyUpdateBurst = burst
		}
	case "key_record_limit":
		if !d.NextArg() {
			return true, d.ArgErr()
		}
		n, err := strconv.ParseUint(d.Val(), 10, 64)
		if err != nil || n == 0 {
			return true, d.Errf("key_record_limit: %q is not a positive integer", d.Val())
		}
		o.KeyRecordLimit = n
		if d.NextArg() {
			return true, d.ArgErr()
		}
	case "handshake_timeout":
		dur, err := durationArg(d)
		if err != nil {
			return true, err
		}
		o.HandshakeTimeout = dur
	default:
		return false, nil
	}
	return true, nil
}

// UnmarshalCaddyfile sets up the handler: `ktls_session`, no arguments.
func (*KTLSSession) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return noArgsOrBlock(d, "ktls_session handler")
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	sandbox {
//		key       <key_id> <base64_ed25519_public_key>
//		key_file  <keyring.pem>
//		key_clients <key_id> <client_name>...  # CN or DNS name of the gateway certificates that may use the key
//		require_channel_binding
//		max_clock_skew     <duration>
//		max_preamble_ttl   <duration>
//		replay_cache_size  <n>
//		max_tunnels_per_sandbox <n>
//		max_tunnel_lifetime <duration>
//		proxy_protocol     v2                # PROXY v2 header to the target: the signed client address, sandbox ID TLV
//		preamble_timeout   <duration>
//		dial_timeout       <duration>
//		keepalive          <duration>
//		tcp_user_timeout   <duration>
//		allow              <cidr|ip>...      # required; e.g. 10.0.0.0/8; 127.0.0.0/8 opens loopback (demo only)
//		allow_ports        <port|lo-hi>...
//		nat64_prefix       <cidr>...         # RFC 6052 prefixes of NAT64 translators (/32../96), e.g. 64:ff9b:1:a::/64
//		drain_grace_period <duration>
//		insecure_plaintext                   # tests only: no TLS, no client certificate needed
//		activity_push <url> {
//			interval   <duration>
//			timeout    <duration>
//			attempts   <n>
//			backoff    <duration>
//			queue_size <n>
//			header     <name> <value>   # repeatable; e.g. Authorization "Bearer {env.ACTIVITY_TOKEN}"
//			instance   <name>           # in every report's ID; default: the host name
//		}
//	}
func (h *SandboxHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the handler name
	if d.NextArg() {
		return d.ArgErr()
	}
	durations := map[string]*caddy.Duration{
		"max_clock_skew": &h.MaxClockSkew, "max_preamble_ttl": &h.MaxPreambleTTL,
		"preamble_timeout": &h.PreambleTimeout, "dial_timeout": &h.DialTimeout,
		"keepalive": &h.KeepAlive, "tcp_user_timeout": &h.TCPUserTimeout,
		"drain_grace_period": &h.DrainGracePeriod, "max_tunnel_lifetime": &h.MaxTunnelLifetime,
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if dst, ok := durations[opt]; ok {
			dur, err := durationArg(d)
			if err != nil {
				return err
			}
			*dst = dur
			continue
		}
		switch opt {
		case "key":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("key takes a key ID and a base64 Ed25519 public key, got %d arguments", len(args))
			}
			h.Keys = append(h.Keys, SandboxKey{ID: args[0], PublicKey: args[1]})
		case "key_clients":
			args := d.RemainingArgs()
			if len(args) < 2 {
				return d.Errf("key_clients takes a key ID and one or more client names, got %d arguments", len(args))
			}
			if h.KeyClients == nil {
				h.KeyClients = map[string][]string{}
			}
			h.KeyClients[args[0]] = append(h.KeyClients[args[0]], args[1:]...)
		case "key_file":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			h.KeyFiles = append(h.KeyFiles, args...)
		case "require_channel_binding":
			if err := noArgs(d); err != nil {
				return err
			}
			h.RequireChannelBinding = true
		case "insecure_plaintext":
			if err := noArgs(d); err != nil {
				return err
			}
			h.InsecurePlaintext = true
		case "replay_cache_size", "max_tunnels_per_sandbox":
			n, err := positiveIntArg(d)
			if err != nil {
				return err
			}
			if opt == "replay_cache_size" {
				h.ReplayCacheSize = n
			} else {
				h.MaxTunnelsPerSandbox = n
			}
		case "proxy_protocol":
			if !d.NextArg() {
				return d.Errf("proxy_protocol needs a version: v2")
			}
			h.ProxyProtocol = d.Val()
			if d.NextArg() {
				return d.ArgErr()
			}
			if h.ProxyProtocol != "v2" {
				return d.Errf("proxy_protocol %q: the only version is v2", h.ProxyProtocol)
			}
		case "allow":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			h.AllowCIDRs = append(h.AllowCIDRs, args...)
		case "nat64_prefix":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			h.NAT64Prefixes = append(h.NAT64Prefixes, args...)
		case "allow_ports":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			h.AllowPorts = append(h.AllowPorts, args...)
		case "activity_push":
			p, err := unmarshalActivityPush(d)
			if err != nil {
				return err
			}
			h.ActivityPush = p
		case "max_bandwidth":
			b, err := unmarshalBandwidth(d)
			if err != nil {
				return err
			}
			h.MaxBandwidth = b
		case "wake":
			w, err := unmarshalWake(d)
			if err != nil {
				return err
			}
			h.Wake = w
		default:
			return d.Errf("unknown sandbox handler option %q", opt)
		}
	}
	return nil
}

func unmarshalActivityPush(d *caddyfile.Dispenser) (*ActivityPush, error) {
	if !d.NextArg() {
		return nil, d.Errf("activity_push needs a URL")
	}
	p := &ActivityPush{URL: d.Val()}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch opt := d.Val(); opt {
		case "interval", "timeout", "backoff":
			dur, err := durationArg(d)
			if err != nil {
				return nil, err
			}
			switch opt {
			case "interval":
				p.Interval = dur
			case "timeout":
				p.Timeout = dur
			default:
				p.Backoff = dur
			}
		case "attempts", "queue_size":
			n, err := positiveIntArg(d)
			if err != nil {
				return nil, err
			}
			if opt == "attempts" {
				p.Attempts = n
			} else {
				p.QueueSize = n
			}
		case "header":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return nil, d.Errf("header takes a field name and a value, got %d arguments", len(args))
			}
			if p.Headers == nil {
				p.Headers = http.Header{}
			}
			p.Headers.Add(args[0], args[1])
		case "instance":
			args := d.RemainingArgs()
			if len(args) != 1 {
				return nil, d.Errf("instance takes one name, got %d arguments", len(args))
			}
			p.Instance = args[0]
		default:
			return nil, d.Errf("unknown activity_push option %q", opt)
		}
	}
	return p, nil
}

// unmarshalBandwidth reads the sandbox handler's max_bandwidth option, in
// bytes per second (sizes as `10MB`, `512KiB` or a number of bytes):
//
//	max_bandwidth {
//		to_sandbox   <rate>
//		from_sandbox <rate>
//		burst        <size>   # default: a tenth of a second's worth, at least 64KiB
//	}
func unmarshalBandwidth(d *caddyfile.Dispenser) (*SandboxBandwidth, error) {
	if d.NextArg() {
		return nil, d.Errf("max_bandwidth %[1]s: max_bandwidth takes a block, not a rate: put `to_sandbox %[1]s` and `from_sandbox %[1]s` "+
			"(bytes per second, each direction capped on its own) on lines of their own inside max_bandwidth { }", d.Val())
	}
	b := new(SandboxBandwidth)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		var dst *int64
		switch opt {
		case "to_sandbox":
			dst = &b.ToSandbox
		case "from_sandbox":
			dst = &b.FromSandbox
		case "burst":
			dst = &b.Burst
		default:
			return nil, d.Errf("unknown max_bandwidth option %q", opt)
		}
		if !d.NextArg() {
			return nil, d.ArgErr()
		}
		n, err := humanize.ParseBytes(d.Val())
		if err != nil || n == 0 || n > math.MaxInt64 {
			return nil, d.Errf("%s: %q is not a positive size such as 10MB", opt, d.Val())
		}
		*dst = int64(n)
		if d.NextArg() {
			return nil, d.ArgErr()
		}
	}
	return b, nil
}

// unmarshalWake reads the sandbox handler's wake option:
//
//	wake <url> {
//		header          <name> <value>   # repeatable; e.g. Authorization "Bearer {env.WAKE_TOKEN}"
//		timeout         <duration>       # default 30s: how long a tunnel waits for its woken target
//		request_timeout <duration>       # default 10s: the wake request
//	}
func unmarshalWake(d *caddyfile.Dispenser) (*SandboxWake, error) {
	if !d.NextArg() {
		return nil, d.Errf("wake needs the control plane's URL")
	}
	w := &SandboxWake{URL: d.Val()}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch opt := d.Val(); opt {
		case "timeout", "request_timeout":
			dur, err := durationArg(d)
			if err != nil {
				return nil, err
			}
			if opt == "timeout" {
				w.Timeout = dur
			} else {
				w.RequestTimeout = dur
			}
		case "header":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return nil, d.Errf("header takes a field name and a value, got %d arguments", len(args))
			}
			if w.Headers == nil {
				w.Headers = http.Header{}
			}
			w.Headers.Add(args[0], args[1])
		default:
			return nil, d.Errf("unknown wake option %q", opt)
		}
	}
	return w, nil
}

// UnmarshalCaddyfile sets up the matcher: `sandbox`, no arguments.
func (m *MatchSandbox) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return noArgsOrBlock(d, "sandbox matcher")
}

// noArgsOrBlock reads a directive (what, in messages) that takes neither
// arguments nor a block.
func noArgsOrBlock(d *caddyfile.Dispenser, what string) error {
	d.Next() // the directive's name
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(d.Nesting()) {
		return d.Errf("the %s takes no block", what)
	}
	return nil
}

// noArgs fails when the option d is on has arguments.
func noArgs(d *caddyfile.Dispenser) error {
	if opt := d.Val(); d.NextArg() {
		return d.Errf("%s takes no arguments", opt)
	}
	return nil
}

// positiveIntArg reads the one argument of the option d is on, a positive
// integer.
func positiveIntArg(d *caddyfile.Dispenser) (int, error) {
	opt := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	n, err := strconv.Atoi(d.Val())
	if err != nil || n <= 0 {
		return 0, d.Errf("%s: %q is not a positive integer", opt, d.Val())
	}
	if d.NextArg() {
		return 0, d.ArgErr()
	}
	return n, nil
}

func durationArg(d *caddyfile.Dispenser) (caddy.Duration, error) {
	opt := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	dur, err := caddy.ParseDuration(d.Val())
	if err != nil || dur <= 0 {
		return 0, d.Errf("%s: %q is not a positive duration", opt, d.Val())
	}
	if d.NextArg() {
		return 0, d.ArgErr()
	}
	return caddy.Duration(dur), nil
}

// oneOf reads exactly one argument, which must be one of choices.
func oneOf(d *caddyfile.Dispenser, choices ...string) (string, error) {
	opt := d.Val()
	args := d.RemainingArgs()
	switch {
	case len(args) == 1 && slices.Contains(choices, args[0]):
		return args[0], nil
	case len(args) == 1:
		return "", d.Errf("%s takes one of %s, got %q", opt, strings.Join(choices, ", "), args[0])
	default:
		return "", d.Errf("%s takes one of %s, got %d arguments", opt, strings.Join(choices, ", "), len(args))
	}
}

// unmarshalCaddyfileOption reads one gateway dial option, with the names
// reverse_proxy's http transport gives the TLS ones, and the offload
// options (OffloadOptions.unmarshalCaddyfileOption):
//
//	tls_client_auth  <cert_file> <key_file> | <automate_name>   # required
//	tls_trust_pool   <module> ...           # the forwarders' CA, e.g. file /etc/caddy/forwarders-ca.pem
//	tls_server_name  <name>                 # default: the forwarder's host
//	signing_key_file <path>                 # required: from `caddy sandbox keygen`
//	key_id           <id>                   # default: the key file's Key-Id
//	dial_timeout     <duration>             # default 10s: connect, handshake, preamble
//	keepalive        <duration>             # default 30s
//	preamble_ttl     <duration>             # default 30s
//	resumption       on|off                 # default on: resume forwarder sessions
//	expect_no_pad    [on|off]               # default: on where the kernel allows it
//	<offload option> ...                     # offload on|off, rx on|off, fallback allow|refuse, handshake_timeout, ...
func (g *GatewayDial) unmarshalCaddyfileOption(d *caddyfile.Dispenser) (handled bool, err error) {
	if d.Val() == "expect_no_pad" {
		// A gateway's default is on where the kernel allows it, so it
		// takes off as well as the offload option's bare form (on).
		v := "on"
		if d.CountRemainingArgs() > 0 {
			if v, err = oneOf(d, "on", "off"); err != nil {
				return true, err
			}
		}
		g.ExpectNoPad, g.DisableExpectNoPad = v == "on", v == "off"
		return true, nil
	}
	if handled, err := g.OffloadOptions.unmarshalCaddyfileOption(d); handled {
		return true, err
	}
	tlsCfg := func() *reverseproxy.TLSConfig {
		if g.TLS == nil {
			g.TLS = new(reverseproxy.TLSConfig)
		}
		return g.TLS
	}
	switch opt := d.Val(); opt {
	case "tls_insecure_skip_verify", "tls_timeout", "tls_except_ports":
		// reverse_proxy's http transport has them; a gateway refuses each.
		return true, d.Errf("%s: %s", opt, refusedGatewayTLSOptions[opt])
	case "tls_client_auth":
		switch args := d.RemainingArgs(); len(args) {
		case 1:
			tlsCfg().ClientCertificateAutomate = args[0]
		case 2:
			tlsCfg().ClientCertificateFile, tlsCfg().ClientCertificateKeyFile = args[0], args[1]
		default:
			return true, d.Errf("tls_client_auth takes a certificate file and its key file, or a name whose certificate Caddy manages; got %d arguments", len(args))
		}
	case "tls_trust_pool":
		if !d.NextArg() {
			return true, d.ArgErr()
		}
		stem := d.Val()
		unm, err := caddyfile.UnmarshalModule(d, "tls.ca_pool.source."+stem)
		if err != nil {
			return true, err
		}
		if _, ok := unm.(caddytls.CA); !ok {
			return true, d.Errf("tls_trust_pool: module %s is not a CA pool source", stem)
		}
		if tlsCfg().CARaw != nil {
			return true, d.Err("tls_trust_pool given twice")
		}
		g.TLS.CARaw = caddyconfig.JSONModuleObject(unm, "provider", stem, nil)
	case "tls_server_name":
		if !d.NextArg() {
			return true, d.ArgErr()
		}
		tlsCfg().ServerName = d.Val()
		if d.NextArg() {
			return true, d.ArgErr()
		}
	case "signing_key_file", "key_id":
		if !d.NextArg() {
			return true, d.ArgErr()
		}
		if opt == "signing_key_file" {
			g.SigningKeyFile = d.Val()
		} else {
			g.KeyID = d.Val()
		}
		if d.NextArg() {
			return true, d.ArgErr()
		}
	case "dial_timeout", "keepalive", "preamble_ttl":
		dur, err := durationArg(d)
		if err != nil {
			return true, err
		}
		switch opt {
		case "dial_timeout":
			g.DialTimeout = dur
		case "keepalive":
			g.KeepAlive = dur
		default:
			g.PreambleTTL = dur
		}
	case "resumption":
		v, err := oneOf(d, "on", "off")
		if err != nil {
			return true, err
		}
		g.DisableResumption = v == "off"
	default:
		return false, nil
	}
	return true, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	sandbox_proxy {
//		forwarder <host:port>      # placeholders allowed
//		sandbox   <id>             # e.g. {l4.tls.server_name.labels.2}
//		target    <ip:port>        # placeholders allowed
//		client_id <identity>       # signed with the user's address; e.g. {l4.tls.client.subject}
//		<gateway dial option> ...  # tls_client_auth, tls_trust_pool, signing_key_file, ... (GatewayDial)
//	}
func (h *SandboxProxy) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the handler name
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := h.GatewayDial.unmarshalCaddyfileOption(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		switch opt := d.Val(); opt {
		case "forwarder", "sandbox", "target", "client_id":
			if !d.NextArg() {
				return d.ArgErr()
			}
			switch opt {
			case "forwarder":
				h.Forwarder = d.Val()
			case "sandbox":
				h.Sandbox = d.Val()
			case "client_id":
				h.ClientID = d.Val()
			default:
				h.Target = d.Val()
			}
			if d.NextArg() {
				return d.ArgErr()
			}
		default:
			return d.Errf("unknown sandbox_proxy option %q", opt)
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the transport from Caddyfile tokens:
//
//	reverse_proxy <forwarder host:port> {
//		transport sandbox {
//			sandbox  <id>                  # e.g. {http.request.host.labels.2}
//			target   <ip:port>             # e.g. {vars.sandbox_target}, set by map
//			versions 1.1|h2c               # default 1.1
//			max_idle_conns_per_route <n>   # default 8
//			max_conns_per_route      <n>   # default: no cap
//			idle_timeout             <duration>  # default 2m
//			max_routes               <n>   # default 4096
//			send_client                    # sign the request's client address into each tunnel's preamble
//			client_id <identity>           # with send_client; e.g. {http.request.header.X-User}
//			<gateway dial option> ...      # tls_client_auth, tls_trust_pool, signing_key_file, ... (GatewayDial)
//		}
//	}
func (t *SandboxTransport) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the transport name
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := t.GatewayDial.unmarshalCaddyfileOption(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		switch opt := d.Val(); opt {
		case "sandbox", "target", "client_id":
			if !d.NextArg() {
				return d.ArgErr()
			}
			switch opt {
			case "sandbox":
				t.Sandbox = d.Val()
			case "client_id":
				t.ClientID = d.Val()
			default:
				t.Target = d.Val()
			}
			if d.NextArg() {
				return d.ArgErr()
			}
		case "send_client":
			if err := noArgs(d); err != nil {
				return err
			}
			t.SendClient = true
		case "versions":
			v, err := oneOf(d, "1.1", "h2c")
			if err != nil {
				return err
			}
			t.Versions = []string{v}
		case "max_idle_conns_per_route", "max_conns_per_route", "max_routes":
			n, err := positiveIntArg(d)
			if err != nil {
				return err
			}
			switch opt {
			case "max_idle_conns_per_route":
				t.MaxIdleConnsPerRoute = n
			case "max_conns_per_route":
				t.MaxConnsPerRoute = n
			default:
				t.MaxRoutes = n
			}
		case "idle_timeout":
			dur, err := durationArg(d)
			if err != nil {
				return err
			}
			t.IdleTimeout = dur
		default:
			return d.Errf("unknown sandbox transport option %q", opt)
		}
	}
	return nil
}

func init() {
	httpcaddyfile.RegisterHandlerDirective("sandbox_lookup", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		l := new(SandboxLookup)
		err := l.UnmarshalCaddyfile(h.Dispenser)
		return l, err
	})
	// Its variables are for reverse_proxy.
	httpcaddyfile.RegisterDirectiveOrder("sandbox_lookup", httpcaddyfile.Before, "reverse_proxy")
}

// unmarshalLookup reads a sandbox_lookup directive, HTTP or layer4:
//
//	sandbox_lookup <sandbox_id> {
//		url          <url with {sandbox}>   # required
//		header       <name> <value>         # repeatable; e.g. Authorization "Bearer {env.CP_TOKEN}"
//		timeout      <duration>             # default 5s
//		ttl          <duration>             # default 30s
//		negative_ttl <duration>             # default 5s
//		max_entries  <n>                    # default 65536
//	}
func unmarshalLookup(d *caddyfile.Dispenser, o *LookupOptions) error {
	d.Next() // the directive's name
	if !d.NextArg() {
		return d.Err("sandbox_lookup takes the sandbox ID to look up (a placeholder), then a block with its url")
	}
	o.Sandbox = d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch opt := d.Val(); opt {
		case "url":
			if !d.NextArg() {
				return d.ArgErr()
			}
			o.URL = d.Val()
			if d.NextArg() {
				return d.ArgErr()
			}
		case "header":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("header takes a field name and a value, got %d arguments", len(args))
			}
			if o.Headers == nil {
				o.Headers = http.Header{}
			}
			o.Headers.Add(args[0], args[1])
		case "timeout", "ttl", "negative_ttl":
			dur, err := durationArg(d)
			if err != nil {
				return err
			}
			switch opt {
			case "timeout":
				o.Timeout = dur
			case "ttl":
				o.TTL = dur
			default:
				o.NegativeTTL = dur
			}
		case "max_entries":
			n, err := positiveIntArg(d)
			if err != nil {
				return err
			}
			o.MaxEntries = n
		default:
			return d.Errf("unknown sandbox_lookup option %q", opt)
		}
	}
	if o.URL == "" {
		return d.Err("sandbox_lookup: no url: " + lookupURLHint)
	}
	return nil
}

// UnmarshalCaddyfile sets up the handler: see unmarshalLookup.
func (h *SandboxLookup) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return unmarshalLookup(d, &h.LookupOptions)
}

// UnmarshalCaddyfile sets up the handler: see unmarshalLookup.
func (h *SandboxLookupL4) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return unmarshalLookup(d, &h.LookupOptions)
}

// Interface guards.
var (
	_ caddyfile.Unmarshaler = (*ListenerWrapper)(nil)
	_ caddyfile.Unmarshaler = (*KTLSHandler)(nil)
	_ caddyfile.Unmarshaler = (*KTLSSession)(nil)
	_ caddyfile.Unmarshaler = (*SandboxHandler)(nil)
	_ caddyfile.Unmarshaler = (*MatchSandbox)(nil)
	_ caddyfile.Unmarshaler = (*SandboxProxy)(nil)
	_ caddyfile.Unmarshaler = (*SandboxTransport)(nil)
	_ caddyfile.Unmarshaler = (*SandboxLookup)(nil)
	_ caddyfile.Unmarshaler = (*SandboxLookupL4)(nil)
)
