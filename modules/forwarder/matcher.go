package forwarder

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sync"
	"weak"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

func init() {
	caddy.RegisterModule(new(Matcher))
}

// Matcher matches connections that start with a sandbox preamble (its
// magic bytes), so tunnels can share a listener with other layer4 routes.
// It is a cheap routing test, not a verification: the sandbox handler
// verifies.
//
// The preamble travels inside TLS, so the matcher must see plaintext: put
// it in a subroute after `ktls`, not beside it. In JSON the route is
// `ktls` then `subroute` with a first route matched by `sandbox` that
// handles with `sandbox`, and further routes for the other traffic on the
// same port (which is then never counted as a tunnel rejection):
//
//	route {
//		ktls { ... }
//		subroute {
//			@t sandbox
//			route @t { sandbox { ... } }
//			route { proxy 127.0.0.1:8080 }
//		}
//	}
type Matcher struct{}

// CaddyModule returns the Caddy module information.
func (*Matcher) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxMatcher, New: func() caddy.Module { return new(Matcher) }}
}

// Match reports whether cx starts with the preamble magic.
func (*Matcher) Match(cx *layer4.Connection) (bool, error) {
	buf := make([]byte, len(preamble.Magic))
	if _, err := io.ReadFull(cx, buf); err != nil {
		return false, err
	}
	return string(buf) == preamble.Magic, nil
}

// Provision checks where the matcher is placed. In the same route as a
// TLS-terminating handler (ktls, or caddy-l4's tls) it can never match:
// a route's matchers run before its handlers, on the still-encrypted
// stream, whose first bytes are a TLS ClientHello. That is a load error.
// Where no TLS-terminating handler runs before its route at all (a
// layer4 server's top-level route with no ktls/tls in an enclosing route),
// it matches only a preamble sent in plaintext, which only an
// insecure_plaintext sandbox handler (tests) takes: that is a WARN, not an
// error, since a plaintext preamble can be meant there.
//
// The check reads the raw routes of the matcher's container (a layer4 app
// or a layer4 listener wrapper), as the sandbox handler's own placement
// check does (checkTLSBeforeSandbox): while a matcher provisions, its own
// route and the routes not yet provisioned are still raw JSON.
func (m *Matcher) Provision(ctx caddy.Context) error {
	logger := ctx.Logger(m)
	mods := ctx.Modules() // ..., the container, subroutes, this matcher
	for i := len(mods) - 2; i >= 0; i-- {
		switch c := mods[i].(type) {
		case *layer4.App:
			return checkMatcherApp(c, logger)
		case *layer4.ListenerWrapper:
			if srv, _ := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); srv != nil {
				return checkMatcherListenerWrappers(c, srv.ListenerWrappersRaw, logger)
			}
			return nil
		default:
			if c.CaddyModule().ID != "layer4.handlers.subroute" {
				logger.Debug("sandbox matcher: its route cannot be read at load, its placement is not checked", zap.String("module", string(c.CaddyModule().ID)))
				return nil
			}
		}
	}
	return nil
}

func checkMatcherApp(a *layer4.App, logger *zap.Logger) error {
	return eachLayer4Route(a, func(r *layer4.Route, where string) error {
		sets := make([]map[string]json.RawMessage, 0, len(r.MatcherSetsRaw))
		for _, set := range r.MatcherSetsRaw {
			sets = append(sets, set)
		}
		return checkMatcherRoute(rawRoute{Match: sets, Handle: r.HandlersRaw}, false, where, warnOnce(a, logger))
	})
}

func checkMatcherListenerWrappers(lw *layer4.ListenerWrapper, raws []json.RawMessage, logger *zap.Logger) error {
	return eachWrapperRoute(raws, func(r rawRoute, tlsBefore bool, where string) error {
		return checkMatcherRoute(r, tlsBefore, where, warnOnce(lw, logger))
	})
}

// sandboxMatcherFix is the working shape, in Caddyfile and JSON terms.
const sandboxMatcherFix = "put ktls first and the matcher in a subroute after it: " +
	"route { ktls { ... } subroute { @t sandbox; route @t { sandbox { ... } } } } " +
	`(JSON: "handle": [{"handler": "ktls", ...}, {"handler": "subroute", "routes": [{"match": [{"sandbox": {}}], "handle": [{"handler": "sandbox", ...}]}]}])`

