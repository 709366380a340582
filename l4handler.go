package caddyktls

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"runtime"
	"sync"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
	"github.com/mholt/caddy-l4/layer4"
	"github.com/mholt/caddy-l4/modules/l4tls"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/listensock"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

func init() {
	caddy.RegisterModule(new(KTLSHandler))
}

// KTLSHandler terminates TLS inside caddy-l4 and moves the session into the
// kernel (kTLS), then passes the decrypted stream on. Its configuration has
// the shape of caddy-l4's `tls` handler (connection policies with client
// authentication for mutual TLS) plus the offload options.
//
// It sets the same connection variables as caddy-l4's `tls` handler, so
// `{l4.tls.*}` placeholders (and `vars` matchers on them), the `http`
// matcher's request TLS state and later handlers see the session. caddy-l4's
// `tls` matcher does not route after it (nor after caddy-l4's `tls`
// handler): it parses a ClientHello from the connection's bytes, which are
// then the decrypted stream.
//
// SECURITY: kernel receive (RX) is on by default because it is what lets the
// data path splice decrypted bytes without a copy. The kernel's TLS receive
// path is where kTLS vulnerabilities have clustered; set `disable_rx` to keep
// decryption in Go while the kernel still encrypts outgoing records.
type KTLSHandler struct {
	// The TLS connection policies, exactly as in caddy-l4's `tls` handler:
	// certificate selection, protocols, and `client_auth` (mode, trust_pool,
	// verifiers such as `leaf` for a client-certificate allowlist). With none,
	// one default policy is used.
	ConnectionPolicies caddytls.ConnectionPolicies `json:"connection_policies,omitempty"`

	// DisableResumption issues no TLS session tickets on connection
	// policies with client authentication, as Caddy's own `tls` handler
	// does. By default the handler issues them there, each sealed with keys
	// of the one policy that authenticated the client, so that a client
	// (the edge gateway) resumes only under that policy, on this process,
	// until the next config load (l4handler_resumption.go). Policies
	// without client authentication issue tickets either way, unless the
	// tls app disables session tickets, which disables them here too.
	DisableResumption bool `json:"disable_resumption,omitempty"`

	// MaxHandshakes bounds the TLS handshakes in progress in the process,
	// those of every ktls handler (of other servers, and of the config a
	// reload replaces, included), each counted from the connection's
	// arrival at a handler to the end of its handshake: they share the
	// CPU it protects. A connection that arrives at this handler while
	// that many are in progress is shed before any handshake work: a plaintext
	// access_denied alert in place of the ServerHello, then close. It is
	// counted as caddy_ktls_handshake_failures_total{reason="overloaded"}
	// and is in the WARN summary of failed handshakes. A gateway takes it
	// as the forwarder's overload (its dial's result is `overloaded`) and
	// may try another forwarder at once: past capacity, CPU saturation
	// would otherwise slow every handshake alike until handshake_timeout
	// cut them all. Zero means 128 per CPU the process may use
	// (GOMAXPROCS): at about half a millisecond of CPU per mutual-TLS
	// handshake, an admitted one waits some 65 ms for CPU at most. -1
	// means no bound.
	MaxHandshakes int `json:"max_handshakes,omitempty"`

	// MaxSchedulingDelay sheds, as max_handshakes does, a connection that
	// arrives while the process's goroutines wait longer than this for a
	// CPU and more handshakes than CPUs (GOMAXPROCS) are in progress. The
	// wait is the Go scheduler's run-queue delay, its 90th percentile over
	// the last 100 ms or more (caddy_ktls_scheduling_delay_seconds): what
	// every step of an admitted handshake waits for, however far its peer
	// is, since a handshake waiting on a round trip is not runnable. Time
	// the kernel gives other processes while goroutines are queued counts
	// too. With one handshake per CPU or fewer in progress nothing is shed
	// for it, so new connections always make progress. Zero (the default)
	// means no such bound: see docs/configuration.md before setting one.
	MaxSchedulingDelay caddy.Duration `json:"max_scheduling_delay,omitempty"`

	// The offload options (OffloadOptions), at the top level of the JSON.
	offload.Options

	// maxHandshakes is MaxHandshakes with its default, 0 for no bound.
	maxHandshakes int64
	// cpus are the handshakes in progress MaxSchedulingDelay sheds above.
	cpus int64

	ctx    caddy.Context
	logger *zap.Logger
	opts   ktls.Options
	// failures counts and logs failed handshakes.
	failures *offload.HandshakeFailureLog
	// served holds the local addresses (netip.AddrPort) of the
	// connections that reached the handler, each registered with the
	// listeners that shed in its name (listensock.Serves) until Cleanup;
	// servedMu guards registering, forget and cleaned.
	served   sync.Map
	servedMu sync.Mutex
	forget   []func()
	cleaned  bool
	// sessions keeps each policy's ticket-issuing configuration; tickets
	// is the tls app's session ticket service (nil when not configured).
	sessions sessionKeys
	tickets  *caddytls.SessionTicketService
}

