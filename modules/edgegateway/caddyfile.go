package edgegateway

import (
	"github.com/caddyserver/caddy/v2"
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
//	standby          <n>                    # default 0: standby connections kept ready per forwarder
//	standby_max_idle <duration>             # default 30s: below the forwarders' standby_timeout
//	resumption       on|off                 # default on: resume forwarder sessions
//	expect_no_pad    [on|off]               # default: on where the kernel allows it
//	<offload option> ...                     # offload on|off, rx on|off, fallback allow|refuse, handshake_timeout, ...
func (g *DialOptions) unmarshalCaddyfileOption(d *caddyfile.Dispenser) (handled bool, err error) {
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
	args := caddyfileargs.Table{
		Strings: map[string]*string{"signing_key_file": &g.SigningKeyFile, "key_id": &g.KeyID},
		Durations: map[string]*caddy.Duration{"dial_timeout": &g.DialTimeout, "keepalive": &g.KeepAlive, "preamble_ttl": &g.PreambleTTL,
			"standby_max_idle": &g.StandbyMaxIdle},
		Ints: map[string]*int{"standby": &g.Standby},
	}
	if handled, err := args.Read(d); handled {
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
		name, err := caddyfileargs.String(d)
		if err != nil {
			return true, err
		}
		tlsCfg().ServerName = name
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
//		drain_grace_period <duration>  # default 30s: how long open tunnels may run on at exit
//		<gateway dial option> ...  # tls_client_auth, tls_trust_pool, signing_key_file, ... (DialOptions)
//	}
func (h *Proxy) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the handler name
	if d.NextArg() {
		return d.ArgErr()
	}
	args := caddyfileargs.Table{
		Strings:   map[string]*string{"forwarder": &h.Forwarder, "sandbox": &h.Sandbox, "target": &h.Target, "client_id": &h.ClientID},
		Durations: map[string]*caddy.Duration{"drain_grace_period": &h.DrainGracePeriod},
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := h.DialOptions.unmarshalCaddyfileOption(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		if handled, err := args.Read(d); !handled {
			return d.Errf("unknown sandbox_proxy option %q", d.Val())
		} else if err != nil {
			return err
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
//			<gateway dial option> ...      # tls_client_auth, tls_trust_pool, signing_key_file, ... (DialOptions)
//		}
//	}
func (t *Transport) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the transport name
	if d.NextArg() {
		return d.ArgErr()
	}
	args := caddyfileargs.Table{
		Strings:   map[string]*string{"sandbox": &t.Sandbox, "target": &t.Target, "client_id": &t.ClientID},
		Ints:      map[string]*int{"max_idle_conns_per_route": &t.MaxIdleConnsPerRoute, "max_conns_per_route": &t.MaxConnsPerRoute, "max_routes": &t.MaxRoutes},
		Durations: map[string]*caddy.Duration{"idle_timeout": &t.IdleTimeout},
		Flags:     map[string]*bool{"send_client": &t.SendClient},
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := t.DialOptions.unmarshalCaddyfileOption(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		if handled, err := args.Read(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		switch opt := d.Val(); opt {
		case "versions":
			v, err := caddyfileargs.OneOf(d, "1.1", "h2c")
			if err != nil {
				return err
			}
			t.Versions = []string{v}
		default:
			return d.Errf("unknown sandbox transport option %q", opt)
		}
	}
	return nil
}

func init() {
	httpcaddyfile.RegisterHandlerDirective("sandbox_lookup", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		l := new(Lookup)
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
	args := caddyfileargs.Table{
		Strings:   map[string]*string{"url": &o.URL},
		Durations: map[string]*caddy.Duration{"timeout": &o.Timeout, "ttl": &o.TTL, "negative_ttl": &o.NegativeTTL},
		Ints:      map[string]*int{"max_entries": &o.MaxEntries},
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() == "header" {
			if err := caddyfileargs.Header(d, &o.Headers); err != nil {
				return err
			}
			continue
		}
		if handled, err := args.Read(d); !handled {
			return d.Errf("unknown sandbox_lookup option %q", d.Val())
		} else if err != nil {
			return err
		}
	}
	if o.URL == "" {
		return d.Err("sandbox_lookup: no url: " + LookupURLHint)
	}
	return nil
}

// UnmarshalCaddyfile sets up the handler: see unmarshalLookup.
func (h *Lookup) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return unmarshalLookup(d, &h.LookupOptions)
}

// UnmarshalCaddyfile sets up the handler: see unmarshalLookup.
func (h *LookupL4) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return unmarshalLookup(d, &h.LookupOptions)
}

// Interface guards.
var (
	_ caddyfile.Unmarshaler = (*Proxy)(nil)
	_ caddyfile.Unmarshaler = (*Transport)(nil)
	_ caddyfile.Unmarshaler = (*Lookup)(nil)
	_ caddyfile.Unmarshaler = (*LookupL4)(nil)
)
