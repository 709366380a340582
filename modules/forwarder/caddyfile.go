package forwarder

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/ktlsingress/caddy-ktls/internal/caddyfileargs"
)

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
//		max_dials          <n>|off           # default 1024: tunnels dialing or waking their target at once
//		standby            on|off            # default on: gateways' standby connections wait standby_timeout
//		standby_timeout    <duration>        # default 60s: for a standby connection's first preamble byte
//		max_standby_per_client <n>           # default 64
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
//		max_bandwidth {                    # per sandbox, each direction capped on its own (unmarshalBandwidth)
//			to_sandbox   <rate>
//			from_sandbox <rate>
//			burst        <size>
//		}
//		wake <url> {                       # wake a sandbox whose target does not answer (unmarshalWake)
//			header          <name> <value>
//			timeout         <duration>
//			request_timeout <duration>
//		}
//	}
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the handler name
	if d.NextArg() {
		return d.ArgErr()
	}
	args := caddyfileargs.Table{
		Durations: map[string]*caddy.Duration{
			"max_clock_skew": &h.MaxClockSkew, "max_preamble_ttl": &h.MaxPreambleTTL,
			"preamble_timeout": &h.PreambleTimeout, "dial_timeout": &h.DialTimeout,
			"keepalive": &h.KeepAlive, "tcp_user_timeout": &h.TCPUserTimeout,
			"drain_grace_period": &h.DrainGracePeriod, "max_tunnel_lifetime": &h.MaxTunnelLifetime,
			"standby_timeout": &h.StandbyTimeout,
		},
		Ints: map[string]*int{"replay_cache_size": &h.ReplayCacheSize, "max_tunnels_per_sandbox": &h.MaxTunnelsPerSandbox,
			"max_standby_per_client": &h.MaxStandbyPerClient},
		Flags: map[string]*bool{"require_channel_binding": &h.RequireChannelBinding, "insecure_plaintext": &h.InsecurePlaintext},
		Lists: map[string]*[]string{"key_file": &h.KeyFiles, "allow": &h.AllowCIDRs, "nat64_prefix": &h.NAT64Prefixes, "allow_ports": &h.AllowPorts},
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := args.Read(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		opt := d.Val()
		switch opt {
		case "max_dials":
			n, err := caddyfileargs.Limit(d)
			if err != nil {
				return err
			}
			h.MaxDials = n
		case "standby":
			v, err := caddyfileargs.OneOf(d, "on", "off")
			if err != nil {
				return err
			}
			h.DisableStandby = v == "off"
		case "key":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("key takes a key ID and a base64 Ed25519 public key, got %d arguments", len(args))
			}
			h.Keys = append(h.Keys, Key{ID: args[0], PublicKey: args[1]})
		case "key_clients":
			args := d.RemainingArgs()
			if len(args) < 2 {
				return d.Errf("key_clients takes a key ID and one or more client names, got %d arguments", len(args))
			}
			if h.KeyClients == nil {
				h.KeyClients = map[string][]string{}
			}
			h.KeyClients[args[0]] = append(h.KeyClients[args[0]], args[1:]...)
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
	p := new(ActivityPush)
	args := caddyfileargs.Table{
		Strings:   map[string]*string{"instance": &p.Instance},
		Durations: map[string]*caddy.Duration{"interval": &p.Interval, "timeout": &p.Timeout, "backoff": &p.Backoff},
		Ints:      map[string]*int{"attempts": &p.Attempts, "queue_size": &p.QueueSize},
	}
	err := caddyfileargs.Endpoint(d, &p.URL, &p.Headers, func(opt string) error {
		if handled, err := args.Read(d); handled {
			return err
		}
		return d.Errf("unknown activity_push option %q", opt)
	})
	return p, err
}

// unmarshalBandwidth reads the sandbox handler's max_bandwidth option, in
// bytes per second (sizes as `10MB`, `512KiB` or a number of bytes):
//
//	max_bandwidth {
//		to_sandbox   <rate>
//		from_sandbox <rate>
//		burst        <size>   # default: a tenth of a second's worth, at least 64KiB
//	}
func unmarshalBandwidth(d *caddyfile.Dispenser) (*Bandwidth, error) {
	if d.NextArg() {
		return nil, d.Errf("max_bandwidth %[1]s: max_bandwidth takes a block, not a rate: put `to_sandbox %[1]s` and `from_sandbox %[1]s` "+
			"(bytes per second, each direction capped on its own) on lines of their own inside max_bandwidth { }", d.Val())
	}
	b := new(Bandwidth)
	args := caddyfileargs.Table{Sizes: map[string]*int64{"to_sandbox": &b.ToSandbox, "from_sandbox": &b.FromSandbox, "burst": &b.Burst}}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := args.Read(d); !handled {
			return nil, d.Errf("unknown max_bandwidth option %q", d.Val())
		} else if err != nil {
			return nil, err
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
func unmarshalWake(d *caddyfile.Dispenser) (*Wake, error) {
	w := new(Wake)
	args := caddyfileargs.Table{Durations: map[string]*caddy.Duration{"timeout": &w.Timeout, "request_timeout": &w.RequestTimeout}}
	err := caddyfileargs.Endpoint(d, &w.URL, &w.Headers, func(opt string) error {
		if handled, err := args.Read(d); handled {
			return err
		}
		return d.Errf("unknown wake option %q", opt)
	})
	return w, err
}

// UnmarshalCaddyfile sets up the matcher: `sandbox`, no arguments.
func (m *Matcher) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return caddyfileargs.NoArgsOrBlock(d, "sandbox matcher")
}

// Interface guards.
var (
	_ caddyfile.Unmarshaler = (*Handler)(nil)
	_ caddyfile.Unmarshaler = (*Matcher)(nil)
)
