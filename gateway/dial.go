package gateway

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Defaults for the zero values of Config.
const (
	DefaultDialTimeout = 10 * time.Second
	DefaultKeepAlive   = 30 * time.Second
)

// Route names one tunnel: the forwarder to dial, and what its preamble
// asks for.
type Route struct {
	// Forwarder is the forwarder's host:port.
	Forwarder string
	// Sandbox is the sandbox ID (preamble.Claims.SandboxID) in its
	// canonical, lowercase form: ParseRoute makes it so, and Dial refuses
	// another before it dials.
	Sandbox string
	// Target is the sandbox service's private address and port.
	Target netip.AddrPort
	// Client, when its Addr is valid, is the end user the tunnel is for:
	// Dial signs it into the preamble as the client identity extension
	// (preamble.ExtClientIdentity, docs/preamble.md §3.1), which a forwarder
	// may pass to the target (proxy_protocol v2). The zero value sends none.
	// Tunnels of different clients are different routes: a connection pool
	// keyed by Route never lends one client's tunnel to another.
	Client preamble.ClientIdentity
}

// ClientFrom is the client identity of a user connecting from addr (a
// net.Addr's String form, ip:port; an IPv4-mapped address is written as
// IPv4) with identity id: the zero ClientIdentity, no client, when addr
// names no IP address and port (a Unix socket, an empty string).
func ClientFrom(addr, id string) preamble.ClientIdentity {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return preamble.ClientIdentity{}
	}
	return preamble.ClientIdentity{Addr: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), ID: id}
}

func (r Route) String() string {
	return fmt.Sprintf("%s (target %s) via %s", r.Sandbox, r.Target, r.Forwarder)
}

// ParseRoute builds a Route from text, such as configuration placeholders
// replaced for one request, and says which part is wrong when one is. The
// sandbox ID is case-insensitive: the Route holds its lowercase form
// (preamble.CanonicalSandboxID), so every spelling is one sandbox.
func ParseRoute(forwarder, sandbox, target string) (Route, error) {
	if _, _, err := net.SplitHostPort(forwarder); err != nil || forwarder == "" {
		return Route{}, &RouteError{Field: "forwarder", Value: forwarder, Err: errors.New("want host:port")}
	}
	canonical, err := preamble.CanonicalSandboxID(sandbox)
	if err != nil {
		return Route{}, &RouteError{Field: "sandbox", Value: sandbox, Err: err}
	}
	ap, err := netip.ParseAddrPort(target)
	if err != nil {
		return Route{}, &RouteError{Field: "target", Value: target, Err: errors.New("want an IP address and a port, such as 10.0.0.7:8080 or [fd00::7]:8080 (never a host name: the forwarder does no DNS)")}
	}
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	if err := preamble.CheckTarget(ap); err != nil {
		return Route{}, &RouteError{Field: "target", Value: target, Err: err}
	}
	return Route{Forwarder: forwarder, Sandbox: canonical, Target: ap}, nil
}

// RouteError is a Route that cannot be built: nothing was dialed.
type RouteError struct {
	Field, Value string
	Err          error
}

func (e *RouteError) Error() string {
	return fmt.Sprintf("gateway: route %s %q: %v", e.Field, e.Value, e.Err)
}

func (e *RouteError) Unwrap() error { return e.Err }

