package edgegateway

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/l4conn"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/splice"
)

func init() {
	caddy.RegisterModule(new(Proxy))
}

// Proxy is the edge gateway for raw TCP: a terminal layer4 handler
// that opens a tunnel to the sandbox's forwarder (mutual TLS, a signed
// preamble naming the sandbox and its target) and relays the user's
// connection through it. Place it after a TLS-terminating handler (`ktls`,
// or caddy-l4's `tls`): with `ktls` on the user's side and kernel TLS on
// the forwarder connection, the bytes move kernel to kernel with splice(2)
// and no tenant byte enters userspace at the gateway either.
//
// Each connection ends as its tunnel did: in order (close_notify) when
// both directions ended; refused (the fatal alert access_denied, on a kTLS
// session) when nothing reached the sandbox: the forwarder refused, it
// could not be reached, or the route's placeholders gave no valid route;
// failed (internal_error, or a reset) otherwise. Tunnels outlive
// configuration reloads.
type Proxy struct {
	// Forwarder is the host:port of the forwarder on the sandbox's host.
	// Placeholders are replaced per connection.
	Forwarder string `json:"forwarder,omitempty"`

	// Sandbox is the sandbox ID the preamble names. Placeholders are
	// replaced per connection: e.g. {l4.tls.server_name.labels.2}, the
	// third label from the right of the name the user asked for. Sandbox
	// IDs are case-insensitive: the preamble names the lowercase form, and
	// a connection whose ID is not valid even lowercased ("..", ".a") is
	// refused before anything is dialed.
	Sandbox string `json:"sandbox,omitempty"`

	// Target is the sandbox service's private IP address and port.
	// Placeholders are replaced per connection.
	Target string `json:"target,omitempty"`

	// ClientID, when set, is the end user's identity string signed into
	// each preamble beside the user's address (the client identity
	// extension, docs/preamble.md §3.1; a forwarder with proxy_protocol v2
	// hands both to the target). Placeholders are replaced per connection,
	// e.g. {l4.tls.client.subject}; one that gives an empty string sends the
	// address alone. The user's address is always signed. At most 255 bytes
	// of well-formed UTF-8 without control, line-separator or bidirectional
	// formatting characters (docs/preamble.md §3.1): a connection whose
	// value breaks that is refused, and nothing reaches the sandbox.
	ClientID string `json:"client_id,omitempty"`

	// DrainGracePeriod is how long open tunnels may keep running when the
	// process exits before they are closed: from the exit on, new
	// connections are refused (nothing is dialed), and a tunnel still open
	// at the end of the period is ended as a failure, counted in
	// caddy_ktls_gateway_tunnel_ends_total{end="drained"}. Every
	// sandbox_proxy handler of the process drains within one period, the
	// one of the first handler cleaned up at exit, handlers that a reload
	// replaced while they carried tunnels included. Reloads do not drain.
	// Default: 30s.
	DrainGracePeriod caddy.Duration `json:"drain_grace_period,omitempty"`

	// How forwarders are reached (DialOptions), at the top level of the
	// JSON.
	DialOptions

	ctx    caddy.Context
	logger *zap.Logger
	dialer *gateway.Dialer
	// moveName names the handler for an upgrade (moveNameOf): the new
	// process adopts its tunnels in the handler configured the same.
	moveName string
	// handling counts the Handle calls and adopted tunnels' runs in
	// progress: the drain at exit waits for them to have counted and
	// logged how their tunnels ended. Provision makes it.
	handling *inFlight
}

// inFlight counts calls in progress; wait returns once none is. A nil
// one counts nothing.
type inFlight struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n falls to zero; nil while none waits
}

func (f *inFlight) enter() {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
}

func (f *inFlight) leave() {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n--
	if f.n == 0 && f.idle != nil {
		close(f.idle)
		f.idle = nil
	}
}

func (f *inFlight) wait() {
	if f == nil {
		return
	}
	f.mu.Lock()
	if f.n == 0 {
		f.mu.Unlock()
		return
	}
	if f.idle == nil {
		f.idle = make(chan struct{})
	}
	idle := f.idle
	f.mu.Unlock()
	<-idle
}