// CaddyModule returns the Caddy module information.
func (*KTLSHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.L4Handler, New: func() caddy.Module { return new(KTLSHandler) }}
}

// Provision sets up the handler.
func (h *KTLSHandler) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger(h)
	if err := caddymetrics.Register(ctx, moduleid.L4Handler); err != nil {
		return err
	}
	if len(h.ConnectionPolicies) == 0 {
		h.ConnectionPolicies = append(h.ConnectionPolicies, new(caddytls.ConnectionPolicy))
	}
	if err := h.ConnectionPolicies.Provision(ctx); err != nil {
		return fmt.Errorf("ktls handler: connection policies: %v", err)
	}
	// The policies loaded the tls app.
	var tlsApp *caddytls.TLS
	if app, err := ctx.App("tls"); err == nil {
		tlsApp = app.(*caddytls.TLS)
		h.tickets = tlsApp.SessionTickets
	}
	h.Options.SetDefaults()
	switch {
	case h.MaxHandshakes == 0:
		h.maxHandshakes = int64(DefaultMaxHandshakesPerCPU * runtime.GOMAXPROCS(0))
	case h.MaxHandshakes > 0:
		h.maxHandshakes = int64(h.MaxHandshakes)
	}
	h.cpus = int64(runtime.GOMAXPROCS(0))
	h.failures = offload.NewHandshakeFailureLog(moduleid.L4Handler, h.logger)
	h.opts = h.KTLSOptions(h.observe)
	// What this kernel does for the handler's connections, and what to do
	// if it cannot offload: once per config load (its tls app) and set of
	// offload options, however many ktls handlers share them.
	key := l4KernelLogKey{tlsApp, h.Options}
	if _, logged := l4KernelLogged.LoadOrStore(key, struct{}{}); !logged {
		// The load's context ends when the configuration is unloaded
		// (ctx.OnCancel on a module's copy of the context never runs).
		context.AfterFunc(ctx, func() { l4KernelLogged.Delete(key) })
		h.Options.LogKernel(h.logger)
	}
	return nil
}

// l4KernelLogged holds an l4KernelLogKey for each logKernel line the
// layer4 ktls handlers of a loaded configuration logged.
var l4KernelLogged sync.Map

type l4KernelLogKey struct {
	load *caddytls.TLS // one per config load
	opts offload.Options
}

// Validate checks the offload options (caddy.Validator): Caddy calls it
// after Provision, before the handler serves.
func (h *KTLSHandler) Validate() error {
	if h.MaxHandshakes < -1 {
		return fmt.Errorf("ktls handler: max_handshakes %d: want a positive number, 0 for the default or -1 for no bound", h.MaxHandshakes)
	}
	if h.MaxSchedulingDelay < 0 {
		return fmt.Errorf("ktls handler: `max_scheduling_delay` %v must not be negative: give a positive duration, or leave it out (no bound)", time.Duration(h.MaxSchedulingDelay))
	}
	if err := h.Options.ValidateOptions(); err != nil {
		return fmt.Errorf("ktls handler: %w", err)
	}
	return nil
}

func (h *KTLSHandler) observe(ev ktls.Event) {
	offload.CountClose(moduleid.L4Handler, ev.Kind)
	switch {
	case ev.Kind == ktls.EventHandshake:
		offload.ObserveHandshake(moduleid.L4Handler, ev)
		offload.LogHandshake(h.logger, ev)
		if ev.Offload.Reason == ktls.ReasonHandshakeFailed {
			h.failures.Record(ev)
		}
		return
	case ev.Kind == ktls.EventRefused:
		// Counted; said once at load (logKernel) where the kernel
		// refuses every connection, so not at WARN for each.
		h.logger.Debug("kTLS connection refused: it cannot be offloaded and fallback is refuse",
			zap.Stringer("remote", ev.Remote), zap.Error(ev.Err))
		return
	case ev.Err == nil:
		return
	}
	h.logger.Warn("kTLS connection event", zap.String("event", string(ev.Kind)), zap.Stringer("remote", ev.Remote), zap.Error(ev.Err))
}

// DefaultMaxHandshakesPerCPU is the ktls handler's bound on handshakes in
// progress (KTLSHandler.MaxHandshakes) per CPU the process may use.
const DefaultMaxHandshakesPerCPU = 128

