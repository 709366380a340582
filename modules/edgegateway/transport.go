package edgegateway

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

func init() {
	caddy.RegisterModule(new(SandboxTransport))
}

// SandboxTransport is the edge gateway for HTTP: a reverse_proxy transport
// whose upstream is the forwarder on the sandbox's host. Each new upstream
// connection is a tunnel: mutual TLS to the forwarder (kernel TLS where it
// can), a signed preamble naming the sandbox and its target, then HTTP/1.1
// or h2c to the sandbox's app on it. WebSocket upgrades, streams and server-
// sent events pass as reverse_proxy passes them (flush_interval -1 for
// unbuffered streaming).
//
// Idle connections are pooled per route (forwarder, sandbox, target) and
// never shared between routes, so a connection opened for one sandbox
// never carries another's request.
//
// A forwarder's refusal (access_denied: nothing reached the sandbox) is a
// 502, logged as a refusal, and retried by reverse_proxy's load balancing
// where the request's body was not yet read (as a dial error is); a
// failure after the tunnel opened (internal_error, a reset) is logged as
// a failure and retried only as reverse_proxy retries any such error (GET
// by default, never a non-idempotent method unless retry_match says so).
type SandboxTransport struct {
	// Sandbox is the sandbox ID the preambles name; placeholders are
	// replaced per request: e.g. {http.request.host.labels.2}, or a var
	// set by `map`. Sandbox IDs are case-insensitive: the preambles (and
	// the route the tunnels are pooled by) name the lowercase form, and a
	// request whose ID is not valid even lowercased ("..", ".a") fails
	// (502) before anything is dialed.
	Sandbox string `json:"sandbox,omitempty"`

	// Target is the sandbox app's private IP address and port; placeholders
	// are replaced per request.
	Target string `json:"target,omitempty"`

	// Versions is the HTTP version spoken to the sandbox app: "1.1"
	// (default) or "h2c" (HTTP/2 with prior knowledge: gRPC).
	Versions []string `json:"versions,omitempty"`

	// MaxIdleConnsPerRoute is how many idle connections each route keeps.
	// Default: 8.
	MaxIdleConnsPerRoute int `json:"max_idle_conns_per_route,omitempty"`

	// MaxConnsPerRoute caps the connections of one route, idle or not (a
	// request waits for one). Default: 0, no cap.
	MaxConnsPerRoute int `json:"max_conns_per_route,omitempty"`

	// IdleTimeout closes a pooled connection idle this long. Default: 2m.
	IdleTimeout caddy.Duration `json:"idle_timeout,omitempty"`

	// MaxRoutes bounds how many routes keep a pool; beyond it the least
	// recently used route's idle connections are closed. Default: 4096.
	MaxRoutes int `json:"max_routes,omitempty"`

	// SendClient signs the request's client into each preamble: its
	// remote address (the peer of the user's connection to this server)
	// and, with ClientID, an identity string (the client identity
	// extension, docs/preamble.md §3.1; a forwarder with proxy_protocol v2
	// hands both to the target). A tunnel carries one preamble, so with it
	// on the route of a request includes its client: connections are
	// pooled per user connection (and identity), never lent to another
	// user, which costs the pooling across users. Default: off.
	SendClient bool `json:"send_client,omitempty"`

	// ClientID is the identity string signed with the client's address
	// when SendClient is on; placeholders are replaced per request, e.g.
	// {http.request.header.X-User} or {http.auth.user.id}; an empty result
	// sends the address alone. At most 255 bytes of UTF-8 without control
	// characters: a request whose value breaks that fails (502) before
	// anything is dialed.
	ClientID string `json:"client_id,omitempty"`

	// How forwarders are reached (GatewayDial), at the top level of the
	// JSON.
	GatewayDial

	logger *zap.Logger
	dialer *gateway.Dialer
	pools  *routePools
}

// The SandboxTransport defaults.
const (
	defaultMaxIdleConnsPerRoute = 8
	defaultRouteIdleTimeout     = 2 * time.Minute
	defaultMaxRoutes            = 4096
)

