// Package adminapi is what this module's admin API routes share: every
// answer reaches a client that sends its request whole, body and all.
package adminapi

import (
	"io"
	"net/http"

	"github.com/caddyserver/caddy/v2"
)

// MaxDrain bounds what a route reads and drops of a request body its
// handler left unread: net/http's own bound for a body a handler left
// unread, which it skips instead when the request asks for the
// connection's close.
const MaxDrain = 256 << 10

// Route is the admin route pattern served by h. Once h returns, the route
// reads and drops what h left of the request body, up to MaxDrain, before
// the answer ends the connection. A server that closes a socket with bytes
// unread sends a reset, and a client still writing its request then loses
// the answer (a refusal's status and why) to its write's error. A body
// declared longer than MaxDrain is not read: its client may see only the
// reset.
func Route(pattern string, h caddy.AdminHandlerFunc) caddy.AdminRoute {
	return caddy.AdminRoute{Pattern: pattern, Handler: caddy.AdminHandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		defer drain(r)
		return h(w, r)
	})}
}

// drain reads what is left of r's body, up to MaxDrain.
func drain(r *http.Request) {
	if r.ContentLength > MaxDrain {
		return
	}
	io.CopyN(io.Discard, r.Body, MaxDrain)
}
