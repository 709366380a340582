package caddyktls

import (
	"errors"
	"io"
	"net"
	"strings"

	"golang.org/x/net/http2"
)

// prefaceGate makes a connection's first bytes agree with the protocol its
// TLS handshake negotiated (ALPN), before net/http reads any of them, as
// they must agree for stock Caddy:
//
//   - net/http serves a *tls.Conn that negotiated h2 with its HTTP/2
//     server, which closes a connection that does not open with the client
//     preface; and it serves every other *tls.Conn as HTTP/1.
//   - A listener wrapper's connection is not a *tls.Conn, so Caddy serves
//     it as HTTP/2 whenever it opens with the preface (as h2c), and as
//     HTTP/1 otherwise, whatever ALPN said.
//
// The gate therefore closes (reads io.EOF on) a connection that negotiated
// h2 and does not open with the preface, and one that did not negotiate h2
// and does: RFC 9113 §3.2 allows HTTP/2 over TLS only through ALPN. (Stock
// Caddy reads the latter as an HTTP/1.1 request with method PRI, which no
// handler serves; docs/compatibility.md.) The bytes it reads to decide are
// then returned first, unchanged.
type prefaceGate struct {
	h2      bool // the handshake negotiated h2
	decided bool
	closed  bool
	buf     [len(http2.ClientPreface)]byte
	head    []byte // read to decide, not yet returned
	err     error  // the read error that ended head, returned after it
}

// read reads through the gate from r.
func (g *prefaceGate) read(r io.Reader, p []byte) (int, error) {
	if !g.decided {
		if err := g.decide(r); err != nil {
			return 0, err
		}
	}
	switch {
	case g.closed:
		return 0, io.EOF
	case len(g.head) > 0:
		n := copy(p, g.head)
		g.head = g.head[n:]
		return n, nil
	case g.err != nil:
		err := g.err
		g.err = nil
		return 0, err
	}
	return r.Read(p)
}

// decide reads until the first bytes are the preface, differ from it, or
// end. A timeout leaves it undecided, with what it read kept.
func (g *prefaceGate) decide(r io.Reader) error {
	var err error
	n := len(g.head)
	for n < len(g.buf) && strings.HasPrefix(http2.ClientPreface, string(g.buf[:n])) {
		var m int
		m, err = r.Read(g.buf[n:])
		n += m
		if err != nil {
			break
		}
	}
	g.head = g.buf[:n]
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return err
	}
	g.decided = true
	// A connection that ends before the whole preface is not HTTP/2 (the
	// HTTP/2 server reads a bogus greeting), and HTTP/1 reads what it sent.
	g.closed = (string(g.head) == http2.ClientPreface) != g.h2
	g.err = err
	return nil
}

// pending reports whether reads still go through the gate's state rather
// than straight to the connection.
func (g *prefaceGate) pending() bool {
	return !g.decided || g.closed || len(g.head) > 0 || g.err != nil
}