// CaddyModule returns the Caddy module information.
func (*SandboxTransport) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxTransport, New: func() caddy.Module { return new(SandboxTransport) }}
}

// Validate checks the configuration without loading anything.
func (t *SandboxTransport) Validate() error {
	if t.Sandbox == "" || t.Target == "" {
		return errors.New("sandbox transport: sandbox and target are required (placeholders allowed)")
	}
	if err := checkSandboxOption("sandbox transport", t.Sandbox, "{http.request.host.labels.2}"); err != nil {
		return err
	}
	if err := checkTargetOption("sandbox transport", t.Target); err != nil {
		return err
	}
	if len(t.Versions) > 1 || (len(t.Versions) == 1 && t.Versions[0] != "1.1" && t.Versions[0] != "h2c") {
		return fmt.Errorf("sandbox transport: versions %q: want one of 1.1, h2c", t.Versions)
	}
	if t.MaxIdleConnsPerRoute < 0 || t.MaxConnsPerRoute < 0 || t.MaxRoutes < 0 || t.IdleTimeout < 0 {
		return errors.New("sandbox transport: max_idle_conns_per_route, max_conns_per_route, max_routes and idle_timeout must not be negative")
	}
	if t.ClientID != "" && !t.SendClient {
		return errors.New("sandbox transport: client_id needs send_client: the identity travels with the client's address")
	}
	if err := t.GatewayDial.validate(); err != nil {
		return fmt.Errorf("sandbox transport: %w", err)
	}
	return nil
}

// EnableH2C makes the transport speak h2c, for upstreams written h2c://.
func (t *SandboxTransport) EnableH2C() error {
	t.Versions = []string{"h2c"}
	return nil
}

// Provision sets up the transport.
func (t *SandboxTransport) Provision(ctx caddy.Context) error {
	t.logger = ctx.Logger(t)
	if err := caddymetrics.Register(ctx, moduleid.SandboxTransport); err != nil {
		return err
	}
	if err := t.Validate(); err != nil {
		return err
	}
	d, err := t.GatewayDial.dialer(ctx, moduleid.SandboxTransport, t.logger)
	if err != nil {
		return fmt.Errorf("sandbox transport: %w", err)
	}
	t.dialer = d
	if t.MaxIdleConnsPerRoute == 0 {
		t.MaxIdleConnsPerRoute = defaultMaxIdleConnsPerRoute
	}
	if t.IdleTimeout == 0 {
		t.IdleTimeout = caddy.Duration(defaultRouteIdleTimeout)
	}
	if t.MaxRoutes == 0 {
		t.MaxRoutes = defaultMaxRoutes
	}
	t.pools = &routePools{max: t.MaxRoutes, index: map[gateway.Route]*list.Element{}, lru: list.New(), newTransport: t.routeTransport}
	t.GatewayDial.logStart(ctx, moduleid.SandboxTransport, t.logger)
	warnUntrustedClientID(t.logger, t.ClientID, ClientIDFixHTTP)
	return nil
}

// Cleanup closes the idle connections of every route.
func (t *SandboxTransport) Cleanup() error {
	if t.pools != nil {
		t.pools.closeIdle()
	}
	return nil
}