// Handle terminates TLS on cx and calls next with the decrypted connection.
// It sheds cx, before any handshake work, while MaxHandshakes are in
// progress in the process, or more than one per CPU while its scheduling
// delay is above MaxSchedulingDelay, where set.
func (h *KTLSHandler) Handle(cx *layer4.Connection, next layer4.Handler) error {
	h.serves(cx.LocalAddr())
	n := offload.HandshakesInProgress.Add(1)
	if why := h.overloaded(n); why != nil {
		offload.HandshakesInProgress.Add(-1)
		h.failures.Shed(cx.RemoteAddr(), why...)
		ktls.Shed(cx)
		return nil
	}
	kconn, err := h.handshakeOwnStack(cx)
	offload.HandshakesInProgress.Add(-1)
	if err != nil {
		kconn.Close()
		// Reported to observe (a refusal, a failure after TLS_TX, or a
		// failed handshake: logged and counted there), so not returned to
		// caddy-l4, which would log an ERROR for each.
		return nil
	}
	return next.Handle(cx.Wrap(kconn))
}

// serves registers the handler, once per local address its connections
// arrive at, with the tcp-retry and tcp-handoff listeners of that address:
// while every handler registered there would shed a new connection, they
// shed it in the handler's name before caddy-l4 accepts it into a
// goroutine of its own (internal/listensock), at a fraction of the cost.
// A handler without bounds registers too: its listener then sheds nothing.
func (h *KTLSHandler) serves(local net.Addr) {
	a, ok := local.(*net.TCPAddr)
	if !ok {
		return
	}
	ap := a.AddrPort()
	if _, ok := h.served.Load(ap); ok {
		return
	}
	h.servedMu.Lock()
	defer h.servedMu.Unlock()
	if _, loaded := h.served.LoadOrStore(ap, struct{}{}); loaded || h.cleaned {
		return
	}
	h.forget = append(h.forget, listensock.Serves(ap, acceptShedder{h}))
}

// Cleanup ends the handler's registrations with the listeners
// (caddy.CleanerUpper): its configuration is unloaded, and its bounds
// shed nothing more, whatever connections it still handshakes.
func (h *KTLSHandler) Cleanup() error {
	h.servedMu.Lock()
	defer h.servedMu.Unlock()
	h.cleaned = true
	for _, f := range h.forget {
		f()
	}
	h.forget = nil
	return nil
}

// acceptShedder is the handler as the listeners that shed in its name see
// it.
type acceptShedder struct{ h *KTLSHandler }

func (s acceptShedder) ShedNow() []zap.Field {
	return s.h.overloaded(offload.HandshakesInProgress.Load() + 1)
}

func (s acceptShedder) Shed(remote net.Addr, why []zap.Field) {
	s.h.failures.Shed(remote, append(why[:len(why):len(why)], zap.String("shed_by", "listener"))...)
}

// overloaded says which bound sheds a connection that arrives as the nth
// handshake in progress, as log fields; nil admits it.
func (h *KTLSHandler) overloaded(n int64) []zap.Field {
	if h.maxHandshakes > 0 && n > h.maxHandshakes {
		return []zap.Field{zap.Int64("max_handshakes", h.maxHandshakes)}
	}
	if bound := time.Duration(h.MaxSchedulingDelay); bound > 0 && n > h.cpus {
		if d := offload.SchedulingDelay.At(time.Now()); d > bound {
			return []zap.Field{zap.Duration("scheduling_delay", d), zap.Duration("max_scheduling_delay", bound),
				zap.Int64("handshakes", n)}
		}
	}
	return nil
}

// handshakeOwnStack runs the handshake on a goroutine of its own and
// waits for it: the goroutine that calls Handle carries the connection to
// its end, and a goroutine keeps the stack it grew while it lives (it
// shrinks only while it uses under a quarter of it). A handshake that
// verifies a certificate chain can grow one to 32 KiB.
func (h *KTLSHandler) handshakeOwnStack(cx *layer4.Connection) (*ktls.Conn, error) {
	type result struct {
		conn *ktls.Conn
		err  error
	}
	done := make(chan result, 1)
	go func() {
		conn, err := h.handshake(cx)
		done <- result{conn, err}
	}()
	r := <-done
	return r.conn, r.err
}

