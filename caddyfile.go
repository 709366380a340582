package caddyktls

import (
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
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
//		preamble_timeout   <duration>
//		dial_timeout       <duration>
//		keepalive          <duration>
//		tcp_user_timeout   <duration>
//		allow              <cidr|ip>...      # required; e.g. 10.0.0.0/8; 127.0.0.0/8 opens loopback (demo only)
//		allow_ports        <port|lo-hi>...
//		drain_grace_period <duration>
//		insecure_plaintext                   # tests only: no TLS, no client certificate needed
//		activity_push <url> {
//			interval   <duration>
//			timeout    <duration>
//			attempts   <n>
//			backoff    <duration>
//			queue_size <n>
//			header     <name> <value>   # repeatable; e.g. Authorization "Bearer {env.ACTIVITY_TOKEN}"
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
		case "allow":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			h.AllowCIDRs = append(h.AllowCIDRs, args...)
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
		default:
			return nil, d.Errf("unknown activity_push option %q", opt)
		}
	}
	return p, nil
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

// Interface guards.
var (
	_ caddyfile.Unmarshaler = (*ListenerWrapper)(nil)
	_ caddyfile.Unmarshaler = (*KTLSHandler)(nil)
	_ caddyfile.Unmarshaler = (*KTLSSession)(nil)
	_ caddyfile.Unmarshaler = (*SandboxHandler)(nil)
	_ caddyfile.Unmarshaler = (*MatchSandbox)(nil)
)