// Config configures a Dialer.
type Config struct {
	// TLS is the gateway's side of the mutual TLS session with forwarders:
	// its client certificate (Certificates or GetClientCertificate), the
	// roots forwarders' certificates chain to (RootCAs) and, optionally,
	// the name they must carry (ServerName; empty: the forwarder's host).
	// Required. TLS 1.3 is required whatever MinVersion says: the
	// preamble is bound to the session's exporter. ClientSessionCache, when
	// set, holds the sessions DisableResumption does not turn off; nil: the
	// Dialer keeps its own of DefaultSessionCacheSize.
	TLS *tls.Config
	// DisableResumption makes every forwarder connection a full handshake.
	// By default a connection resumes the TLS session of an earlier one to
	// the same forwarder address (sessions are kept per address, whatever
	// ServerName says), which spares the forwarder the certificate
	// verification and the signature of a full handshake; a resumed session
	// is offloaded like a full one, and the preamble is bound to its own
	// exporter all the same.
	DisableResumption bool
	// Signer signs the preambles. Required.
	Signer *preamble.Signer
	// KTLS says how each forwarder connection is offloaded to kernel TLS;
	// the zero value seals and opens in the kernel where it can and falls
	// back to crypto/tls where it cannot. KTLS.Disable keeps every session
	// in userspace.
	KTLS ktls.Options
	// UserKTLS is what a user's session that the Dialer adopts takes from
	// ktls.Options (ktls.Adopt: the Observer; the offload and the limits
	// stay the session's): the session of a tunnel moved here
	// (AdoptTunnel), or adopted back when a move failed (MoveTunnels).
	UserKTLS ktls.Options
	// DialTimeout bounds the connect, the TLS handshake and the preamble's
	// write together. Zero means DefaultDialTimeout.
	DialTimeout time.Duration
	// HandshakeTimeout, when positive, bounds the TLS handshake within
	// DialTimeout.
	HandshakeTimeout time.Duration
	// KeepAlive is the TCP keepalive idle time and probe interval of
	// forwarder connections (three unanswered probes end one). Zero means
	// DefaultKeepAlive; negative disables keepalive.
	KeepAlive time.Duration
	// PreambleTTL is the validity each preamble claims. Zero means
	// preamble.DefaultTTL.
	PreambleTTL time.Duration
	// Standby, when positive, is how many standby connections Dial keeps
	// ready for each forwarder it dialed: mutual TLS done, no preamble
	// written yet (standby.go). A tunnel then pays only its preamble and
	// the forwarder's dial of the target. Zero: none.
	Standby int
	// StandbyMaxIdle is how long a standby connection is kept before it is
	// closed unused; it must stay below the forwarders' standby_timeout.
	// Zero means DefaultStandbyMaxIdle.
	StandbyMaxIdle time.Duration
	// OnStandby, when set, is told how each standby connection ended
	// (StandbyOutcomes), on whatever goroutine ended it.
	OnStandby func(outcome string)
	// MoveName names this Dialer in the tunnels it moves to another
	// process (MovedTunnel.Dialer), so that the other process adopts each
	// in the Dialer of the same name. Empty: unnamed.
	MoveName string
}

// DefaultSessionCacheSize is how many forwarder sessions a Dialer keeps for
// resumption when Config.TLS has no ClientSessionCache.
const DefaultSessionCacheSize = 1024

// Dialer opens tunnels to forwarders. It is safe for concurrent use.
type Dialer struct {
	cfg Config
	tls *tls.Config
	net net.Dialer
	// cert is the client certificate's leaf, for the errors that concern
	// it; nil when GetClientCertificate gives it.
	cert *x509.Certificate
	// standby holds the standby connections (Config.Standby).
	standby *standbys
	// tunnels are the tunnels the Dialer's relays carry (MoveTunnels).
	tunnels registry
}

