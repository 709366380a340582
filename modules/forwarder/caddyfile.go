package forwarder

import (
	"math"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/dustin/go-humanize"
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
			dur, err := caddyfileargs.Duration(d)
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
			if err := caddyfileargs.NoArgs(d); err != nil {
				return err
			}
			h.RequireChannelBinding = true
		case "insecure_plaintext":
			if err := caddyfileargs.NoArgs(d); err != nil {
				return err
			}
			h.InsecurePlaintext = true
		case "replay_cache_size", "max_tunnels_per_sandbox":
			n, err := caddyfileargs.PositiveInt(d)
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
			dur, err := caddyfileargs.Duration(d)
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
			n, err := caddyfileargs.PositiveInt(d)
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
			dur, err := caddyfileargs.Duration(d)
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
	return caddyfileargs.NoArgsOrBlock(d, "sandbox matcher")
}
