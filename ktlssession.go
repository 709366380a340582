package caddyktls

import (
	"bytes"
	"context"
	"crypto/tls"

	"github.com/caddyserver/caddy/v2"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(new(KTLSSession))
}

// KTLSSession is the caddy-l4 handler `ktls_session`, for the forwarder
// shape where an HTTP server's listener wrappers are `ktls` and then
// `layer4`: put it in the layer4 wrapper's first route,
//
//	listener_wrappers {
//		ktls
//		layer4 {
//			route {
//				ktls_session
//			}
//			@tunnel sandbox
//			route @tunnel {
//				sandbox { ... }
//			}
//		}
//	}
//
// It finishes the TLS handshake of a connection the `ktls` listener wrapper
// accepted and records its session as caddy-l4's `tls` handler does: the
// `tls_connection_states` variable and the {l4.tls.*} placeholders. Two
// things depend on it when connections fall through layer4 to HTTP:
//
//   - caddy-l4 hands HTTP a connection that reports its TLS state
//     (ConnectionState) only when that variable is set; without it Caddy
//     logs "tls is enabled, but listener wrapper returns a connection that
//     doesn't implement connectionStater" at WARN for every connection.
//   - caddy-l4 v0.1.2's listener wrapper keeps using its per-connection
//     state after handing a connection to HTTP: it reads the connection's
//     byte counters for a debug line while HTTP reads (a data race) and
//     returns its read-ahead buffer to a pool that the next connection
//     prefetches into, although HTTP may not have read the bytes in it yet.
//     This handler passes on a connection of its own (its own buffer and
//     counters, the same variables and listener), which caddy-l4's state
//     never touches again.
//
// Connections that did not come through the `ktls` listener wrapper (the
// HTTP port, or no wrapper) pass through unchanged. Placeholders set by
// handlers before it are not carried over: keep it first.
type KTLSSession struct {
	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (*KTLSSession) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleKTLSSession, New: func() caddy.Module { return new(KTLSSession) }}
}

// Provision sets up the handler.
func (s *KTLSSession) Provision(ctx caddy.Context) error {
	s.logger = ctx.Logger(s)
	return nil
}

// Handle records the session of cx and calls next with a connection of its
// own.
func (s *KTLSSession) Handle(cx *layer4.Connection, next layer4.Handler) error {
	w, ok := cx.Conn.(interface{ session() *httpConn })
	if !ok {
		return next.Handle(cx)
	}
	hc := w.session()
	hc.layer4.Store(true)
	if err := hc.handshake(); err != nil {
		// The wrapper's handshake line (debug) and the handshake metrics
		// already report it; returning nil closes the connection quietly,
		// as HTTP would.
		s.logger.Debug("TLS handshake failed", zap.Stringer("remote", cx.RemoteAddr()), zap.Error(err))
		return nil
	}
	state := hc.kc.ConnectionState()
	own := layer4.WrapConnection(cx.Conn, bytes.Clone(cx.MatchingBytes()), cx.Logger)
	vars, _ := cx.Context.Value(layer4.VarsCtxKey).(map[string]any)
	for k, v := range vars {
		own.SetVar(k, v)
	}
	states, _ := own.GetVar(layer4.TLSConnectionStatesVarName).([]*tls.ConnectionState)
	own.SetVar(layer4.TLSConnectionStatesVarName, append(states, &state))
	addTLSPlaceholders(own.Replacer(), &state)
	// cx.Context carries the listener the connection is piped to at the
	// end of the routes (caddy-l4's unexported listenerCtxKey): keep it,
	// with own's variables and replacer in front.
	own.Context = context.WithValue(context.WithValue(cx.Context,
		layer4.VarsCtxKey, own.Context.Value(layer4.VarsCtxKey)),
		layer4.ReplacerCtxKey, own.Replacer())
	return next.Handle(own)
}

// Interface guards.
var (
	_ layer4.NextHandler = (*KTLSSession)(nil)
	_ caddy.Provisioner  = (*KTLSSession)(nil)
)
