package forward

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"syscall"
	"time"

	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// Defaults for the zero values of Config.
const (
	DefaultPreambleTimeout = 5 * time.Second
	DefaultDialTimeout     = 10 * time.Second
	DefaultKeepAlive       = 30 * time.Second
	// DefaultMaxStandbyPerClient is Config.MaxStandbyPerClient's default.
	DefaultMaxStandbyPerClient = 64
)

// Config configures a Forwarder.
type Config struct {
	// Verifier checks preambles (keys, validity, binding, replay). Required.
	Verifier *preamble.Verifier
	// Policy decides which targets may be dialed. Required.
	Policy *TargetPolicy
	// Registry records tunnels and rejections. Required; normally one per
	// process, shared by every Forwarder.
	Registry *Registry
	// PreambleTimeout bounds the wait for the whole preamble. It is the only
	// read deadline a tunnel ever has (after the preamble only
	// MaxTunnelLifetime bounds it). Zero means DefaultPreambleTimeout.
	PreambleTimeout time.Duration
	// DialTimeout bounds the connect to the target. Zero means
	// DefaultDialTimeout.
	DialTimeout time.Duration
	// KeepAlive is the TCP keepalive idle time and probe interval on both
	// sockets (three unanswered probes end the tunnel). Zero means
	// DefaultKeepAlive.
	KeepAlive time.Duration
	// TCPUserTimeout sets TCP_USER_TIMEOUT on both sockets: how long sent data
	// may stay unacknowledged before the kernel drops the connection. Zero
	// leaves the kernel default.
	TCPUserTimeout time.Duration
	// Pipes supplies splice pipes; nil means splice.DefaultPipePool().
	Pipes *splice.PipePool
	// MaxTunnelLifetime, when positive, ends a tunnel that has been open that
	// long as a failure (both sides aborted; the error is a
	// *LifetimeError), whatever it is doing. It bounds how long a tunnel
	// outlives a client certificate revoked by a reload. Zero means none.
	MaxTunnelLifetime time.Duration
	// KeyClients binds signing keys to clients: a frame signed by a key ID
	// listed here is accepted only from a client one of whose
	// CertificateNames is in the key's list (ReasonKeyNotForClient
	// otherwise), so a gateway's key is worthless with another gateway's
	// certificate. Keys not listed are accepted from any client.
	KeyClients map[string][]string
	// MaxTunnelsPerSandbox caps the tunnels open at once to one sandbox, as the
	// Registry counts them (all its Forwarders' tunnels): one more is
	// refused (ReasonTunnelLimit) before its target is dialed. Zero means
	// no cap.
	MaxTunnelsPerSandbox int
	// RequireClientCertificate refuses every client that did not arrive with
	// a verified client certificate (Gateway.CertificateVerified),
	// with ReasonNoClientCertificate, before anything else is done for it:
	// nothing is read from it (not a byte of its preamble), nothing is
	// dialed. Only a client whose TLS session verified its certificate
	// reaches the preamble parser, the verifier, the replay cache and the
	// dialer. It is checked before draining, so such a client is reported
	// as what it is whatever the forwarder's state. The Caddy handler sets
	// it unless its test-only insecure_plaintext is on; false (the zero
	// value) serves clients the caller vouches for itself, such as this
	// package's tests on plain TCP.
	RequireClientCertificate bool
	// BandwidthToSandbox and BandwidthFromSandbox cap each sandbox's
	// tunnels, per direction, together: every tunnel of a sandbox in the
	// process shares one token bucket per direction (the Registry's). The
	// relay splices no more than the bucket grants, so the fast path stays
	// zero-copy; capped waits are counted (Registry.Throttled). Zero: no
	// cap.
	BandwidthToSandbox, BandwidthFromSandbox Bandwidth
	// Wake, when set, is asked to wake a sandbox whose target does not
	// answer the dial (refused, unreachable, timed out); the dial is then
	// retried, backing off, until the target answers or WakeTimeout ends
	// (ReasonWakeFailed when the control plane refuses the wake,
	// ReasonDialFailed when the target stays silent). The gateway's bytes
	// wait in the kernel meanwhile. Nil: a failed dial refuses at once.
	Wake *Waker
	// WakeTimeout bounds a wake and the dials after it. Zero means
	// DefaultWakeTimeout.
	WakeTimeout time.Duration
	// StandbyTimeout, when positive, lets a client's standby connections
	// (standby.go) wait that long for their first preamble byte. Zero:
	// every connection has PreambleTimeout from its start.
	StandbyTimeout time.Duration
	// MaxStandbyPerClient bounds the connections of one client certificate
	// (Gateway.Certificate) that wait under StandbyTimeout at once; beyond
	// it a connection has PreambleTimeout. Zero, with StandbyTimeout set,
	// means DefaultMaxStandbyPerClient.
	MaxStandbyPerClient int
	// MaxDials bounds the tunnels that dial their target at once, a wake
	// and its dials included, as the Registry counts them (all its
	// Forwarders' dials): one more is refused with ReasonOverloaded before
	// it dials, so that targets slow to answer or to wake hold a bounded
	// number of connections, goroutines and gateways' requests. Zero means
	// no bound.
	MaxDials int
	// OnWake, when set, is called after each wake with the sandbox, its
	// outcome (WakeOutcomes) and how long it took, on the tunnel's
	// goroutine.
	OnWake func(WakeEvent)
	// ProxyProtocol, when 2, writes a PROXY protocol v2 header
	// (ProxyV2Header) to every target right after it is dialed, before any
	// tenant byte: source the client identity the signed preamble carries
	// (extension 0x0010, docs/preamble.md §3.1), or the gateway connection's
	// own peer when it carries none; destination the target; TLVs the sandbox
	// ID (PP2TypeSandboxID) and the client's identity string
	// (PP2TypeClientID) when it has one. The header's bytes are not tenant
	// bytes: no counter of the tunnel includes them. Zero writes none; other
	// values are refused by New.
	ProxyProtocol int
	// HandOffConn, when set (with AdoptConn), lets MoveTunnels move this
	// Forwarder's tunnels: it gives up a gateway connection's session (the relay's
	// connection, paused) and returns its encoded state and its socket,
	// valid until the connection is closed (its descriptor is passed on as
	// it is), or an error when it cannot (a userspace TLS session). The
	// glue sets it to the kernel TLS handoff (ktls.Conn.Handoff).
	HandOffConn func(net.Conn) (state []byte, socket syscall.Conn, err error)
	// AdoptConn, when set, lets this Forwarder adopt tunnels
	// (Forwarder.Adopt), and take back a session it gave up whose move
	// failed: it builds a gateway connection from what HandOffConn
	// returned (the socket as received, an *os.File, or HandOffConn's own),
	// and the function that drops it without ending its session (the other
	// process keeps it).
	AdoptConn func(state []byte, socket syscall.Conn) (conn net.Conn, release func(), err error)
	// MoveName names this Forwarder among its process's for a move: a
	// moved standby connection, which has no preamble yet to choose a
	// forwarder by, carries it (MovedStandby.Forwarder), so that the
	// adopting process can pick its own forwarder of that name.
	MoveName string
	// OnStep, when set, is called as each timed Step of a tunnel's opening
	// ends, with how long it took, whatever its outcome (a refusal is also
	// counted by its reason in the Registry). It runs on the tunnel's
	// goroutine, before the tunnel goes on, so it must be quick.
	OnStep func(Step, time.Duration)
}

