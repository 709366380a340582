package gateway

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// tunnelConn is one pooled tunnel. It reports how the tunnel ended once
// it is closed and no request on it is still in flight, so that what a
// request saw (a response cut short is visible only to the HTTP layer)
// counts even when the HTTP transport closes the tunnel first: it does
// so as soon as a body read fails, while the error is still on its way
// to the reader. Otherwise the tunnel's first read error says.
//
// Its dial is reported open once the forwarder is known to have taken the
// gateway's certificate, which with TLS 1.3 only what the tunnel reads
// tells: its first byte, or a first read error other than the
// forwarder's refusal of the certificate (CertificateAlert), or its
// close. A refusal read before any byte makes the tunnel one that could
// not be opened: reported as a failed dial, with no end.
type tunnelConn struct {
	net.Conn
	pool       *Pool // its callbacks and Dialer; nil: nothing to report or classify
	route      Route
	readErr    atomic.Pointer[error]
	readFailed chan struct{} // closed at the first read error
	readMu     sync.Mutex    // held by Read, and by a failed Write's read
	pending    []byte        // read by a failed Write, for the next Read
	read       atomic.Bool   // a byte came from the forwarder
	state      atomic.Int32  // tunnelDialing, tunnelOpen or tunnelRefused
	refused    *DialError

	mu       sync.Mutex
	end      End // the first refused or failed end a request saw
	inFlight int // requests between GotConn and their done
	closed   bool
	counted  bool
}

func newTunnelConn(conn net.Conn, p *Pool, r Route) *tunnelConn {
	return &tunnelConn{Conn: conn, pool: p, route: r, readFailed: make(chan struct{})}
}

// The states of a tunnelConn's dial.
const (
	tunnelDialing int32 = iota // nothing read yet
	tunnelOpen                 // reported open
	tunnelRefused              // the forwarder refused the certificate
)

// refusalWait bounds how long a request that failed on a tunnel from
// which nothing was read waits for the tunnel's read to say whether the
// forwarder refused the certificate: a write that met the reset after
// the refusal fails first.
const refusalWait = 100 * time.Millisecond

// begin marks a request in flight on the tunnel.
func (c *tunnelConn) begin() {
	c.mu.Lock()
	c.inFlight++
	c.mu.Unlock()
}

// done ends a request begun on the tunnel, with how it saw the tunnel
// end: refused or failed, or EndClosed for nothing to say. The first
// refused or failed end is the tunnel's. Nil-safe.
func (c *tunnelConn) done(e End) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e != EndClosed && c.end == "" {
		c.end = e
	}
	c.inFlight--
	c.countLocked()
}

func (c *tunnelConn) Read(p []byte) (int, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	n, err := c.Conn.Read(p)
	c.observe(n, err)
	return n, err
}

// observe takes note of what a read from the tunnel gave: its first byte
// opens the tunnel; its first error is the tunnel's, and the forwarder's
// refusal of the certificate before any byte makes it a failed dial.
func (c *tunnelConn) observe(n int, err error) {
	if n > 0 && !c.read.Load() {
		c.read.Store(true)
		c.open()
	}
	if err == nil || !c.readErr.CompareAndSwap(nil, &err) {
		return
	}
	if d := c.dialer(); d != nil {
		if de := d.CertificateRefusal(c.route, err); de != nil && !c.read.Load() && c.state.Load() == tunnelDialing {
			c.refused = de // published by the state's store
		}
	}
	if c.refused != nil && c.state.CompareAndSwap(tunnelDialing, tunnelRefused) {
		if c.pool.cfg.OnDial != nil {
			c.pool.cfg.OnDial(c.route, nil, c.refused)
		}
	}
	close(c.readFailed)
}

func (c *tunnelConn) dialer() *Dialer {
	if c.pool == nil {
		return nil
	}
	return c.pool.cfg.Dialer
}