// SandboxMatcherWarning is the WARN for a sandbox matcher that no
// TLS-terminating handler runs before.
const SandboxMatcherWarning = "sandbox matcher reads the still-encrypted stream: no TLS-terminating handler (ktls, tls) runs before its route"

// checkMatcherRoute checks one raw route and its subroutes; tlsBefore says
// whether a TLS-terminating handler runs before the route (in an enclosing
// route, or a listener wrapper).
func checkMatcherRoute(r rawRoute, tlsBefore bool, where string, warn func(where string)) error {
	type head struct {
		Handler           string `json:"handler"`
		InsecurePlaintext bool   `json:"insecure_plaintext"`
	}
	heads := make([]head, len(r.Handle))
	for j, raw := range r.Handle {
		json.Unmarshal(raw, &heads[j]) // a handler that does not decode is Caddy's to report
	}
	if slices.ContainsFunc(r.Match, func(set map[string]json.RawMessage) bool { _, ok := set["sandbox"]; return ok }) {
		if j := slices.IndexFunc(heads, func(h head) bool { return tlsTerminators[h.Handler] }); j >= 0 {
			return fmt.Errorf("sandbox matcher (%s): it is in the same route as the %s handler (handler %d), so it runs before that handler, "+
				"on the still-encrypted stream (a TLS ClientHello), and never matches: %s", where, heads[j].Handler, j, sandboxMatcherFix)
		}
		plaintext := slices.ContainsFunc(heads, func(h head) bool { return h.Handler == "sandbox" && h.InsecurePlaintext })
		if !tlsBefore && !plaintext {
			warn(where)
		}
	}
	for j, h := range heads {
		if tlsTerminators[h.Handler] {
			tlsBefore = true
		}
		if h.Handler != "subroute" {
			continue
		}
		var sub struct {
			Routes []rawRoute `json:"routes"`
		}
		if json.Unmarshal(r.Handle[j], &sub) != nil {
			continue
		}
		for k, sr := range sub.Routes {
			if err := checkMatcherRoute(sr, tlsBefore, fmt.Sprintf("%s, handler %d (subroute), route %d", where, j, k), warn); err != nil {
				return err
			}
		}
	}
	return nil
}

// matcherWarned remembers, per container being loaded, which placements
// were warned about: every sandbox matcher of a load walks the routes
// still raw, and one WARN per placement is enough. Keys hold their
// container weakly, so a finished load's entries go away.
var matcherWarned = struct {
	sync.Mutex
	m map[matcherWarnKey]bool
}{m: map[matcherWarnKey]bool{}}

type matcherWarnKey struct {
	app   weak.Pointer[layer4.App]
	lw    weak.Pointer[layer4.ListenerWrapper]
	where string
}

// warnOnce returns a warn function that logs each placement of container
// once.
func warnOnce[T layer4.App | layer4.ListenerWrapper](container *T, logger *zap.Logger) func(where string) {
	return func(where string) {
		k := matcherWarnKey{where: where}
		switch c := any(container).(type) {
		case *layer4.App:
			k.app = weak.Make(c)
		case *layer4.ListenerWrapper:
			k.lw = weak.Make(c)
		}
		matcherWarned.Lock()
		for old := range matcherWarned.m {
			if old.app.Value() == nil && old.lw.Value() == nil {
				delete(matcherWarned.m, old)
			}
		}
		seen := matcherWarned.m[k]
		matcherWarned.m[k] = true
		matcherWarned.Unlock()
		if !seen {
			logger.Warn(SandboxMatcherWarning, zap.String("where", where), zap.String("fix",
				"the matcher matches only a preamble sent in plaintext (insecure_plaintext, tests only); "+sandboxMatcherFix))
		}
	}
}

// Interface guards.
var (
	_ layer4.ConnMatcher = (*Matcher)(nil)
	_ caddy.Provisioner  = (*Matcher)(nil)
)
