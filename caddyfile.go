package caddyktls

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
	"github.com/ktlsingress/caddy-ktls/internal/caddyfileargs"
)

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens: the offload
// options (offload.Options.UnmarshalCaddyfileOption) and connection_policy in caddy-l4's
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
//		max_handshakes <n>|off  # default 128 per CPU: handshakes in progress; beyond, new connections are shed
//		max_scheduling_delay <duration>  # default none: the goroutines' wait for a CPU above which new connections are shed
//		<offload option> ...
//	}
func (h *KTLSHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the handler name
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if handled, err := h.UnmarshalCaddyfileOption(d); handled {
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
			v, err := caddyfileargs.OneOf(d, "on", "off")
			if err != nil {
				return err
			}
			h.DisableResumption = v == "off"
		case "max_handshakes":
			n, err := caddyfileargs.Limit(d)
			if err != nil {
				return err
			}
			h.MaxHandshakes = n
		case "max_scheduling_delay":
			v, err := caddyfileargs.Duration(d)
			if err != nil {
				return err
			}
			h.MaxSchedulingDelay = v
		default:
			return d.Errf("unknown ktls handler option %q", opt)
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the wrapper from Caddyfile tokens: the offload
// options (offload.Options.UnmarshalCaddyfileOption) and sendfile:
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
		if handled, err := lw.UnmarshalCaddyfileOption(d); handled {
			if err != nil {
				return err
			}
			continue
		}
		switch opt := d.Val(); opt {
		case "sendfile":
			if err := caddyfileargs.NoArgs(d); err != nil {
				return err
			}
			lw.Sendfile = true
		default:
			return d.Errf("unknown ktls listener wrapper option %q", opt)
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the handler: `ktls_session`, no arguments.
func (*KTLSSession) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return caddyfileargs.NoArgsOrBlock(d, "ktls_session handler")
}

// Interface guards.
var (
	_ caddyfile.Unmarshaler = (*ListenerWrapper)(nil)
	_ caddyfile.Unmarshaler = (*KTLSHandler)(nil)
	_ caddyfile.Unmarshaler = (*KTLSSession)(nil)
)
