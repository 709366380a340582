// Package l4conn is what the Caddy modules that end a caddy-l4 route (the
// forwarder's sandbox handler, the gateway's sandbox_proxy) do with the
// connection they are handed: find the socket under caddy-l4's wrappers,
// and read the TLS session that carries it.
package l4conn

import (
	"crypto/tls"
	"net"

	"github.com/ktlsingress/caddy-ktls/splice"
	"github.com/mholt/caddy-l4/layer4"
)

// UserspaceTLSConn is a session crypto/tls carries: caddy-l4's tls
// handler's, or Caddy's own TLS before a layer4 listener wrapper. Its
// Abort (splice.Aborter) ends the session of a refused or failed tunnel
// with a TCP reset on the socket under it, never through tls.Conn.Close,
// whose close_notify the gateway would read as an orderly end. splice.Abort
// alone cannot reach that socket where caddy-l4's Connection, which has no
// NetConn, lies between (the tls handler runs over one).
type UserspaceTLSConn struct{ *tls.Conn }

// Abort resets the connection under the session.
func (c UserspaceTLSConn) Abort() error {
	inner := c.NetConn()
	for {
		lc, ok := inner.(*layer4.Connection)
		if !ok {
			break
		}
		inner = lc.Conn
	}
	splice.Abort(inner)
	return nil
}

// TLSState returns the TLS session that carries cx: the one the layer4
// ktls (or tls) handler recorded, or, when the connection came through the
// HTTP server's `listener_wrappers { ktls; layer4 {...} }` (where caddy-l4
// records no TLS state), the one the wrapped connection itself reports.
func TLSState(cx *layer4.Connection) (tls.ConnectionState, bool) {
	if states, ok := cx.GetVar(layer4.TLSConnectionStatesVarName).([]*tls.ConnectionState); ok && len(states) > 0 {
		return *states[len(states)-1], true
	}
	if sc, ok := cx.Conn.(interface{ ConnectionState() tls.ConnectionState }); ok {
		return sc.ConnectionState(), true
	}
	return tls.ConnectionState{}, false
}

// Unwrap returns the connection a terminal handler relays from cx (the
// one under caddy-l4's read-ahead buffer, so that splice reaches the
// socket) and the bytes that buffer holds, which go first.
func Unwrap(cx *layer4.Connection) (net.Conn, []byte) {
	conn := cx.Conn
	if tc, ok := conn.(*tls.Conn); ok {
		conn = UserspaceTLSConn{tc}
	}
	return conn, append([]byte(nil), cx.MatchingBytes()...)
}