// RoundTrip sends req to the sandbox its placeholders name, through the
// forwarder reverse_proxy chose (req.URL.Host).
func (t *SandboxTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	repl, _ := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	route, err := gateway.ParseRoute(req.URL.Host, repl.ReplaceAll(t.Sandbox, ""), repl.ReplaceAll(t.Target, ""))
	if err != nil {
		GatewayDials.WithLabelValues(moduleid.SandboxTransport, gatewayDialNoRoute).Inc()
		t.logger.Warn("sandbox transport: no route for the request", zap.String("uri", req.RequestURI), zap.Error(err))
		return nil, err
	}
	if t.SendClient {
		route.Client = gateway.ClientFrom(req.RemoteAddr, repl.ReplaceAll(t.ClientID, ""))
		if err := route.Client.Check(); err != nil && route.Client.Addr.IsValid() {
			GatewayDials.WithLabelValues(moduleid.SandboxTransport, gatewayDialNoRoute).Inc()
			t.logger.Warn("sandbox transport: the request's client cannot be signed", zap.String("uri", req.RequestURI), zap.Error(err))
			return nil, err
		}
	}
	// The app's side of the tunnel is plain HTTP (or h2c); reverse_proxy
	// leaves the scheme to the transport.
	req.URL.Scheme = "http"
	var body *countingBody
	if req.Body != nil && req.Body != http.NoBody {
		body = &countingBody{ReadCloser: req.Body}
		req.Body = body
	}
	// The tunnel that carries the request, to count how it ended where
	// only the HTTP layer can tell (a response cut short).
	var tunnel atomic.Pointer[TunnelConn]
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			if tc, ok := info.Conn.(*TunnelConn); ok {
				tc.Begin()
				// The HTTP transport retries on another tunnel only when
				// this one failed before the request reached it.
				tunnel.Swap(tc).Done(gateway.EndClosed)
			}
		},
	}))
	resp, err := t.pools.get(route).RoundTrip(req)
	if err != nil {
		tc := tunnel.Load()
		if de := tc.refusal(); de != nil {
			// The forwarder refused the gateway's certificate: the
			// tunnel never opened (logged and counted as it was read).
			tc.Done(gateway.EndClosed)
			return nil, reverseproxy.NewDialError(de)
		}
		tc.Done(gateway.EndOf(err))
		var de *gateway.DialError
		switch {
		case errors.As(err, &de):
			// Logged and counted where it happened (dial).
			return nil, reverseproxy.NewDialError(err)
		case gateway.Refused(err):
			untouched := body == nil || body.n.Load() == 0
			t.logger.Warn("sandbox transport: the forwarder refused the tunnel (its log names the reason); nothing reached the sandbox",
				routeFields(route, zap.String("uri", req.RequestURI), zap.Bool("retry_safe", untouched), zap.Error(err))...)
			if untouched {
				return nil, reverseproxy.NewDialError(err)
			}
			return nil, err
		default:
			t.logger.Info("sandbox transport: the tunnel failed before the response", routeFields(route, zap.String("uri", req.RequestURI), zap.Error(err))...)
			return nil, err
		}
	}
	if resp.StatusCode != http.StatusSwitchingProtocols && resp.Body != nil && resp.Body != http.NoBody {
		resp.Body = &failureLoggingBody{ReadCloser: resp.Body, logger: t.logger, route: route, uri: req.RequestURI, tunnel: tunnel.Load()}
	} else {
		tunnel.Load().Done(gateway.EndClosed)
	}
	return resp, nil
}

func routeFields(r gateway.Route, more ...zap.Field) []zap.Field {
	return append([]zap.Field{zap.String("sandbox", r.Sandbox), zap.Stringer("target", r.Target), zap.String("forwarder", r.Forwarder)}, more...)
}

// routeTransport is the HTTP transport of one route: its connections are
// that route's tunnels.
func (t *SandboxTransport) routeTransport(route gateway.Route) *http.Transport {
	ht := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			conn, err := t.dialer.Dial(ctx, route)
			if err != nil {
				GatewayDials.WithLabelValues(moduleid.SandboxTransport, dialResult(err)).Inc()
				t.logger.Warn("sandbox transport: cannot open the tunnel; nothing reached the sandbox", routeFields(route, zap.Error(err))...)
				return nil, err
			}
			return &TunnelConn{Conn: conn, t: t, route: route, readFailed: make(chan struct{})}, nil
		},
		MaxIdleConnsPerHost: t.MaxIdleConnsPerRoute,
		MaxConnsPerHost:     t.MaxConnsPerRoute,
		IdleConnTimeout:     time.Duration(t.IdleTimeout),
		DisableCompression:  true,
	}
	ht.Protocols = new(http.Protocols)
	if len(t.Versions) == 1 && t.Versions[0] == "h2c" {
		ht.Protocols.SetUnencryptedHTTP2(true)
	} else {
		ht.Protocols.SetHTTP1(true)
	}
	return ht
}