// handshake runs cx's TLS handshake and sets the connection variables of
// its session; on error the caller closes the returned conn.
func (h *KTLSHandler) handshake(cx *layer4.Connection) (*ktls.Conn, error) {
	cfg := h.ConnectionPolicies.TLSConfig(h.ctx)
	var hello l4tls.ClientHelloInfo
	getConfig := cfg.GetConfigForClient
	cfg.GetConfigForClient = func(chi *tls.ClientHelloInfo) (*tls.Config, error) {
		hello.ClientHelloInfo = *chi
		chosen, err := getConfig(chi)
		if err != nil || chosen == nil || h.DisableResumption {
			return chosen, err
		}
		return h.sessions.resumable(chosen, h.tickets), nil
	}
	// The handshake reads through cx, so bytes a matcher prefetched (the
	// ClientHello) are used first; kTLS is installed only once cx holds no
	// more buffered bytes (layeredConn.Socket).
	kconn := ktls.Server(layeredConn{cx}, cfg, h.opts)
	ctx, cancel := context.WithTimeout(cx.Context, time.Duration(h.HandshakeTimeout))
	err := kconn.HandshakeContext(ctx)
	cancel()
	if err != nil {
		return kconn, err
	}
	state := kconn.ConnectionState()

	var hellos []l4tls.ClientHelloInfo
	if v, ok := cx.GetVar(tlsClientHellosVar).([]l4tls.ClientHelloInfo); ok {
		hellos = v
	}
	cx.SetVar(tlsClientHellosVar, append(hellos, hello))
	var states []*tls.ConnectionState
	if v, ok := cx.GetVar(layer4.TLSConnectionStatesVarName).([]*tls.ConnectionState); ok {
		states = v
	}
	cx.SetVar(layer4.TLSConnectionStatesVarName, append(states, &state))
	addTLSPlaceholders(cx.Replacer(), &state)
	return kconn, nil
}

// tlsClientHellosVar is the connection variable caddy-l4's `tls` handler
// stores ClientHellos under (an unexported constant in l4tls); its matchers
// and l4proxy read it.
const tlsClientHellosVar = "tls_client_hellos"

// layeredConn adapts caddy-l4's Connection to ktls.Layered: the handshake
// reads through the Connection's prefetch buffer, and the kernel socket is
// handed out only once that buffer is empty.
type layeredConn struct{ cx *layer4.Connection }

func (l layeredConn) Read(p []byte) (int, error)         { return l.cx.Read(p) }
func (l layeredConn) Write(p []byte) (int, error)        { return l.cx.Write(p) }
func (l layeredConn) Close() error                       { return l.cx.Close() }
func (l layeredConn) LocalAddr() net.Addr                { return l.cx.LocalAddr() }
func (l layeredConn) RemoteAddr() net.Addr               { return l.cx.RemoteAddr() }
func (l layeredConn) SetDeadline(t time.Time) error      { return l.cx.SetDeadline(t) }
func (l layeredConn) SetReadDeadline(t time.Time) error  { return l.cx.SetReadDeadline(t) }
func (l layeredConn) SetWriteDeadline(t time.Time) error { return l.cx.SetWriteDeadline(t) }

// Socket implements ktls.Layered. It refuses (the session then stays in
// userspace with reason buffered-bytes) while caddy-l4's prefetch buffer
// still holds bytes, and when a handler before `ktls` put a userspace layer
// over the socket (the proxy_protocol handler's buffered reader), whose
// buffer the kernel would never see. The first is a guard: caddy-l4's
// matchers prefetch only before the server's first flight, and the
// handshake consumes every byte up to the client's Finished, so a
// successful handshake leaves the buffer empty.
func (l layeredConn) Socket() (*net.TCPConn, error) {
	if n := len(l.cx.MatchingBytes()); n > 0 {
		return nil, fmt.Errorf("%d bytes past the handshake are buffered in caddy-l4", n)
	}
	switch c := l.cx.Conn.(type) {
	case *net.TCPConn:
		return c, nil
	case interface{ Raw() net.Conn }: // go-proxyproto: a buffered reader over the socket
		return nil, fmt.Errorf("%T reads the socket through a userspace buffer", c)
	default:
		return nil, nil // not a TCP socket: ktls reports not-tcp
	}
}

// SyscallConn exposes the socket for socket options (keepalive) even when
// the session stayed in userspace, also from under the userspace layers a
// handler before `ktls` may have put on it (caddy-l4's proxy_protocol
// handler: a go-proxyproto Conn over the Connection). Options only: nothing
// is read or written past those layers.
func (l layeredConn) SyscallConn() (syscall.RawConn, error) {
	for c := l.cx.Conn; ; {
		switch v := c.(type) {
		case syscall.Conn:
			return v.SyscallConn()
		case *layer4.Connection:
			c = v.Conn
		case interface{ Raw() net.Conn }: // go-proxyproto
			c = v.Raw()
		default:
			return nil, fmt.Errorf("caddy-l4 connection wraps %T, which has no socket", c)
		}
	}
}

// Interface guards.
var (
	_ layer4.NextHandler = (*KTLSHandler)(nil)
	_ caddy.Provisioner  = (*KTLSHandler)(nil)
	_ caddy.Validator    = (*KTLSHandler)(nil)
	_ caddy.CleanerUpper = (*KTLSHandler)(nil)
	_ ktls.Layered       = layeredConn{}
)