// CaddyModule returns the Caddy module information.
func (*Proxy) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxProxy, New: func() caddy.Module { return new(Proxy) }}
}

// Validate checks the configuration without loading anything.
func (h *Proxy) Validate() error {
	if h.Forwarder == "" || h.Sandbox == "" || h.Target == "" {
		return errors.New("sandbox_proxy: forwarder, sandbox and target are required (placeholders allowed)")
	}
	if err := checkSandboxOption("sandbox_proxy", h.Sandbox, "{l4.tls.server_name.labels.2}"); err != nil {
		return err
	}
	if err := checkTargetOption("sandbox_proxy", h.Target); err != nil {
		return err
	}
	if err := checkForwarderOption("sandbox_proxy", h.Forwarder); err != nil {
		return err
	}
	if h.DrainGracePeriod < 0 {
		return fmt.Errorf("sandbox_proxy: drain_grace_period must not be negative (got %s): give a duration such as 30s, or leave it out (30s)", time.Duration(h.DrainGracePeriod))
	}
	if err := h.DialOptions.validate(); err != nil {
		return fmt.Errorf("sandbox_proxy: %w", err)
	}
	return nil
}

// Provision sets up the handler.
func (h *Proxy) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger(h)
	h.handling = new(inFlight)
	if h.DrainGracePeriod == 0 {
		h.DrainGracePeriod = caddy.Duration(DefaultDrainGracePeriod)
	}
	if err := caddymetrics.Register(ctx, moduleid.SandboxProxy); err != nil {
		return err
	}
	if err := upgrade.CheckListeners(ctx, h.logger, upgrade.HandlerSandboxProxy); err != nil {
		return err
	}
	name, err := moveNameOf(h)
	if err != nil {
		return fmt.Errorf("sandbox_proxy: %w", err)
	}
	d, err := h.DialOptions.dialer(ctx, moduleid.SandboxProxy, h.logger, name)
	if err != nil {
		return fmt.Errorf("sandbox_proxy: %w", err)
	}
	h.dialer, h.moveName = d, name
	proxies.add(h)
	h.DialOptions.logStart(ctx, moduleid.SandboxProxy, h.logger)
	warnUntrustedClientID(h.logger, h.ClientID, ClientIDFixL4)
	return nil
}

// DefaultDrainGracePeriod is Proxy.DrainGracePeriod's default.
const DefaultDrainGracePeriod = 30 * time.Second

// Cleanup closes the standby connections. At exit it drains the tunnels
// of every sandbox_proxy handler of the process (proxyRegistry.drainAtExit);
// a reload leaves them running.
func (h *Proxy) Cleanup() error {
	if h.dialer != nil {
		if caddy.Exiting() {
			proxies.drainAtExit(h)
		}
		proxies.retire(h)
		h.dialer.Close()
	}
	return nil
}

// Handle carries one user connection through a tunnel; it is terminal.
func (h *Proxy) Handle(cx *layer4.Connection, _ layer4.Handler) error {
	h.handling.enter()
	defer h.handling.leave()
	user, buffered := l4conn.Unwrap(cx)
	peer := cx.RemoteAddr().String()
	repl := cx.Replacer()
	route, err := gateway.ParseRoute(repl.ReplaceAll(h.Forwarder, ""), repl.ReplaceAll(h.Sandbox, ""), repl.ReplaceAll(h.Target, ""))
	if err != nil {
		GatewayDials.WithLabelValues(moduleid.SandboxProxy, gatewayDialNoRoute).Inc()
		h.logger.Warn("sandbox_proxy: no route for the connection; refused", zap.String("peer", peer), zap.Error(err))
		splice.Refuse(user)
		return nil
	}
	// The user, as this gateway saw them, signed into the preamble.
	route.Client = gateway.ClientFrom(peer, repl.ReplaceAll(h.ClientID, ""))
	where := tunnelFields(peer, route)
	st, end, err := h.dialer.Carry(cx.Context, route, user, buffered, h.onDial(where))
	h.tunnelEnded(where, st, end, err)
	return nil
}