// tunnelConn is one pooled tunnel. It counts how the tunnel ended once
// it is closed and no request on it is still in flight, so that what a
// request saw (a response cut short is visible only to the HTTP layer)
// counts even when the HTTP transport closes the tunnel first: it does
// so as soon as a body read fails, while the error is still on its way
// to the reader. Otherwise the tunnel's first read error says.
//
// Its dial is counted ok once the forwarder is known to have taken the
// gateway's certificate, which with TLS 1.3 only what the tunnel reads
// tells: its first byte, or a first read error other than the
// forwarder's refusal of the certificate (gateway.CertificateAlert),
// or its close. A refusal read before any byte makes the tunnel one that
// could not be opened: counted and logged as a failed dial, with no end.
type TunnelConn struct {
	net.Conn
	t          *SandboxTransport // nil: nothing to count or classify
	route      gateway.Route
	readErr    atomic.Pointer[error]
	readFailed chan struct{} // closed at the first read error
	readMu     sync.Mutex    // held by Read, and by a failed Write's read
	pending    []byte        // read by a failed Write, for the next Read
	read       atomic.Bool   // a byte came from the forwarder
	state      atomic.Int32  // tunnelDialing, tunnelOpen or tunnelRefused
	refused    *gateway.DialError

	mu       sync.Mutex
	end      gateway.End // the first refused or failed end a request saw
	inFlight int         // requests between GotConn and their done
	closed   bool
	counted  bool
}

// begin marks a request in flight on the tunnel.
func (c *TunnelConn) Begin() {
	c.mu.Lock()
	c.inFlight++
	c.mu.Unlock()
}

// done ends a request begun on the tunnel, with how it saw the tunnel
// end: refused or failed, or EndClosed for nothing to say. The first
// refused or failed end is the tunnel's. Nil-safe.
func (c *TunnelConn) Done(e gateway.End) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e != gateway.EndClosed && c.end == "" {
		c.end = e
	}
	c.inFlight--
	c.countLocked()
}

// The states of a tunnelConn's dial.
const (
	tunnelDialing int32 = iota // nothing read yet
	tunnelOpen                 // counted ok
	tunnelRefused              // the forwarder refused the certificate
)