// Step names a step of a tunnel's opening that Config.OnStep times.
type Step string

// The timed steps.
const (
	// StepPreambleVerify is the verdict on a preamble frame: from the frame
	// read whole to the verdict of the verifier (parse, key, signature,
	// validity, channel binding, replay) and of the key's client binding
	// (Config.KeyClients), accepted or refused. A frame never read whole
	// (timeout, truncated, oversized) has no verification.
	StepPreambleVerify Step = "preamble-verify"
	// StepDial is the connect to the target, whether it succeeded or not
	// (up to Config.DialTimeout).
	StepDial Step = "dial"
)

// Forwarder carries tunnels: one Serve call per gateway connection.
type Forwarder struct {
	cfg  Config
	sock socketOptions
}

// New validates cfg and returns a Forwarder.
func New(cfg Config) (*Forwarder, error) {
	if cfg.Verifier == nil || cfg.Policy == nil || cfg.Registry == nil {
		return nil, errors.New("forward: Config needs a Verifier, a Policy and a Registry")
	}
	if cfg.PreambleTimeout < 0 || cfg.DialTimeout < 0 || cfg.KeepAlive < 0 || cfg.TCPUserTimeout < 0 {
		return nil, errors.New("forward: negative timeout")
	}
	if cfg.MaxTunnelsPerSandbox < 0 || cfg.MaxTunnelLifetime < 0 {
		return nil, errors.New("forward: negative MaxTunnelsPerSandbox or MaxTunnelLifetime")
	}
	if cfg.ProxyProtocol != 0 && cfg.ProxyProtocol != 2 {
		return nil, fmt.Errorf("forward: ProxyProtocol %d, want 0 (none) or 2", cfg.ProxyProtocol)
	}
	if cfg.PreambleTimeout == 0 {
		cfg.PreambleTimeout = DefaultPreambleTimeout
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.KeepAlive == 0 {
		cfg.KeepAlive = DefaultKeepAlive
	}
	if cfg.BandwidthToSandbox.BytesPerSecond < 0 || cfg.BandwidthFromSandbox.BytesPerSecond < 0 ||
		cfg.BandwidthToSandbox.Burst < 0 || cfg.BandwidthFromSandbox.Burst < 0 {
		return nil, errors.New("forward: negative bandwidth cap or burst")
	}
	if cfg.WakeTimeout < 0 {
		return nil, errors.New("forward: negative WakeTimeout")
	}
	if cfg.WakeTimeout == 0 {
		cfg.WakeTimeout = DefaultWakeTimeout
	}
	if cfg.StandbyTimeout < 0 || cfg.MaxStandbyPerClient < 0 || cfg.MaxDials < 0 {
		return nil, errors.New("forward: negative StandbyTimeout, MaxStandbyPerClient or MaxDials")
	}
	if cfg.HandOffConn != nil && cfg.AdoptConn == nil {
		// A tunnel the other process does not take runs on here, on the
		// connection adopted back.
		return nil, errors.New("forward: HandOffConn needs AdoptConn")
	}
	if cfg.MaxStandbyPerClient == 0 {
		cfg.MaxStandbyPerClient = DefaultMaxStandbyPerClient
	}
	return &Forwarder{cfg: cfg, sock: socketOptions{keepAlive: cfg.KeepAlive, userTimeout: cfg.TCPUserTimeout}}, nil
}

// Gateway is the gateway's side of one tunnel: the connection a gateway
// opened to this forwarder, and what its TLS session says of the gateway.
type Gateway struct {
	// Conn is what the preamble is read from. It may be a wrapper that
	// buffers bytes read ahead from the socket (caddy-l4's Connection).
	Conn net.Conn
	// Binding is the channel binding of the TLS session the gateway arrived
	// on (preamble.ChannelBinding), or nil when it has none.
	Binding []byte
	// Unwrap, when set, is called after the preamble to get the connection
	// the relay should use (the one under Conn's buffer, so that splice can
	// reach the socket) and the bytes Conn has buffered beyond the preamble,
	// which are sent to the target first. When nil, the relay uses Conn.
	Unwrap func() (relay net.Conn, buffered []byte)
	// OnOpen, when set, is called once the target is connected and the
	// tunnel registered, before any byte is relayed.
	OnOpen func(TunnelInfo)
	// Peer names the gateway in logs and the registry: its remote address.
	Peer string
	// Certificate is the subject of the gateway's TLS certificate, for the
	// registry (Origin); empty when there is none.
	Certificate string
	// CertificateNames are the names of the gateway's TLS certificate (its
	// Common Name and DNS names), matched against Config.KeyClients.
	CertificateNames []string
	// CertificateVerified says that Conn is a TLS session whose
	// handshake verified the gateway's certificate: the gateway sent one and
	// the server built a chain from it to a trusted root
	// (tls.ConnectionState.VerifiedChains is not empty). A certificate the
	// server only received (crypto/tls's RequireAnyClientCert, Caddy's
	// client_auth mode "require") does not count. Config.RequireClientCertificate
	// refuses gateways without one.
	CertificateVerified bool
	// StandbyBegan is when the connection's standby wait (standby.go)
	// began, zero when it has not: a caller leaves it zero, Serve sets it
	// (in its copy) when the wait begins, and a move carries it
	// (Registry.MoveStandby, Forwarder.AdoptStandby), so that the wait in
	// the process that adopted the connection ends StandbyTimeout after it
	// began in the first.
	StandbyBegan time.Time
}

// Result describes a tunnel that was carried.
type Result struct {
	Tunnel TunnelInfo
	Relay  splice.Stats
	// Duration is how long the tunnel lived: from its registration (once
	// the target answered; Tunnel.Opened) to its end, when Serve returns.
	// Zero for a refused tunnel (Tunnel.ID is zero).
	Duration time.Duration
	// Moved: the tunnel went on in another process (Registry.MoveTunnels);
	// Relay holds its counters until then.
	Moved bool
}

// Serve carries one tunnel and returns when it has ended; it always closes
// the gateway's connection. A refused tunnel returns a *preamble.Error or a
// *RefusalError (see ReasonOf), is counted in the registry, has not sent a
// single byte to any target, and ends the gateway's connection as refused
// (see refuse). A tunnel that ran returns its counters and the relay's
// error, nil when both directions ended cleanly; one that failed, before
// the relay or in it, ends both connections as failures (splice.Abort), so
// neither peer takes it for complete.
func (f *Forwarder) Serve(c Gateway) (Result, error) {
	// Everything before the relay runs on a goroutine of its own, which
	// ends with it. A goroutine keeps the stack it grew while it lives
	// (it shrinks only while it uses under a quarter of it), and Serve's
	// caller carries a direction to the tunnel's end: an opening that grew
	// its stack (the preamble's check, the target's dial, a logging
	// OnOpen) would hold 32 KiB per tunnel for the tunnel's lifetime.
	var op opened
	done := make(chan struct{})
	go func() {
		op = f.openRelay(&c)
		close(done)
	}()
	<-done
	if op.tun == nil {
		return Result{}, op.err
	}
	defer op.tun.Close()
	defer op.release()
	if op.err != nil {
		return op.ended(Result{}, op.err)
	}
	return op.ended(f.carry(op.ctx, op.tun, splice.New(op.relay, op.upstream, op.opts), op.relay, op.upstream, op.opts, splice.Stats{}))
}

// opened is a tunnel openRelay made ready to carry: its relay's ends and
// options, or why it ended first (err, with tun nil where no tunnel was
// opened).
type opened struct {
	tun             *Tunnel
	ctx             context.Context
	relay, upstream net.Conn
	opts            splice.Options
	release         func()
	err             error
}

// ended fills in what every return of an open tunnel reports.
func (op *opened) ended(res Result, err error) (Result, error) {
	res.Tunnel, res.Duration = op.tun.Info(), time.Since(op.tun.Opened)
	return res, err
}

// openRelay opens c's tunnel (Serve) up to the relay.
func (f *Forwarder) openRelay(c *Gateway) opened {
	f.cfg.Registry.opening.Add(1)
	upstream, tun, ctx, proxyHdr, err := f.open(c)
	f.cfg.Registry.opening.Add(-1)
	if se, ok := errors.AsType[*StandbyEndError](err); ok {
		// No tunnel was asked for: an expired one learns it is gone by
		// the refusal's alert, a closed one needs nothing, and a moved
		// one's Close releases this process's descriptors only (its
		// session was handed off).
		if se.End == StandbyExpired {
			refuse(*c)
		} else {
			c.Conn.Close()
		}
		return opened{err: err}
	}
	if err != nil {
		refuse(*c)
		f.cfg.Registry.Reject(ReasonOf(err))
		return opened{err: err}
	}
	op := opened{tun: tun, ctx: ctx, upstream: upstream, release: func() {}}
	if c.OnOpen != nil {
		c.OnOpen(tun.Info())
	}
	relay, buffered := c.Conn, []byte(nil)
	if c.Unwrap != nil {
		relay, buffered = c.Unwrap()
	}
	op.relay = relay
	fail := func(err error) opened {
		splice.Abort(relay)
		splice.Abort(upstream)
		op.err = err
		return op
	}
	if err := f.sock.applyToClient(relay); err != nil {
		return fail(fmt.Errorf("forward: client socket: %w", err))
	}
	if proxyHdr != nil {
		// First on the target's socket, before any tenant byte, and counted
		// as none of the tunnel's bytes.
		if _, err := upstream.Write(proxyHdr); err != nil {
			return fail(fmt.Errorf("forward: PROXY header to target: %w", err))
		}
	}
	if len(buffered) > 0 {
		// Bytes the client sent right behind the preamble that a wrapper
		// already read: they precede everything still in the socket.
		n, werr := upstream.Write(buffered)
		tun.AddToSandbox(int64(n))
		if werr != nil {
			return fail(fmt.Errorf("forward: buffered client bytes to target: %w", werr))
		}
	}
	op.opts, op.release = f.relayOptions(tun)
	return op
}

// relayOptions are the relay options of tun, and the function that
// releases its bandwidth buckets when it ends.
func (f *Forwarder) relayOptions(tun *Tunnel) (splice.Options, func()) {
	limit, release := f.cfg.Registry.limits(tun.Sandbox, f.cfg.BandwidthToSandbox, f.cfg.BandwidthFromSandbox)
	return splice.Options{
		Pipes: f.cfg.Pipes,
		Limit: limit,
		// A gateway ends its tunnel in order with close_notify: without
		// it the stream was cut, and the target must not read a complete
		// request in what is left of it.
		RequireCloseNotify: [2]bool{splice.AToB: true},
		OnBytes: func(d splice.Direction, n int) {
			if d == splice.AToB {
				tun.AddToSandbox(int64(n))
			} else {
				tun.AddFromSandbox(int64(n))
			}
		},
	}, release
}

// carry runs relay (gw ↔ upstream) to the end of tun: a tunnel Serve
// opened, or one another process moved here (base: its relay's counters
// then). Config.MaxTunnelLifetime counts from the tunnel's opening. A
// tunnel that MoveTunnels moved ends here with Result.Moved, its
// connections' descriptors closed and the sockets left to the other
// process; one it kept runs on.
func (f *Forwarder) carry(ctx context.Context, tun *Tunnel, relay *splice.Relay, gw, upstream net.Conn, opts splice.Options, base splice.Stats) (Result, error) {
	if f.cfg.MaxTunnelLifetime > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadlineCause(ctx, tun.Opened.Add(f.cfg.MaxTunnelLifetime), &LifetimeError{Lifetime: f.cfg.MaxTunnelLifetime})
		defer cancel()
	}
	mv := &movable{f: f, relay: relay, gw: gw, upstream: upstream, opts: opts, verdict: make(chan moveVerdict, 1)}
	tun.movable.Store(mv)
	defer tun.movable.Store(nil)
	for {
		res, err := relay.Run(ctx)
		if errors.Is(err, splice.ErrPaused) {
			v := <-mv.verdict
			switch {
			case v.moved:
				f.cfg.Registry.addRelay(res, base)
				gw.Close()
				upstream.Close()
				return Result{Relay: res, Moved: true}, nil
			case v.resumed:
				mv.mu.Lock()
				relay, gw = mv.relay, mv.gw
				mv.mu.Unlock()
				continue
			}
			err = errors.New("forward: the tunnel did not resume after a move that failed")
		}
		f.cfg.Registry.addRelay(res, base)
		if errors.As(err, new(*LifetimeError)) {
			f.cfg.Registry.expired.Add(1)
		}
		return Result{Relay: res}, err
	}
}