// tunnelFields are the log fields that name a tunnel: the user's address
// as peer, and its route.
func tunnelFields(peer string, route gateway.Route) []zap.Field {
	return []zap.Field{zap.String("peer", peer), zap.String("sandbox", route.Sandbox), zap.Stringer("target", route.Target),
		zap.String("forwarder", route.Forwarder)}
}

// onDial counts and logs whether a tunnel opened (Carry's and
// AdoptedTunnel.Run's onDial).
func (h *Proxy) onDial(where []zap.Field) func(tunnel *ktls.Conn, err error) {
	return func(tunnel *ktls.Conn, err error) {
		if err != nil {
			GatewayDials.WithLabelValues(moduleid.SandboxProxy, dialResult(err)).Inc()
			if errors.Is(err, gateway.ErrUserGone) {
				h.logger.Info("sandbox_proxy: the user left before the tunnel opened; no preamble was sent, nothing reached the sandbox", where...)
				return
			}
			h.logger.Warn("sandbox_proxy: cannot open the tunnel; refused, nothing reached the sandbox", append(where, zap.Error(err))...)
			return
		}
		countDialOK(moduleid.SandboxProxy, tunnel)
	}
}

// tunnelEnded counts and logs how a tunnel (Carry's, or AdoptedTunnel.Run's
// in a process that took it over) ended: st, end and err are what they
// returned. A tunnel that moved to another process did not end: that
// process counts it from its start, the handoff counts the move.
func (h *Proxy) tunnelEnded(where []zap.Field, st splice.Stats, end gateway.End, err error) {
	if end == "" {
		return // it did not open: counted and logged by onDial
	}
	if end == gateway.EndMoved {
		h.logger.Debug("sandbox_proxy: tunnel moved to the new process", append(where,
			zap.Int64("bytes_to_sandbox", st.AToB.Bytes), zap.Int64("bytes_from_sandbox", st.BToA.Bytes))...)
		return
	}
	GatewayEnds.WithLabelValues(moduleid.SandboxProxy, string(end)).Inc()
	for _, d := range []splice.DirectionStats{st.AToB, st.BToA} {
		gatewayRelayBytes.WithLabelValues(relayPathSplice).Add(float64(d.SpliceBytes))
		gatewayRelayBytes.WithLabelValues(relayPathCopy).Add(float64(d.CopyBytes))
	}
	fields := append(where, zap.String("end", string(end)),
		zap.Int64("bytes_to_sandbox", st.AToB.Bytes), zap.Int64("bytes_from_sandbox", st.BToA.Bytes),
		zap.Bool("spliced_to_sandbox", st.AToB.Spliced), zap.Bool("spliced_from_sandbox", st.BToA.Spliced))
	switch end {
	case gateway.EndClosed:
		h.logger.Debug("sandbox_proxy: tunnel closed", fields...)
	case gateway.EndRefused:
		h.logger.Warn("sandbox_proxy: the forwarder refused the tunnel (its log names the reason); nothing reached the sandbox", fields...)
	case gateway.EndDrained:
		h.logger.Info("sandbox_proxy: tunnel closed at exit: it was still open when the drain grace period ended", append(fields, zap.Error(err))...)
	default:
		h.logger.Info("sandbox_proxy: tunnel failed", append(fields, zap.Error(err))...)
	}
}

// dialResult is the caddy_ktls_gateway_dials_total result of a failed
// Dial: draining, user-gone, overloaded, or the step that failed.
func dialResult(err error) string {
	var de *gateway.DialError
	switch {
	case errors.Is(err, gateway.ErrDraining):
		return gatewayDialDraining
	case errors.Is(err, gateway.ErrUserGone):
		return gatewayDialUserGone
	case errors.Is(err, gateway.ErrOverloaded):
		return gatewayDialOverloaded
	case errors.As(err, &de):
		return de.Step
	}
	return "other"
}

// Interface guards.
var (
	_ layer4.NextHandler = (*Proxy)(nil)
	_ caddy.Provisioner  = (*Proxy)(nil)
	_ caddy.Validator    = (*Proxy)(nil)
	_ caddy.CleanerUpper = (*Proxy)(nil)
)
