// Package upgrade is the Caddy glue that the features share for a binary
// upgrade without dropping a tunnel (the sandbox_handoff app,
// modules/handoff): the load check of the listeners that serve a moving
// handler, and the registry of what the features move (the process state,
// the participants' objects).
package upgrade

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/listensock"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
)

// A process that takes over serves tunnels only once it holds the running
// process's state (the sandbox_handoff app's takeTunnels): its tcp-handoff
// listeners, taken from the running process, wait until then. Any other
// listener that serves a sandbox handler (or, in a gateway, a
// sandbox_proxy handler: the same goes for it) is bound afresh by the new process (a tcp or tcp-retry
// address: a second SO_REUSEPORT socket), or not handed over at all (a
// unix socket, fd/), and accepts as soon as the new configuration runs: a
// tunnel it opens there stands outside the report stream the process
// takes over, which then fails the upgrade. So with sandbox_handoff
// configured, every listen address of a server whose routes hold a sandbox
// handler must be a tcp-handoff/ address, and a configuration with another
// one does not load.
//
// The servers checked are those of the container the handler provisions
// in (ctx.Modules), as checkTLSBeforeSandbox finds it:
//
//   - a layer4 app: each server whose raw routes, read as checkTLSBeforeSandbox
//     reads them, hold a sandbox handler anywhere (in a subroute, a tee
//     branch or any other handler's JSON). The raw routes of the handler's
//     own server are among them; a server already provisioned has been
//     checked by its own sandbox handlers. A server without a sandbox
//     handler may listen anywhere: an upgrade binds it afresh beside the
//     running process's.
//   - a layer4 listener wrapper of an HTTP server: every address that
//     server listens on, as each connection it accepts goes through its
//     listener wrappers.
//
// Anywhere else the listeners are not known at load: it warns.

// The handlers whose listeners CheckListeners checks: layer4 handler names.
const (
	HandlerSandbox      = "sandbox"       // the forwarder's
	HandlerSandboxProxy = "sandbox_proxy" // the edge gateway's
)

// CheckListeners fails when sandbox_handoff is configured and a listener
// that serves handler (HandlerSandbox, HandlerSandboxProxy), provisioning
// with ctx, is no tcp-handoff/ address.
func CheckListeners(ctx caddy.Context, logger *zap.Logger, handler string) error {
	// This loads the sandbox_handoff app if it is configured and not
	// loaded yet, before any server listens, as its Provision needs; an
	// error loading it fails this configuration all the same.
	if _, err := ctx.AppIfConfigured(moduleid.SandboxHandoff); errors.Is(err, caddy.ErrNotConfigured) {
		return nil
	}
	mods := ctx.Modules() // ..., the container, ..., this handler
	for i := len(mods) - 2; i >= 0; i-- {
		switch m := mods[i].(type) {
		case *layer4.App:
			return checkLayer4Listeners(m, handler)
		case *layer4.ListenerWrapper:
			srv, _ := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
			if srv == nil {
				break
			}
			for _, addr := range srv.Listen {
				if err := listenerError(fmt.Sprintf("http server %q (a layer4 listener wrapper)", httpServerName(mods[:i], srv)), handler, addr); err != nil {
					return err
				}
			}
			return nil
		}
	}
	logger.Warn(ListenersNotVisibleWarning)
	return nil
}

// ListenersNotVisibleWarning is logged at load by a handler whose
// listeners CheckListeners cannot find.
const ListenersNotVisibleWarning = "sandbox_handoff: cannot check at load that the listeners serving this sandbox handler are tcp-handoff/ addresses; " +
	"an upgrade fails if one of them is not"

// checkLayer4Listeners checks the listen addresses of a's servers whose
// raw routes hold handler, in server-name order.
func checkLayer4Listeners(a *layer4.App, handler string) error {
	for _, name := range slices.Sorted(maps.Keys(a.Servers)) {
		srv := a.Servers[name]
		if srv == nil || !slices.ContainsFunc(srv.Routes, func(r *layer4.Route) bool {
			return r != nil && slices.ContainsFunc(r.HandlersRaw, func(raw json.RawMessage) bool { return holds(raw, handler) })
		}) {
			continue
		}
		repl := caddy.NewReplacer() // as caddy-l4 reads a listen address
		for _, addr := range srv.Listen {
			if err := listenerError(fmt.Sprintf("layer4 server %q", name), handler, repl.ReplaceAll(addr, "")); err != nil {
				return err
			}
		}
	}
	return nil
}

// holds reports whether raw, a handler's JSON, is handler or holds one at
// any depth.
func holds(raw json.RawMessage, handler string) bool {
	var v any
	if json.Unmarshal(raw, &v) != nil {
		return false // not this handler's: Caddy reports it
	}
	var walk func(v any) bool
	walk = func(v any) bool {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == handler {
				return true
			}
			for _, e := range v {
				if walk(e) {
					return true
				}
			}
		case []any:
			return slices.ContainsFunc(v, walk)
		}
		return false
	}
	return walk(v)
}

// httpServerName returns the name under which the HTTP app among mods
// holds srv.
func httpServerName(mods []caddy.Module, srv *caddyhttp.Server) string {
	for _, m := range mods {
		if app, ok := m.(*caddyhttp.App); ok {
			for name, s := range app.Servers {
				if s == srv {
					return name
				}
			}
		}
	}
	return "?"
}

// listenerError returns the load error for addr, a listen address of
// server (as the error names it) that serves handler, unless it is a
// tcp-handoff/ address. An address that does not parse is left to the
// server, which refuses it.
func listenerError(server, handler, addr string) error {
	network, host, port, err := caddy.SplitNetworkAddress(addr)
	if err != nil || network == listensock.Network {
		return nil
	}
	fix := "a " + listensock.Network + "/<host>:<port> address"
	switch network {
	case "", "tcp", "tcp4", "tcp6", listensock.RetryNetwork:
		fix = listensock.Network + "/" + caddy.JoinNetworkAddress("", host, port)
	}
	return fmt.Errorf("sandbox_handoff: %s serves the %s handler on %q, which is no %s/ address: "+
		"the new process of an upgrade would accept there and open tunnels before it holds the running process's state, "+
		"and the upgrade would fail; listen on %s", server, handler, addr, listensock.Network, fix)
}