// New returns a Dialer for cfg.
func New(cfg Config) (*Dialer, error) {
	if cfg.TLS == nil {
		return nil, errors.New("gateway: no TLS configuration: the forwarder needs the gateway's client certificate")
	}
	if cfg.TLS.InsecureSkipVerify {
		return nil, errors.New("gateway: the TLS configuration skips verifying the forwarder's certificate: a tunnel's preamble would go to whoever answers")
	}
	if len(cfg.TLS.Certificates) == 0 && cfg.TLS.GetClientCertificate == nil {
		return nil, errors.New("gateway: the TLS configuration has no client certificate: forwarders refuse gateways without one")
	}
	if cfg.Signer == nil {
		return nil, errors.New("gateway: no preamble signer")
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.DialTimeout < 0 || cfg.HandshakeTimeout < 0 || cfg.PreambleTTL < 0 {
		return nil, errors.New("gateway: negative dial timeout, handshake timeout or preamble TTL")
	}
	if cfg.KeepAlive == 0 {
		cfg.KeepAlive = DefaultKeepAlive
	}
	if cfg.PreambleTTL == 0 {
		cfg.PreambleTTL = preamble.DefaultTTL
	}
	t := cfg.TLS.Clone()
	t.MinVersion = tls.VersionTLS13
	if t.MaxVersion != 0 && t.MaxVersion < tls.VersionTLS13 {
		return nil, errors.New("gateway: the TLS configuration's MaxVersion is below TLS 1.3, which the preamble's channel binding needs")
	}
	switch {
	case cfg.DisableResumption:
		t.ClientSessionCache = nil
	case t.ClientSessionCache == nil:
		t.ClientSessionCache = tls.NewLRUClientSessionCache(DefaultSessionCacheSize)
	}
	if cfg.Standby < 0 || cfg.StandbyMaxIdle < 0 {
		return nil, errors.New("gateway: negative Standby or StandbyMaxIdle")
	}
	if cfg.StandbyMaxIdle == 0 {
		cfg.StandbyMaxIdle = DefaultStandbyMaxIdle
	}
	d := &Dialer{cfg: cfg, tls: t}
	d.standby = newStandbys(d)
	if t.GetClientCertificate == nil {
		// crypto/tls sends no certificate whose issuer is not among the
		// CAs the server names (a forwarder's client_auth trust_pool):
		// that forwarder would see none and say only that. Sent, it is
		// refused as untrusted (unknown_ca), on both sides.
		cert := &t.Certificates[0]
		d.cert = leafOf(cert)
		t.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
	}
	d.net.KeepAliveConfig = net.KeepAliveConfig{Enable: cfg.KeepAlive > 0, Idle: cfg.KeepAlive, Interval: cfg.KeepAlive, Count: 3}
	if cfg.KeepAlive < 0 {
		d.net.KeepAlive = -1
	}
	return d, nil
}

// Dial opens a tunnel for r: it connects to r.Forwarder, completes mutual
// TLS (offloaded as Config.KTLS says), then signs and writes r's preamble,
// bound to the session. The returned connection carries the tenant's bytes;
// how it ends is the forwarder's verdict (EndOf). Every error is a
// *DialError, and then nothing was sent past the preamble: nothing reached
// the sandbox. ctx and Config.DialTimeout bound the whole of it.
//
// Once the forwarder answered, Dial refills its standby connections
// (Config.Standby), after the preamble is written.
func (d *Dialer) Dial(ctx context.Context, r Route) (*ktls.Conn, error) {
	return d.dial(ctx, r, nil, func() { d.standby.refill(r.Forwarder) })
}

// dial is Dial; connected is called, after the preamble was written or
// failed, when the forwarder answered the connection (mutual TLS done, or
// a standby connection taken). userGone, where set, is asked before
// anything is dialed and again before the preamble: ErrUserGone then, the
// forwarder's connection kept as a standby one (standbys.keep).
func (d *Dialer) dial(ctx context.Context, r Route, userGone func() bool, connected func()) (*ktls.Conn, error) {
	if userGone != nil && userGone() {
		return nil, ErrUserGone
	}
	// Checked before anything is dialed, as the client below: a preamble
	// that cannot be signed costs the forwarder nothing.
	if err := preamble.CheckSandboxID(r.Sandbox); err != nil {
		return nil, &DialError{Route: r, Step: StepPreamble, Err: err}
	}
	var exts []preamble.Extension
	if r.Client.Addr.IsValid() || r.Client.ID != "" {
		ext, err := r.Client.Extension()
		if err != nil {
			return nil, &DialError{Route: r, Step: StepPreamble, Err: err}
		}
		exts = []preamble.Extension{ext}
	}
	ctx, cancel := context.WithTimeout(ctx, d.cfg.DialTimeout)
	defer cancel()
	conn := d.standby.take(r.Forwarder)
	if conn == nil {
		var step string
		var err error
		if conn, step, err = d.connect(ctx, r.Forwarder); err != nil {
			if de := d.CertificateRefusal(r, err); de != nil {
				return nil, de
			}
			return nil, &DialError{Route: r, Step: step, Err: err}
		}
	}
	if userGone != nil && userGone() {
		d.standby.keep(r.Forwarder, conn)
		return nil, ErrUserGone
	}
	defer connected()
	now := time.Now()
	claims := preamble.Claims{SandboxID: r.Sandbox, Target: r.Target, IssuedAt: now, ExpiresAt: now.Add(d.cfg.PreambleTTL), Extensions: exts}
	if err := preamble.Send(ctx, conn, d.cfg.Signer, claims); err != nil {
		// A forwarder that refused the certificate may have closed the
		// connection before the preamble reached it, which then fails
		// with a reset: its alert, sent before, is still to be read.
		if de := d.CertificateRefusal(r, pendingAlert(conn)); de != nil {
			conn.Close()
			return nil, de
		}
		conn.Abort()
		return nil, &DialError{Route: r, Step: StepPreamble, Err: err}
	}
	return conn, nil
}

// connect connects to forwarder and completes mutual TLS, offloaded as
// Config.KTLS says; on error it names the step that failed.
func (d *Dialer) connect(ctx context.Context, forwarder string) (*ktls.Conn, string, error) {
	raw, err := d.net.DialContext(ctx, "tcp", forwarder)
	if err != nil {
		return nil, StepConnect, err
	}
	cfg := d.tls
	if cfg.ServerName == "" || cfg.ClientSessionCache != nil {
		cfg = cfg.Clone()
		if cfg.ServerName == "" {
			cfg.ServerName, _, _ = net.SplitHostPort(forwarder)
		}
		if cfg.ClientSessionCache != nil {
			cfg.ClientSessionCache = forwarderSessions{cfg.ClientSessionCache, forwarder}
		}
	}
	conn := ktls.Client(raw, cfg, d.cfg.KTLS)
	hctx := ctx
	if d.cfg.HandshakeTimeout > 0 {
		var cancel context.CancelFunc
		hctx, cancel = context.WithTimeout(ctx, d.cfg.HandshakeTimeout)
		defer cancel()
	}
	if err := conn.HandshakeContext(hctx); err != nil {
		conn.Close()
		a, alerted := remoteAlert(err)
		switch {
		case alerted && a == ktls.AlertAccessDenied:
			// Before the handshake's end: the forwarder shed the
			// connection (ktls.Shed), never a refusal of the tunnel.
			err = fmt.Errorf("%w: %w", ErrOverloaded, err)
		case alerted && a == alertInternalError:
			err = fmt.Errorf("%w: the forwarder failed the handshake; it does so when it has no certificate for the server name %q "+
				"(set tls_server_name to a name its certificate carries; its log says \"no certificate available\")", err, cfg.ServerName)
		}
		return nil, StepHandshake, err
	}
	return conn, "", nil
}

// pendingAlertWait bounds the read that looks for an alert the forwarder
// sent before the reset that failed a preamble's write.
const pendingAlertWait = 100 * time.Millisecond

// pendingAlert reads what conn still holds after a failed write: the
// error the read ends with, such as an alert the peer sent before it
// reset the connection.
func pendingAlert(conn *ktls.Conn) error {
	conn.SetReadDeadline(time.Now().Add(pendingAlertWait))
	_, err := conn.Read(make([]byte, 1))
	return err
}

// CertificateRefusal returns the DialError (StepHandshake, a
// *CertificateRefusedError) for err, read from a tunnel of r before the
// forwarder's first byte, when err is the forwarder's refusal of the
// gateway's client certificate (CertificateAlert); nil otherwise. With
// TLS 1.3 such a refusal comes after Dial returned: whatever reads the
// tunnel first (an HTTP transport, Relay) meets it, and the tunnel is
// then one that could not be opened.
func (d *Dialer) CertificateRefusal(r Route, err error) *DialError {
	name, ok := CertificateAlert(err)
	if !ok {
		return nil
	}
	return &DialError{Route: r, Step: StepHandshake, Err: &CertificateRefusedError{Alert: name, Certificate: d.cert, Err: err}}
}

// The steps of a Dial, as DialError names them.
const (
	StepConnect   = "connect"
	StepHandshake = "handshake"
	StepPreamble  = "preamble"
)

// ErrOverloaded is the cause of a DialError (StepHandshake) whose
// forwarder shed the connection in place of its handshake (ktls.Shed): it
// had as many handshakes in progress as it takes (max_handshakes), or its
// CPU was too busy to take another (max_scheduling_delay). Nothing
// reached it beyond a ClientHello: another forwarder, or this one a moment
// later, may take the tunnel.
var ErrOverloaded = errors.New("the forwarder is overloaded: it shed the connection before the TLS handshake")

// DialError is a tunnel that could not be opened: no byte of the tenant's
// reached the sandbox, so whatever asked for it may be tried again.
type DialError struct {
	Route Route
	// Step is StepConnect, StepHandshake (with a *CertificateRefusedError
	// when the forwarder refused the gateway's certificate, ErrOverloaded
	// when it shed the connection) or StepPreamble.
	Step string
	Err  error
}

func (e *DialError) Error() string {
	return fmt.Sprintf("gateway: tunnel to %s: %s: %v", e.Route, e.Step, e.Err)
}

func (e *DialError) Unwrap() error { return e.Err }

// forwarderSessions keys a session cache by forwarder address too:
// crypto/tls keys it by ServerName alone, which forwarders may share while
// each holds its own ticket keys.
type forwarderSessions struct {
	tls.ClientSessionCache
	addr string
}

func (c forwarderSessions) Get(key string) (*tls.ClientSessionState, bool) {
	return c.ClientSessionCache.Get(c.addr + " " + key)
}

func (c forwarderSessions) Put(key string, cs *tls.ClientSessionState) {
	c.ClientSessionCache.Put(c.addr+" "+key, cs)
}