// LifetimeError ends a tunnel that reached Config.MaxTunnelLifetime.
type LifetimeError struct {
	Lifetime time.Duration
}

func (e *LifetimeError) Error() string {
	return fmt.Sprintf("the tunnel reached its lifetime of %v", e.Lifetime)
}

// refuse ends a refused tunnel's gateway connection so that the gateway
// cannot take it for an empty tunnel that ran: Refuse on the connection
// under Conn's buffer where it has one, else a failure (splice.Abort: a
// reset). Nothing was relayed, so nothing is lost by not waiting.
func refuse(c Gateway) {
	conn := c.Conn
	if c.Unwrap != nil {
		conn, _ = c.Unwrap()
	}
	if r, ok := conn.(splice.Refuser); ok {
		r.Refuse()
	} else {
		splice.Abort(conn)
	}
	c.Conn.Close()
}

// errNoClientCertificate is the cause of ReasonNoClientCertificate.
var errNoClientCertificate = errors.New("the connection carries no verified client certificate: " +
	"only a TLS session whose handshake verified the gateway's certificate may open a tunnel")

// open runs everything up to a connected target: client certificate,
// preamble, verification, key binding, policy, tunnel cap, dial and
// registration; and the PROXY header to write first when Config.ProxyProtocol
// asks for one. A standby connection's move that failed may have replaced
// c.Conn (readFrame).
func (f *Forwarder) open(c *Gateway) (*net.TCPConn, *Tunnel, context.Context, []byte, error) {
	up, tun, ctx, claims, err := f.openClaims(c)
	if err != nil || f.cfg.ProxyProtocol != 2 {
		return up, tun, ctx, nil, err
	}
	src, id := peerAddrPort(c.Conn, c.Peer), ""
	if ci, ok := claims.ClientIdentity(); ok {
		src, id = ci.Addr, ci.ID
	}
	return up, tun, ctx, ProxyV2Header(src, claims.Target, claims.SandboxID, id), nil
}