func (c *TunnelConn) Read(p []byte) (int, error) {
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
func (c *TunnelConn) observe(n int, err error) {
	if n > 0 && !c.read.Load() {
		c.read.Store(true)
		c.open()
	}
	if err != nil && c.readErr.CompareAndSwap(nil, &err) && c.t != nil {
		if de := c.t.dialer.CertificateRefusal(c.route, err); de != nil && !c.read.Load() && c.state.Load() == tunnelDialing {
			c.refused = de // published by the state's store
		}
		if c.refused != nil && c.state.CompareAndSwap(tunnelDialing, tunnelRefused) {
			de := c.refused
			GatewayDials.WithLabelValues(moduleid.SandboxTransport, dialResult(de)).Inc()
			c.t.logger.Warn("sandbox transport: cannot open the tunnel; nothing reached the sandbox", routeFields(c.route, zap.Error(de))...)
		}
		close(c.readFailed)
	}
}

// Write writes to the tunnel. A write that fails before anything was read
// from the tunnel looks, for at most refusalWait, for what the forwarder
// sent before the reset that failed it: its refusal of the certificate.
// The HTTP transport closes the tunnel as soon as the write fails, which
// would leave the refusal unread. HTTP/1.1 reads every tunnel all along:
// its reader meets the refusal, and the write waits for it. HTTP/2 writes
// its preface before it reads: the write reads it itself, and keeps what
// it read for the next Read. A write that met the refusal returns it.
func (c *TunnelConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err == nil || c.t == nil || c.read.Load() {
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
// of the certificate (a *gateway.DialError) when the tunnel met it, which
// the HTTP/2 transport returns as its connection's failure, else err.
func (c *TunnelConn) writeErr(err error) error {
	if c.state.Load() == tunnelRefused {
		return c.refused
	}
	return err
}

// open counts the tunnel's dial ok, once, unless it was refused.
func (c *TunnelConn) open() {
	if kc, ok := c.Conn.(*ktls.Conn); ok && c.state.CompareAndSwap(tunnelDialing, tunnelOpen) {
		countDialOK(moduleid.SandboxTransport, kc)
	}
}

// refusalWait bounds how long a request that failed on a tunnel from
// which nothing was read waits for the tunnel's read to say whether the
// forwarder refused the certificate: a write that met the reset after
// the refusal fails first.
const refusalWait = 100 * time.Millisecond

// refusal returns the forwarder's refusal of the gateway's certificate
// when the tunnel met one before its first byte, nil otherwise. Nil-safe.
func (c *TunnelConn) refusal() *gateway.DialError {
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

func (c *TunnelConn) Close() error {
	c.mu.Lock()
	c.closed = true
	c.countLocked()
	c.mu.Unlock()
	return c.Conn.Close()
}

func (c *TunnelConn) countLocked() {
	if !c.closed || c.inFlight > 0 || c.counted {
		return
	}
	c.counted = true
	if c.state.Load() == tunnelRefused {
		return // never opened: counted as a failed dial
	}
	c.open()
	end := c.end
	if end == "" {
		var err error
		if p := c.readErr.Load(); p != nil {
			err = *p
		}
		end = gateway.EndOf(err)
		if err != nil && errors.Is(err, net.ErrClosed) {
			end = gateway.EndClosed // closed by us, idle
		}
	}
	GatewayEnds.WithLabelValues(moduleid.SandboxTransport, string(end)).Inc()
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

// failureLoggingBody logs a response cut short by the tunnel's failure;
// the request is done on its tunnel at the body's first error or close.
type failureLoggingBody struct {
	io.ReadCloser
	logger *zap.Logger
	route  gateway.Route
	uri    string
	tunnel *TunnelConn
	once   sync.Once
}

func (b *failureLoggingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		end := gateway.EndClosed
		if gateway.EndOf(err) != gateway.EndClosed {
			end = gateway.EndFailed
		}
		b.once.Do(func() {
			if end == gateway.EndFailed {
				b.logger.Info("sandbox transport: the tunnel failed mid-response", routeFields(b.route, zap.String("uri", b.uri), zap.Error(err))...)
			}
			b.tunnel.Done(end)
		})
	}
	return n, err
}

func (b *failureLoggingBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(func() { b.tunnel.Done(gateway.EndClosed) })
	return err
}

// routePools holds one HTTP transport per route, at most max of them; the
// least recently used is dropped (its idle connections closed) beyond.
type routePools struct {
	mu           sync.Mutex
	max          int
	index        map[gateway.Route]*list.Element
	lru          *list.List // of *routePool, front: most recently used
	newTransport func(gateway.Route) *http.Transport
}

type routePool struct {
	route gateway.Route
	t     *http.Transport
}

func (p *routePools) get(r gateway.Route) *http.Transport {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e, ok := p.index[r]; ok {
		p.lru.MoveToFront(e)
		return e.Value.(*routePool).t
	}
	rp := &routePool{route: r, t: p.newTransport(r)}
	p.index[r] = p.lru.PushFront(rp)
	for p.lru.Len() > p.max {
		old := p.lru.Remove(p.lru.Back()).(*routePool)
		delete(p.index, old.route)
		// Connections in use finish their requests and close then.
		old.t.CloseIdleConnections()
	}
	return rp.t
}

func (p *routePools) closeIdle() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for e := p.lru.Front(); e != nil; e = e.Next() {
		e.Value.(*routePool).t.CloseIdleConnections()
	}
}

// Interface guards.
var (
	_ http.RoundTripper         = (*SandboxTransport)(nil)
	_ caddy.Provisioner         = (*SandboxTransport)(nil)
	_ caddy.Validator           = (*SandboxTransport)(nil)
	_ caddy.CleanerUpper        = (*SandboxTransport)(nil)
	_ reverseproxy.H2CTransport = (*SandboxTransport)(nil)
)
