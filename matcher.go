package caddyktls

import (
	"io"

	"github.com/caddyserver/caddy/v2"
	"github.com/mholt/caddy-l4/layer4"

	"github.com/ktlsingress/caddy-ktls/preamble"
)

func init() {
	caddy.RegisterModule(new(MatchSandbox))
}

// MatchSandbox matches connections that start with a sandbox preamble (its
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
type MatchSandbox struct{}

// CaddyModule returns the Caddy module information.
func (*MatchSandbox) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleSandboxMatcher, New: func() caddy.Module { return new(MatchSandbox) }}
}

// Match reports whether cx starts with the preamble magic.
func (*MatchSandbox) Match(cx *layer4.Connection) (bool, error) {
	buf := make([]byte, len(preamble.Magic))
	if _, err := io.ReadFull(cx, buf); err != nil {
		return false, err
	}
	return string(buf) == preamble.Magic, nil
}

// Interface guards.
var _ layer4.ConnMatcher = (*MatchSandbox)(nil)