func (f *Forwarder) openClaims(c *Gateway) (*net.TCPConn, *Tunnel, context.Context, preamble.Claims, error) {
	var none preamble.Claims
	// First: an unauthenticated client gets nothing from this forwarder,
	// not even a read of its bytes.
	if f.cfg.RequireClientCertificate && !c.CertificateVerified {
		return nil, nil, nil, none, &RefusalError{Reason: ReasonNoClientCertificate, Err: errNoClientCertificate}
	}
	if f.cfg.Registry.Draining() {
		return nil, nil, nil, none, &RefusalError{Reason: ReasonDraining, Err: drainingError{}}
	}
	frame, err := f.readFrame(c)
	if err != nil {
		return nil, nil, nil, none, err
	}
	if err := c.Conn.SetReadDeadline(time.Time{}); err != nil {
		return nil, nil, nil, none, &preamble.Error{Reason: preamble.ReasonReadFailed, Detail: "clear preamble deadline", Err: err}
	}
	verifyStart := time.Now()
	claims, err := f.cfg.Verifier.Verify(frame, c.Binding)
	if err == nil {
		err = f.checkKeyClient(claims.KeyID, c.CertificateNames)
	}
	f.step(StepPreambleVerify, verifyStart)
	if err != nil {
		return nil, nil, nil, none, err
	}
	if err := f.cfg.Policy.Check(claims.Target); err != nil {
		return nil, nil, nil, none, &RefusalError{Reason: ReasonTargetDenied, Err: fmt.Errorf("sandbox %s: %w", claims.SandboxID, err)}
	}
	// Checked before the dial, so that a sandbox at its cap or closed
	// (Registry.Close) costs its target nothing; Open checks again, for
	// tunnels opening at once.
	if err := f.cfg.Registry.checkAdmit(claims.SandboxID, f.cfg.MaxTunnelsPerSandbox); err != nil {
		return nil, nil, nil, none, err
	}
	if c.gone() {
		return nil, nil, nil, none, &RefusalError{Reason: ReasonGatewayGone, Err: fmt.Errorf("sandbox %s: %w", claims.SandboxID, errGatewayGone)}
	}
	up, err := f.dialTarget(claims, c.gone)
	if err != nil {
		return nil, nil, nil, none, err
	}
	target := claims.Target.String()
	// Register only once the target answered, so open-tunnel counts never
	// include dials that fail; a drain that began meanwhile still wins.
	key, _ := f.cfg.Verifier.Key(claims.KeyID)
	origin := Origin{Peer: c.Peer, Certificate: c.Certificate, KeyID: claims.KeyID, key: key, names: c.CertificateNames}
	tun, ctx, err := f.cfg.Registry.Open(claims.SandboxID, target, origin, f.cfg.MaxTunnelsPerSandbox)
	if err != nil {
		up.Close()
		return nil, nil, nil, none, err
	}
	return up, tun, ctx, claims, nil
}

