package forwarder

import (
	"encoding/json"
	"fmt"
	"maps"
	"runtime"
	"slices"
	"strings"
	"sync"
	"weak"

	"github.com/caddyserver/caddy/v2"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"
)

// ProxyProtocolWarning is the WARN of a sandbox handler behind caddy-l4's
// proxy_protocol handler that takes any peer's PROXY line.
const ProxyProtocolWarning = "sandbox handler: caddy-l4's proxy_protocol handler before it takes the PROXY header of any peer: " +
	"whoever reaches this port sets the peer address logged for its tunnels and, with proxy_protocol v2 and no signed client identity, " +
	"the source address the sandbox is told"

// ProxyProtocolFix is the fix proxyProtocolWarning names. caddy-l4 (v0.1.2)
// uses the PROXY header of a peer outside `allow` too unless
// fallback_policy is reject: `allow` alone restricts nothing.
const ProxyProtocolFix = "restrict it to your load balancers: proxy_protocol { allow <their CIDRs>; fallback_policy reject } " +
	"(JSON \"allow\" and \"fallback_policy\": \"REJECT\"); `allow` alone does not restrict, caddy-l4 uses the header of a peer outside it too"

// unrestrictedProxy is a proxy_protocol handler that uses any peer's PROXY
// header: the only policy under which caddy-l4 ignores one (it never
// hands its computed policy to the connection) is fallback_policy reject,
// for the peers outside allow.
func unrestrictedProxy(raw json.RawMessage) bool {
	var pp struct {
		FallbackPolicy string `json:"fallback_policy"`
	}
	json.Unmarshal(raw, &pp)
	return !strings.EqualFold(pp.FallbackPolicy, "reject")
}

// proxyProtocolWarned remembers, per layer4 app, the sandbox handlers
// warned about: every sandbox handler's walk sees the routes not yet
// provisioned, those of the handlers after it too, and each is named
// once. The keys are weak and go with their app.
var proxyProtocolWarned = struct {
	sync.Mutex
	m map[weak.Pointer[layer4.App]]map[string]bool
}{m: map[weak.Pointer[layer4.App]]map[string]bool{}}

// warnProxyProtocolBefore warns, once per sandbox handler of a layer4 app,
// of a sandbox handler that an unrestricted caddy-l4 proxy_protocol
// handler may run before: earlier in its route, in a route enclosing it
// (subroute), or in an earlier route of the same list (a route that ends
// without a terminal handler hands its connection on to the next ones).
// It reads the raw routes as checkTLSBeforeSandbox does, so it sees the
// handler's own route and those enclosing it, and the routes after them,
// but not a route that Caddy provisioned before it (its raw handlers are
// gone by then): a proxy_protocol handler belongs in the route of the
// ktls and sandbox handlers it serves. A sandbox handler in a layer4
// listener wrapper is not checked: Caddy's own proxy_protocol listener
// wrapper applies its policy, under which, unless fallback_policy says
// otherwise, no header from outside allow is used.
func warnProxyProtocolBefore(ctx caddy.Context, logger *zap.Logger) {
	var app *layer4.App
	for _, m := range slices.Backward(ctx.Modules()) {
		if a, ok := m.(*layer4.App); ok {
			app = a
			break
		}
	}
	if app == nil {
		return
	}
	var found []string
	for _, name := range slices.Sorted(maps.Keys(app.Servers)) {
		srv := app.Servers[name]
		if srv == nil {
			continue
		}
		var lists [][]json.RawMessage
		for _, r := range srv.Routes {
			if r != nil {
				lists = append(lists, r.HandlersRaw)
			}
		}
		found = append(found, proxiedSandboxes(lists, false, fmt.Sprintf("layer4 server %q", name))...)
	}
	key := weak.Make(app)
	proxyProtocolWarned.Lock()
	defer proxyProtocolWarned.Unlock()
	seen := proxyProtocolWarned.m[key]
	if seen == nil {
		seen = map[string]bool{}
		proxyProtocolWarned.m[key] = seen
		runtime.AddCleanup(app, func(k weak.Pointer[layer4.App]) {
			proxyProtocolWarned.Lock()
			delete(proxyProtocolWarned.m, k)
			proxyProtocolWarned.Unlock()
		}, key)
	}
	for _, where := range found {
		if !seen[where] {
			seen[where] = true
			logger.Warn(ProxyProtocolWarning, zap.String("where", where), zap.String("fix", ProxyProtocolFix))
		}
	}
}

// proxiedSandboxes returns where the sandbox handlers of a route list
// (each route's raw handlers) are that an unrestricted proxy_protocol
// handler may run before; proxied says one runs before the list.
func proxiedSandboxes(routes [][]json.RawMessage, proxied bool, where string) []string {
	var out []string
	for i, handlers := range routes {
		for j, raw := range handlers {
			var head struct {
				Handler string `json:"handler"`
			}
			if json.Unmarshal(raw, &head) != nil {
				continue
			}
			at := fmt.Sprintf("%s, route %d, handler %d", where, i, j)
			switch head.Handler {
			case "proxy_protocol":
				proxied = proxied || unrestrictedProxy(raw)
			case "sandbox":
				if proxied {
					out = append(out, at)
				}
			case "subroute":
				out = append(out, proxiedSandboxes(subrouteHandlers(raw), proxied, at+" (subroute)")...)
			}
		}
	}
	return out
}