// Write writes to the tunnel. A write that fails before anything was read
// from the tunnel looks, for at most refusalWait, for what the forwarder
// sent before the reset that failed it: its refusal of the certificate.
// The HTTP transport closes the tunnel as soon as the write fails, which
// would leave the refusal unread. HTTP/1.1 reads every tunnel all along:
// its reader meets the refusal, and the write waits for it. HTTP/2 writes
// its preface before it reads: the write reads it itself, and keeps what
// it read for the next Read. A write that met the refusal returns it.
func (c *tunnelConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err == nil || c.dialer() == nil || c.read.Load() {
		return n, err
	}
	if !c.readMu.TryLock() {
		select {
		case <-c.readFailed:
		case <-time.After(refusalWait):
		}
		return n, c.writeErr(err)
	}
	defer c.readMu.Unlock()
	if c.readErr.Load() != nil || len(c.pending) > 0 {
		return n, c.writeErr(err)
	}
	c.Conn.SetReadDeadline(time.Now().Add(refusalWait))
	buf := make([]byte, 512)
	m, rerr := c.Conn.Read(buf)
	c.Conn.SetReadDeadline(time.Time{})
	c.pending = buf[:m]
	if errors.Is(rerr, os.ErrDeadlineExceeded) {
		rerr = nil // nothing came: the next Read says how the tunnel ends
	}
	c.observe(m, rerr)
	return n, c.writeErr(err)
}

// writeErr is the error a failed Write returns: the forwarder's refusal
// of the certificate (a *DialError) when the tunnel met it, which the
// HTTP/2 transport returns as its connection's failure, else err.
func (c *tunnelConn) writeErr(err error) error {
	if c.state.Load() == tunnelRefused {
		return c.refused
	}
	return err
}

// open reports the tunnel's dial open, once, unless it was refused. A
// tunnel is reported with its *ktls.Conn, which every tunnel the Pool
// dials is.
func (c *tunnelConn) open() {
	if !c.state.CompareAndSwap(tunnelDialing, tunnelOpen) || c.pool == nil || c.pool.cfg.OnDial == nil {
		return
	}
	if kc, ok := c.Conn.(*ktls.Conn); ok {
		c.pool.cfg.OnDial(c.route, kc, nil)
	}
}

// refusal returns the forwarder's refusal of the gateway's certificate
// when the tunnel met one before its first byte, nil otherwise. Nil-safe.
func (c *tunnelConn) refusal() *DialError {
	if c == nil || c.read.Load() {
		return nil
	}
	select {
	case <-c.readFailed:
	case <-time.After(refusalWait):
	}
	if c.state.Load() == tunnelRefused {
		return c.refused
	}
	return nil
}

func (c *tunnelConn) Close() error {
	c.mu.Lock()
	c.closed = true
	c.countLocked()
	c.mu.Unlock()
	return c.Conn.Close()
}

// countLocked reports the tunnel's end once it is closed and no request
// is in flight on it. c.mu is held.
func (c *tunnelConn) countLocked() {
	if !c.closed || c.inFlight > 0 || c.counted {
		return
	}
	c.counted = true
	if c.state.Load() == tunnelRefused {
		return // never opened: reported as a failed dial
	}
	c.open()
	end := c.end
	if end == "" {
		var err error
		if p := c.readErr.Load(); p != nil {
			err = *p
		}
		end = EndOf(err)
		if err != nil && errors.Is(err, net.ErrClosed) {
			end = EndClosed // closed by us, idle
		}
	}
	if c.pool != nil && c.pool.cfg.OnEnd != nil {
		c.pool.cfg.OnEnd(c.route, end)
	}
}

// countingBody counts the request body bytes the transport read.
type countingBody struct {
	io.ReadCloser
	n atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

// failureBody reports a response cut short by the tunnel's failure; the
// request is done on its tunnel at the body's first error or close.
type failureBody struct {
	io.ReadCloser
	pool   *Pool
	route  Route
	req    *http.Request
	tunnel *tunnelConn
	once   sync.Once
}

func (b *failureBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		end := EndClosed
		if EndOf(err) != EndClosed {
			end = EndFailed
		}
		b.once.Do(func() {
			if end == EndFailed {
				b.pool.failure(Failure{Route: b.route, Request: b.req, End: EndFailed, MidResponse: true, Err: err})
			}
			b.tunnel.done(end)
		})
	}
	return n, err
}

func (b *failureBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(func() { b.tunnel.done(EndClosed) })
	return err
}