// errGatewayGone is the cause of a ReasonGatewayGone refusal.
var errGatewayGone = errors.New("the gateway left after its preamble (a reset, or an end without close_notify): nothing was dialed")

// gone reports whether the gateway left with nothing sent past its
// preamble still to carry (ktls.Conn.Gone).
func (c *Gateway) gone() bool {
	conn, buffered := c.Conn, []byte(nil)
	if c.Unwrap != nil {
		conn, buffered = c.Unwrap()
	}
	g, ok := conn.(interface{ Gone() bool })
	return ok && len(buffered) == 0 && g.Gone()
}

// dialTarget connects to the claims' target, waking its sandbox when
// Config.Wake asks unless the gateway is gone by then, as one of the
// Registry's dials in progress (Config.MaxDials).
func (f *Forwarder) dialTarget(claims preamble.Claims, gone func() bool) (*net.TCPConn, error) {
	done, err := f.cfg.Registry.startDial(f.cfg.MaxDials)
	if err != nil {
		return nil, err
	}
	defer done()
	dialStart := time.Now()
	up, err := f.sock.dial(context.Background(), claims.Target.String(), f.cfg.DialTimeout)
	f.step(StepDial, dialStart)
	if err != nil && f.cfg.Wake != nil {
		if gone() {
			return nil, &RefusalError{Reason: ReasonGatewayGone, Err: fmt.Errorf("sandbox %s: target %s: %v; not woken: %w", claims.SandboxID, claims.Target, err, errGatewayGone)}
		}
		return f.wakeAndDial(claims.SandboxID, claims.Target, err)
	}
	if err != nil {
		return nil, &RefusalError{Reason: ReasonDialFailed, Err: fmt.Errorf("sandbox %s: %w", claims.SandboxID, err)}
	}
	return up, nil
}

// step reports to Config.OnStep that s, begun at start, has ended.
func (f *Forwarder) step(s Step, start time.Time) {
	if f.cfg.OnStep != nil {
		f.cfg.OnStep(s, time.Since(start))
	}
}

// checkKeyClient refuses a frame signed by keyID from a client whose
// certificate has none of the names the key is bound to (Config.KeyClients).
func (f *Forwarder) checkKeyClient(keyID string, names []string) error {
	clients, bound := f.cfg.KeyClients[keyID]
	if !bound || slices.ContainsFunc(names, func(n string) bool { return slices.Contains(clients, n) }) {
		return nil
	}
	return &RefusalError{Reason: ReasonKeyNotForClient, Err: fmt.Errorf("key %s is bound to %v, the client's certificate names %v", keyID, clients, names)}
}

// ReasonOf returns the stable reason of a refused tunnel: a preamble
// package reason, one of this package's Reasons, "" for nil and
// preamble.ReasonOther for anything else.
func ReasonOf(err error) string {
	var re *RefusalError
	if errors.As(err, &re) {
		return string(re.Reason)
	}
	return preamble.ReasonOf(err)
}
