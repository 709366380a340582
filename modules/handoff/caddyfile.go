package handoff

import (
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/ktlsingress/caddy-ktls/internal/caddyfileargs"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("sandbox_handoff", parseHandoffOption)
}

// parseHandoffOption reads the sandbox_handoff global option into the
// app of that name:
//
//	{
//		sandbox_handoff <socket> {
//			timeout <duration>   # default 5s: each wait for the other process
//		}
//	}
func parseHandoffOption(d *caddyfile.Dispenser, _ any) (any, error) {
	h := new(Handoff)
	d.Next() // the option's name
	if !d.NextArg() {
		return nil, d.Errf("sandbox_handoff needs the socket's path, e.g. sandbox_handoff /run/caddy/sandbox-handoff.sock")
	}
	h.Socket = d.Val()
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for d.NextBlock(0) {
		switch opt := d.Val(); opt {
		case "timeout":
			t, err := caddyfileargs.Duration(d)
			if err != nil {
				return nil, err
			}
			h.Timeout = t
		default:
			return nil, d.Errf("unknown sandbox_handoff option %q", opt)
		}
	}
	return httpcaddyfile.App{Name: moduleid.SandboxHandoff, Value: caddyconfig.JSON(h, nil)}, nil
}
