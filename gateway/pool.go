package gateway

import (
	"container/list"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptrace"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// Defaults for the zero values of PoolConfig.
const (
	DefaultMaxIdleConnsPerRoute = 8
	DefaultRouteIdleTimeout     = 2 * time.Minute
	DefaultMaxRoutes            = 4096
)

// PoolConfig configures a Pool.
type PoolConfig struct {
	// Dialer opens the tunnels. Required.
	Dialer *Dialer
	// H2C makes the HTTP spoken to the sandbox's app HTTP/2 with prior
	// knowledge (gRPC); false: HTTP/1.1.
	H2C bool
	// MaxIdleConnsPerRoute is how many idle tunnels each route keeps.
	// Zero means DefaultMaxIdleConnsPerRoute.
	MaxIdleConnsPerRoute int
	// MaxConnsPerRoute caps the tunnels of one route, idle or not (a
	// request waits for one). Zero: no cap.
	MaxConnsPerRoute int
	// IdleTimeout closes a tunnel idle this long. Zero means
	// DefaultRouteIdleTimeout.
	IdleTimeout time.Duration
	// MaxRoutes bounds how many routes keep a pool; beyond it the least
	// recently used route is dropped and its idle tunnels closed. Zero
	// means DefaultMaxRoutes.
	MaxRoutes int

	// The callbacks hand what the Pool observes to its owner (metrics,
	// logs); nil means not wanted. They run on the goroutine that made the
	// observation, some with a tunnel's lock held: they must not block or
	// call back into the Pool.

	// OnDial reports each tunnel the Pool tried to open, once: err nil
	// when it opened (conn is it), which the first byte read from it
	// tells, or a first read error other than the forwarder's refusal of
	// the certificate, or its close; else a *DialError (conn nil): Dial
	// failed, or the forwarder refused the gateway's certificate before
	// the tunnel's first byte (CertificateRefusedError, StepHandshake).
	OnDial func(r Route, conn *ktls.Conn, err error)
	// OnEnd reports how each opened tunnel ended, once, when it is closed
	// and no request on it is in flight: the first EndRefused or EndFailed
	// a request on it saw, else what its first read error says (EndOf; a
	// close of an idle tunnel by the Pool is EndClosed). A tunnel whose
	// certificate was refused never opened and has no end.
	OnEnd func(r Route, e End)
	// OnFailure reports each request the tunnel failed after it opened:
	// refused or failed before the response, or failed mid-response. A
	// request whose tunnel could not be opened is OnDial's.
	OnFailure func(Failure)
}

// Failure is a request that its tunnel failed.
type Failure struct {
	Route   Route
	Request *http.Request
	// End is EndRefused (the forwarder refused the tunnel: nothing
	// reached the sandbox) or EndFailed.
	End End
	// MidResponse: the response had begun (its body failed).
	MidResponse bool
	// RetrySafe: the request may be sent again as it is: nothing reached
	// the sandbox and its body was not read (RetrySafe of the error).
	RetrySafe bool
	Err       error
}

// Pool is an HTTP transport whose connections are tunnels: one HTTP
// transport per Route, so that a tunnel opened for one route (a sandbox,
// its target, a client) never carries another's request. It decides how
// each tunnel's dial and end count, and reports them through its
// PoolConfig's callbacks. It is safe for concurrent use.
type Pool struct {
	cfg PoolConfig

	mu    sync.Mutex
	index map[Route]*list.Element
	lru   *list.List // of *routePool, front: most recently used
}

type routePool struct {
	route Route
	t     *http.Transport
}

// NewPool returns a Pool for cfg.
func NewPool(cfg PoolConfig) (*Pool, error) {
	if cfg.Dialer == nil {
		return nil, errors.New("gateway: pool without a Dialer")
	}
	if cfg.MaxIdleConnsPerRoute < 0 || cfg.MaxConnsPerRoute < 0 || cfg.MaxRoutes < 0 || cfg.IdleTimeout < 0 {
		return nil, errors.New("gateway: negative pool size or idle timeout")
	}
	if cfg.MaxIdleConnsPerRoute == 0 {
		cfg.MaxIdleConnsPerRoute = DefaultMaxIdleConnsPerRoute
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultRouteIdleTimeout
	}
	if cfg.MaxRoutes == 0 {
		cfg.MaxRoutes = DefaultMaxRoutes
	}
	return &Pool{cfg: cfg, index: map[Route]*list.Element{}, lru: list.New()}, nil
}

// RoundTrip sends req to r's sandbox on one of r's tunnels (it sets
// req.URL.Scheme to http: the app's side of a tunnel is plain HTTP or
// h2c). Its error is a *DialError when the tunnel could not be opened
// (the forwarder's refusal of the certificate included); RetrySafe says
// whether req may be sent again.
func (p *Pool) RoundTrip(req *http.Request, r Route) (*http.Response, error) {
	req.URL.Scheme = "http"
	var body *countingBody
	if req.Body != nil && req.Body != http.NoBody {
		body = &countingBody{ReadCloser: req.Body}
		req.Body = body
	}
	// The tunnel that carries the request, to count how it ended where
	// only the HTTP layer can tell (a response cut short).
	var tunnel atomic.Pointer[tunnelConn]
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			if tc, ok := info.Conn.(*tunnelConn); ok {
				tc.begin()
				// The HTTP transport retries on another tunnel only when
				// this one failed before the request reached it.
				tunnel.Swap(tc).done(EndClosed)
			}
		},
	}))
	resp, err := p.transport(r).RoundTrip(req)
	if err != nil {
		tc := tunnel.Load()
		if de := tc.refusal(); de != nil {
			// The forwarder refused the gateway's certificate: the tunnel
			// never opened (reported as it was read).
			tc.done(EndClosed)
			return nil, de
		}
		tc.done(EndOf(err))
		var de *DialError
		switch {
		case errors.As(err, &de):
			return nil, err // reported where it happened (dial)
		case Refused(err):
			untouched := body == nil || body.n.Load() == 0
			p.failure(Failure{Route: r, Request: req, End: EndRefused, RetrySafe: untouched, Err: err})
			if untouched {
				return nil, &unsentError{err}
			}
			return nil, err
		default:
			p.failure(Failure{Route: r, Request: req, End: EndFailed, Err: err})
			return nil, err
		}
	}
	if resp.StatusCode != http.StatusSwitchingProtocols && resp.Body != nil && resp.Body != http.NoBody {
		resp.Body = &failureBody{ReadCloser: resp.Body, pool: p, route: r, req: req, tunnel: tunnel.Load()}
	} else {
		tunnel.Load().done(EndClosed)
	}
	return resp, nil
}

