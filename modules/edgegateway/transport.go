package edgegateway

import (
	"errors"
	"fmt"
	"net/http"
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
	caddy.RegisterModule(new(Transport))
}

// Transport is the edge gateway for HTTP: a reverse_proxy transport
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
type Transport struct {
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

	// How forwarders are reached (DialOptions), at the top level of the
	// JSON.
	DialOptions

	logger *zap.Logger
	pool   *gateway.Pool
	dialer *gateway.Dialer
}

// The Transport defaults.
const (
	defaultMaxIdleConnsPerRoute = gateway.DefaultMaxIdleConnsPerRoute
	defaultRouteIdleTimeout     = gateway.DefaultRouteIdleTimeout
	defaultMaxRoutes            = gateway.DefaultMaxRoutes
)

// CaddyModule returns the Caddy module information.
func (*Transport) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxTransport, New: func() caddy.Module { return new(Transport) }}
}

// Validate checks the configuration without loading anything.
func (t *Transport) Validate() error {
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
	if err := t.DialOptions.validate(); err != nil {
		return fmt.Errorf("sandbox transport: %w", err)
	}
	return nil
}

// EnableH2C makes the transport speak h2c, for upstreams written h2c://.
func (t *Transport) EnableH2C() error {
	t.Versions = []string{"h2c"}
	return nil
}

// Provision sets up the transport.
func (t *Transport) Provision(ctx caddy.Context) error {
	t.logger = ctx.Logger(t)
	if err := caddymetrics.Register(ctx, moduleid.SandboxTransport); err != nil {
		return err
	}
	if err := t.Validate(); err != nil {
		return err
	}
	d, err := t.DialOptions.dialer(ctx, moduleid.SandboxTransport, t.logger, "")
	if err != nil {
		return fmt.Errorf("sandbox transport: %w", err)
	}
	if t.MaxIdleConnsPerRoute == 0 {
		t.MaxIdleConnsPerRoute = defaultMaxIdleConnsPerRoute
	}
	if t.IdleTimeout == 0 {
		t.IdleTimeout = caddy.Duration(defaultRouteIdleTimeout)
	}
	if t.MaxRoutes == 0 {
		t.MaxRoutes = defaultMaxRoutes
	}
	t.dialer = d
	t.pool, err = gateway.NewPool(gateway.PoolConfig{
		Dialer:               d,
		H2C:                  len(t.Versions) == 1 && t.Versions[0] == "h2c",
		MaxIdleConnsPerRoute: t.MaxIdleConnsPerRoute,
		MaxConnsPerRoute:     t.MaxConnsPerRoute,
		IdleTimeout:          time.Duration(t.IdleTimeout),
		MaxRoutes:            t.MaxRoutes,
		OnDial:               t.onDial,
		OnEnd: func(_ gateway.Route, e gateway.End) {
			GatewayEnds.WithLabelValues(moduleid.SandboxTransport, string(e)).Inc()
		},
		OnFailure: t.onFailure,
	})
	if err != nil {
		return fmt.Errorf("sandbox transport: %w", err)
	}
	t.DialOptions.logStart(ctx, moduleid.SandboxTransport, t.logger)
	warnUntrustedClientID(t.logger, t.ClientID, ClientIDFixHTTP)
	return nil
}

// Cleanup closes the idle connections of every route, and the standby
// connections.
func (t *Transport) Cleanup() error {
	if t.pool != nil {
		t.pool.CloseIdleConnections()
	}
	if t.dialer != nil {
		t.dialer.Close()
	}
	return nil
}

// RoundTrip sends req to the sandbox its placeholders name, through the
// forwarder reverse_proxy chose (req.URL.Host).
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
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
	resp, err := t.pool.RoundTrip(req, route)
	if err != nil && gateway.RetrySafe(err) {
		return nil, reverseproxy.NewDialError(err)
	}
	return resp, err
}

// onDial counts and logs a tunnel's dial, as the pool reports it.
func (t *Transport) onDial(route gateway.Route, conn *ktls.Conn, err error) {
	if err != nil {
		GatewayDials.WithLabelValues(moduleid.SandboxTransport, dialResult(err)).Inc()
		t.logger.Warn("sandbox transport: cannot open the tunnel; nothing reached the sandbox", routeFields(route, zap.Error(err))...)
		return
	}
	if conn != nil {
		countDialOK(moduleid.SandboxTransport, conn)
	}
}

// onFailure logs a request its tunnel failed, as the pool reports it.
func (t *Transport) onFailure(f gateway.Failure) {
	uri := zap.String("uri", f.Request.RequestURI)
	switch {
	case f.End == gateway.EndRefused:
		t.logger.Warn("sandbox transport: the forwarder refused the tunnel (its log names the reason); nothing reached the sandbox",
			routeFields(f.Route, uri, zap.Bool("retry_safe", f.RetrySafe), zap.Error(f.Err))...)
	case f.MidResponse:
		t.logger.Info("sandbox transport: the tunnel failed mid-response", routeFields(f.Route, uri, zap.Error(f.Err))...)
	default:
		t.logger.Info("sandbox transport: the tunnel failed before the response", routeFields(f.Route, uri, zap.Error(f.Err))...)
	}
}

func routeFields(r gateway.Route, more ...zap.Field) []zap.Field {
	return append([]zap.Field{zap.String("sandbox", r.Sandbox), zap.Stringer("target", r.Target), zap.String("forwarder", r.Forwarder)}, more...)
}

// Interface guards.
var (
	_ http.RoundTripper         = (*Transport)(nil)
	_ caddy.Provisioner         = (*Transport)(nil)
	_ caddy.Validator           = (*Transport)(nil)
	_ caddy.CleanerUpper        = (*Transport)(nil)
	_ reverseproxy.H2CTransport = (*Transport)(nil)
)
