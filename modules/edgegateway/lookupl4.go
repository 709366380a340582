package edgegateway

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/ktlsingress/caddy-ktls/internal/l4conn"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/splice"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(new(LookupL4))
}

// LookupL4 is the layer4 sandbox_lookup handler: it finds the
// sandbox a connection is for through the control plane, as the HTTP
// sandbox_lookup does, and sets the placeholders {l4.sandbox.id},
// {l4.sandbox.forwarder} and {l4.sandbox.target} for the sandbox_proxy
// after it; {l4.sandbox.id} is the lowercase form of the ID (sandbox IDs
// are case-insensitive). A failed lookup refuses the connection
// (access_denied on a kTLS session) with the reason in the log.
type LookupL4 struct {
	// The sandbox to look up and how the control plane is asked
	// (LookupOptions), at the top level of the JSON.
	LookupOptions
}

// The placeholders the layer4 lookup sets.
const l4LookupPrefix = layer4.AppReplPrefix + "sandbox."

// CaddyModule returns the Caddy module information.
func (*LookupL4) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxLookupL4, New: func() caddy.Module { return new(LookupL4) }}
}

// Provision sets up the handler.
func (h *LookupL4) Provision(ctx caddy.Context) error {
	return h.provision(ctx, moduleid.SandboxLookupL4, ctx.Logger(h))
}

// Handle looks the connection's sandbox up and sets its placeholders.
func (h *LookupL4) Handle(cx *layer4.Connection, next layer4.Handler) error {
	repl := cx.Replacer()
	sandbox := repl.ReplaceAll(h.Sandbox, "")
	loc, err := resolve(cx.Context, h.lookup, moduleid.SandboxLookupL4, sandbox, h.logger, zap.String("peer", cx.RemoteAddr().String()))
	if err != nil {
		user, _ := l4conn.Unwrap(cx)
		splice.Refuse(user)
		return nil
	}
	repl.Set(l4LookupPrefix+"id", loc.Sandbox)
	repl.Set(l4LookupPrefix+"forwarder", loc.Forwarder)
	repl.Set(l4LookupPrefix+"target", loc.Target.String())
	return next.Handle(cx)
}

// Interface guards.
var (
	_ layer4.NextHandler = (*LookupL4)(nil)
	_ caddy.Provisioner  = (*LookupL4)(nil)
	_ caddy.Validator    = (*LookupL4)(nil)
)