// RetrySafe reports whether err, from Pool.RoundTrip, leaves the request
// safe to send again as it is: the tunnel could not be opened (a
// *DialError), or the forwarder refused it (nothing reached the sandbox)
// before the request's body was read.
func RetrySafe(err error) bool {
	var de *DialError
	var ue *unsentError
	return errors.As(err, &de) || errors.As(err, &ue)
}

// unsentError is a refusal met before the request's body was read.
type unsentError struct{ err error }

func (e *unsentError) Error() string { return e.err.Error() }
func (e *unsentError) Unwrap() error { return e.err }

func (p *Pool) failure(f Failure) {
	if p.cfg.OnFailure != nil {
		p.cfg.OnFailure(f)
	}
}

// CloseIdleConnections closes the idle tunnels of every route. Tunnels
// in use finish their requests and close then.
func (p *Pool) CloseIdleConnections() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for e := p.lru.Front(); e != nil; e = e.Next() {
		e.Value.(*routePool).t.CloseIdleConnections()
	}
}

// Routes is how many routes keep a pool.
func (p *Pool) Routes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lru.Len()
}

// transport returns r's HTTP transport, made on first use; beyond
// MaxRoutes the least recently used route is dropped and its idle
// tunnels closed.
func (p *Pool) transport(r Route) *http.Transport {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e, ok := p.index[r]; ok {
		p.lru.MoveToFront(e)
		return e.Value.(*routePool).t
	}
	rp := &routePool{route: r, t: p.newTransport(r)}
	p.index[r] = p.lru.PushFront(rp)
	for p.lru.Len() > p.cfg.MaxRoutes {
		old := p.lru.Remove(p.lru.Back()).(*routePool)
		delete(p.index, old.route)
		// Tunnels in use finish their requests and close then.
		old.t.CloseIdleConnections()
	}
	return rp.t
}

// newTransport is the HTTP transport of one route: its connections are
// that route's tunnels.
func (p *Pool) newTransport(r Route) *http.Transport {
	ht := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			conn, err := p.cfg.Dialer.Dial(ctx, r)
			if err != nil {
				if p.cfg.OnDial != nil {
					p.cfg.OnDial(r, nil, err)
				}
				return nil, err
			}
			return newTunnelConn(conn, p, r), nil
		},
		MaxIdleConnsPerHost: p.cfg.MaxIdleConnsPerRoute,
		MaxConnsPerHost:     p.cfg.MaxConnsPerRoute,
		IdleConnTimeout:     p.cfg.IdleTimeout,
		DisableCompression:  true,
	}
	ht.Protocols = new(http.Protocols)
	if p.cfg.H2C {
		ht.Protocols.SetUnencryptedHTTP2(true)
	} else {
		ht.Protocols.SetHTTP1(true)
	}
	return ht
}
