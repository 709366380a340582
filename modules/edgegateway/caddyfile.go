package edgegateway

import (
	"net/http"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
	"github.com/ktlsingress/caddy-ktls/internal/caddyfileargs"
)

// unmarshalCaddyfileOption reads one gateway dial option, with the names
// reverse_proxy's http transport gives the TLS ones, and the offload
// options (offload.Options.UnmarshalCaddyfileOption):
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
			if v, err = caddyfileargs.OneOf(d, "on", "off"); err != nil {
				return true, err
			}
		}
		g.ExpectNoPad, g.DisableExpectNoPad = v == "on", v == "off"
		return true, nil
	}
	if handled, err := g.Options.UnmarshalCaddyfileOption(d); handled {
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
		return true, d.Errf("%s: %s", opt, RefusedGatewayTLSOptions[opt])
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
		dur, err := caddyfileargs.Duration(d)
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
		v, err := caddyfileargs.OneOf(d, "on", "off")
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
			if err := caddyfileargs.NoArgs(d); err != nil {
				return err
			}
			t.SendClient = true
		case "versions":
			v, err := caddyfileargs.OneOf(d, "1.1", "h2c")
			if err != nil {
				return err
			}
			t.Versions = []string{v}
		case "max_idle_conns_per_route", "max_conns_per_route", "max_routes":
			n, err := caddyfileargs.PositiveInt(d)
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
			dur, err := caddyfileargs.Duration(d)
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
			dur, err := caddyfileargs.Duration(d)
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
			n, err := caddyfileargs.PositiveInt(d)
			if err != nil {
				return err
			}
			o.MaxEntries = n
		default:
			return d.Errf("unknown sandbox_lookup option %q", opt)
		}
	}
	if o.URL == "" {
		return d.Err("sandbox_lookup: no url: " + LookupURLHint)
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
