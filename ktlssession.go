package caddyktls

import (
	"bytes"
	"context"
	"crypto/tls"

	"github.com/caddyserver/caddy/v2"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(new(KTLSSession))
}

// KTLSSession is the caddy-l4 handler `ktls_session`, the first route of
// the `layer4` listener wrapper that follows `ktls` in an HTTP server
// (examples/http-forwarder.Caddyfile). It finishes the TLS handshake of a
// connection the `ktls` wrapper accepted, records the session as caddy-l4's
// `tls` handler does (the tls_connection_states variable, {l4.tls.*}), so a
// connection that falls through to HTTP reports its TLS state, and passes on
// a connection of its own, so that caddy-l4's per-connection state, which
// caddy-l4 keeps using after it hands a connection to HTTP
// (docs/compatibility.md), is never shared with HTTP. Connections that did
// not come through the `ktls` wrapper pass through unchanged. Keep it first:
// placeholders set before it are not carried over.
type KTLSSession struct {
	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (*KTLSSession) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.KTLSSession, New: func() caddy.Module { return new(KTLSSession) }}
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
