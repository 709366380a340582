package caddyktls

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"
	"golang.org/x/net/http2"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

func init() {
	caddy.RegisterModule(new(ListenerWrapper))
}

// ListenerWrapper is the `caddy.listeners.ktls` listener wrapper: Caddy's
// HTTPS (HTTP/1.1 and HTTP/2) served from kernel TLS. Caddy still runs the
// whole TLS handshake with its own connection policies (automatic and
// on-demand certificates, `tls internal`, client authentication, ECH); once
// the handshake is done the session keys move into the kernel, which then
// encrypts and decrypts the records. Connections that cannot be offloaded
// fall back to userspace TLS unless `require_offload` is set. HTTP/3 does not
// use listener wrappers and is unaffected.
//
// It must come after the `tls` placeholder wrapper, which is where Caddy puts
// every wrapper by default:
//
//	listener_wrappers {
//		ktls
//	}
//
// SECURITY: kernel receive (RX) is on by default. The kernel's TLS receive
// path is where kTLS vulnerabilities have clustered; set `disable_rx` to keep
// decryption in Go while the kernel still encrypts outgoing records.
type ListenerWrapper struct {
	// The offload options (OffloadOptions), at the top level of the JSON.
	offload.Options

	// Sendfile lets HTTP/1.1 response bodies read from files (file_server)
	// go out with sendfile(2), encrypted by the kernel, without passing
	// through userspace.
	//
	// The trade-off (docs/compatibility.md): for sendfile the connection handed to
	// Caddy must not report its TLS state through a ConnectionState method,
	// because Caddy hides every optional method of such connections
	// (including the io.ReaderFrom that net/http uses for sendfile). Caddy
	// then logs "tls is enabled, but listener wrapper returns a connection
	// that doesn't implement connectionStater" at WARN level for every
	// connection. Requests still see the correct TLS state (r.TLS,
	// {http.request.tls.*}, client certificate matchers, access logs). Off by
	// default: response bodies are then written through the kernel with
	// write(2), still encrypted by the kernel, and the logs stay clean.
	// Sendfile is only possible when the server serves both HTTP/1.1 and
	// HTTP/2 (Caddy's default); otherwise this option has no effect and a
	// warning says so at start. Nor does it have one where no connection
	// can have its TX in the kernel (a kernel without kTLS, offload off):
	// bodies are copied through userspace there either way, so the wrapper
	// spares the logs Caddy's WARN per connection, and says so in its start
	// line.
	Sendfile bool `json:"sendfile,omitempty"`

	ctx    caddy.Context
	srv    *caddyhttp.Server
	logger *zap.Logger
	opts   ktls.Options
	// failures counts and logs failed handshakes.
	failures *offload.HandshakeFailureLog
	sendfile bool // Sendfile, and possible on this server
	// sendfileIdle: Sendfile was set, but no connection can have its TX
	// in the kernel here, so sendfile is off.
	sendfileIdle bool
	// gatePreface: net/http reads the connections this wrapper returns
	// (no wrapper follows it), so their first bytes must agree with ALPN
	// (prefaceGate). Behind a layer4 wrapper stock Caddy serves
	// *layer4.Connection the way it serves ours, so nothing is gated.
	gatePreface bool

	baseOnce sync.Once
	base     *tls.Config
}

// CaddyModule returns the Caddy module information.
func (*ListenerWrapper) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.ListenerWrapper, New: func() caddy.Module { return new(ListenerWrapper) }}
}

// Provision checks the configuration and where the wrapper sits in its
// server, and registers the per-connection TLS state with the server.
func (lw *ListenerWrapper) Provision(ctx caddy.Context) error {
	lw.ctx = ctx
	lw.logger = ctx.Logger(lw)
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil {
		return errors.New("ktls listener wrapper: only usable in an HTTP server's listener_wrappers")
	}
	lw.srv = srv
	names, err := wrapperNames(srv.ListenerWrappersRaw)
	if err != nil {
		return err
	}
	if err := checkWrapperOrder(names); err != nil {
		return err
	}
	lw.gatePreface = len(names) > 0 && names[len(names)-1] == "ktls"
	if layer4WithoutSession(srv.ListenerWrappersRaw) {
		lw.logger.Warn(layer4WithoutSessionWarning)
	}
	lw.Options.SetDefaults()
	if err := caddymetrics.Register(ctx, moduleid.ListenerWrapper); err != nil {
		return err
	}
	lw.failures = offload.NewHandshakeFailureLog(moduleid.ListenerWrapper, lw.logger)
	lw.opts = lw.KTLSOptions(lw.observe)
	lw.sendfile = lw.Sendfile && servesH1AndH2(srv)
	if lw.Sendfile && !lw.sendfile {
		lw.logger.Warn("sendfile needs both HTTP/1.1 and HTTP/2 enabled on every listener of this server (Caddy hides it otherwise): serving without sendfile")
	}
	if lw.sendfile && !lw.Options.KernelCanOffload() {
		// Without TX in the kernel every body is copied through userspace
		// anyway, and a sendfile connection costs a Caddy WARN each
		// (ListenerWrapper.Sendfile): said once, in the start line.
		lw.sendfile, lw.sendfileIdle = false, true
	}
	srv.RegisterConnContext(connTLSState)
	return nil
}

// Validate checks the options (caddy.Validator): Caddy calls it after
// Provision, before the server starts.
func (lw *ListenerWrapper) Validate() error {
	if err := lw.Options.ValidateOptions(); err != nil {
		return fmt.Errorf("ktls listener wrapper: %w", err)
	}
	if lw.TXZeroCopyRO && !lw.Sendfile {
		return errors.New("ktls listener wrapper: `tx_zerocopy_ro` only affects sendfile: add `sendfile`, or remove `tx_zerocopy_ro`")
	}
	return nil
}

// connTLSState gives requests the TLS state of connections that do not
// report it through ConnectionState by the time net/http sees them: ours in
// sendfile mode, and ours behind a layer4 listener wrapper, which hands
// HTTP its *layer4.Connection. Caddy fills r.TLS from this context value
// (server.go, ServeHTTP) under its unexported tlsConnectionStateFuncCtxKey,
// which has this type and string; the TLS placeholder checks in
// listenerwrapper_test.go pin that contract.
func connTLSState(ctx context.Context, c net.Conn) context.Context {
	if lc, ok := c.(*layer4.Connection); ok {
		c = lc.Conn
	}
	switch hc := c.(type) {
	case *sendfileConn:
		return context.WithValue(ctx, tlsConnectionStateFuncKey, hc.tlsState)
	case *stateConn:
		return context.WithValue(ctx, tlsConnectionStateFuncKey, hc.tlsState)
	}
	return ctx
}

// layer4WithoutSessionWarning is logged at provision for a layer4 listener
// wrapper after ktls without ktls_session.
const layer4WithoutSessionWarning = "a layer4 listener wrapper follows ktls without a ktls_session route: " +
	"Caddy will log a WARN for every HTTP connection layer4 passes on, and caddy-l4 v0.1.2 races with HTTP on them; " +
	"make `route { ktls_session }` the first of its routes"

// tlsConnectionStateFuncKey is the context key under which Caddy looks up a
// func() *tls.ConnectionState for connections that are not *tls.Conn.
const tlsConnectionStateFuncKey caddy.CtxKey = "tls_connection_state_func"

// checkWrapperOrder rejects a ktls wrapper that is not right after the
// `tls` placeholder (which Caddy puts first when it is not listed). Before
// it, ktls would receive raw TCP connections and Caddy's *tls.Conn would
// later run the record layer in userspace on top of it. After another
// wrapper (or a second ktls), it would receive that wrapper's connections
// instead of Caddy's *tls.Conn and could offload none of them.
func checkWrapperOrder(names []string) error {
	tlsAt := slices.Index(names, "tls")
	for at, name := range names {
		switch {
		case name != "ktls":
		case at < tlsAt:
			return fmt.Errorf("ktls listener wrapper: it is at position %d of listener_wrappers, before the tls wrapper at %d; it must come after tls (it takes over the connections Caddy's TLS listener accepted), e.g. list it without tls", at, tlsAt)
		case at > tlsAt+1:
			return fmt.Errorf("ktls listener wrapper: it is at position %d of listener_wrappers, after %q at %d; it must come right after tls (listed, or implied first): %q hands it its own connections instead of Caddy's TLS connections, so none could be offloaded", at, names[at-1], at-1, names[at-1])
		}
	}
	return nil
}

// wrapperNames returns the module names of a server's listener wrappers.
func wrapperNames(raws []json.RawMessage) ([]string, error) {
	names := make([]string, len(raws))
	for i, raw := range raws {
		var w struct {
			Wrapper string `json:"wrapper"`
		}
		if err := json.Unmarshal(raw, &w); err != nil {
			return nil, fmt.Errorf("ktls listener wrapper: reading listener_wrappers[%d]: %v", i, err)
		}
		names[i] = w.Wrapper
	}
	return names, nil
}

// layer4WithoutSession reports whether a layer4 listener wrapper follows
// ktls with no route that handles with ktls_session (see KTLSSession).
// Routes it cannot read are left to caddy-l4 to report.
func layer4WithoutSession(raws []json.RawMessage) bool {
	afterKTLS := false
	for _, raw := range raws {
		var w struct {
			Wrapper string `json:"wrapper"`
			Routes  []struct {
				Handle []struct {
					Handler string `json:"handler"`
				} `json:"handle"`
			} `json:"routes"`
		}
		if json.Unmarshal(raw, &w) != nil {
			continue
		}
		afterKTLS = afterKTLS || w.Wrapper == "ktls"
		if !afterKTLS || w.Wrapper != "layer4" {
			continue
		}
		session := false
		for _, r := range w.Routes {
			for _, h := range r.Handle {
				session = session || h.Handler == "ktls_session"
			}
		}
		if !session {
			return true
		}
	}
	return false
}

// servesH1AndH2 reports whether every listener of srv serves HTTP/1.1 and
// HTTP/2: only then does Caddy hand connections to net/http unwrapped
// (http2listener.go), so that net/http finds their ReadFrom.
func servesH1AndH2(srv *caddyhttp.Server) bool {
	both := func(protos []string) bool {
		return slices.Contains(protos, "h1") && (slices.Contains(protos, "h2") || slices.Contains(protos, "h2c"))
	}
	if !both(srv.Protocols) {
		return false
	}
	for _, p := range srv.ListenProtocols {
		if p != nil && !both(p) {
			return false
		}
	}
	return true
}

// observe logs what the ktls engine reports for a connection.
func (lw *ListenerWrapper) observe(ev ktls.Event) {
	offload.CountClose(moduleid.ListenerWrapper, ev.Kind)
	switch ev.Kind {
	case ktls.EventHandshake:
		offload.ObserveHandshake(moduleid.ListenerWrapper, ev)
		offload.LogHandshake(lw.logger, ev)
		if ev.Offload.Reason == ktls.ReasonHandshakeFailed {
			lw.failures.Record(ev)
		}
	case ktls.EventRateLimited, ktls.EventClosed, ktls.EventRekeyUnsupported, ktls.EventKeyExhausted:
		lw.logger.Warn("kernel TLS connection closed", zap.String("event", string(ev.Kind)),
			zap.Stringer("remote", ev.Remote), zap.Error(ev.Err))
	default:
		lw.logger.Debug("kernel TLS connection event", zap.String("event", string(ev.Kind)),
			zap.Stringer("remote", ev.Remote), zap.Error(ev.Err))
	}
}

// WrapListener wraps ln, which is Caddy's TLS listener (or a plain listener
// on the HTTP port, whose connections pass through untouched), and logs
// what this kernel does for its connections: once per listener and config
// load, naming the server and the listener.
func (lw *ListenerWrapper) WrapListener(ln net.Listener) net.Listener {
	lw.baseOnce.Do(lw.start)
	lw.logStart(ln.Addr(), lw.servesTLS(ln.Addr()))
	return &listener{Listener: ln, lw: lw}
}

// start builds the base TLS configuration. It runs in WrapListener, not
// Provision, because Caddy provisions the server's TLS connection policies
// after its listener wrappers.
func (lw *ListenerWrapper) start() {
	lw.base = lw.srv.TLSConnPolicies.TLSConfig(lw.ctx)
}

// servesTLS reports whether Caddy terminates TLS on the listener at addr:
// the server has TLS connection policies and addr is not the HTTP port
// (Caddy's rule in caddyhttp.App.Start).
func (lw *ListenerWrapper) servesTLS(addr net.Addr) bool {
	if len(lw.srv.TLSConnPolicies) == 0 {
		return false
	}
	httpPort := caddyhttp.DefaultHTTPPort
	if app, err := lw.ctx.AppIfConfigured("http"); err == nil {
		if a, ok := app.(*caddyhttp.App); ok && a.HTTPPort != 0 {
			httpPort = a.HTTPPort
		}
	}
	ta, ok := addr.(*net.TCPAddr)
	return !ok || ta.Port != httpPort
}

// logStart logs the start line of the listener at addr: on a TLS
// listener what this kernel does for its connections (logKernel), else
// at DEBUG that its connections pass through.
func (lw *ListenerWrapper) logStart(addr net.Addr, servesTLS bool) {
	where := []zap.Field{zap.String("server", lw.srv.Name()), zap.Stringer("listener", addr)}
	if !servesTLS {
		lw.logger.Debug("ktls listener wrapper: this listener serves no TLS; its connections pass through", where...)
		return
	}
	fields := append(where, zap.Bool("sendfile", lw.sendfile))
	if lw.sendfileIdle {
		fields = append(fields, zap.String("sendfile_off", "sendfile is set, but no connection can have its TX in the kernel here: "+
			"bodies are written through userspace either way, so the wrapper does without it and Caddy's WARN per connection"))
	}
	lw.Options.LogKernel(lw.logger, fields...)
}

type listener struct {
	net.Listener
	lw *ListenerWrapper
}

// Accept takes Caddy's not yet handshaken *tls.Conn, keeps only the TCP
// connection under it and starts a kernel TLS connection over that. Nothing
// has been read or written through the *tls.Conn yet, so dropping it is free.
// The handshake runs on the connection's first read or write, in the
// connection's own goroutine, never here.
func (l *listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc, ok := c.(*tls.Conn)
	if !ok {
		return c, nil // the HTTP port of a server, or no TLS on this server
	}
	hc := &httpConn{kc: ktls.Server(tc.NetConn(), l.lw.base, l.lw.opts), timeout: time.Duration(l.lw.HandshakeTimeout),
		gatePreface: l.lw.gatePreface}
	if l.lw.sendfile {
		return &sendfileConn{hc}, nil
	}
	return &stateConn{hc}, nil
}

// httpConn is a kernel TLS connection as the HTTP server sees it. It
// forwards only what net/http and Caddy use, and deliberately neither
// ConnectionState nor ReadFrom: each variant below adds exactly one of them
// (see ListenerWrapper.Sendfile).
type httpConn struct {
	kc        *ktls.Conn
	timeout   time.Duration
	handshook atomic.Bool
	// layer4 is set when ktls_session hands the connection to layer4
	// routes: a tunnel's end is the sandbox handler's to manage, so Close
	// does not linger there.
	layer4 atomic.Bool
	close  sync.Once
	// gatePreface: after the handshake, reads go through gate.
	gatePreface bool
	gate        *prefaceGate
}

// httpLingerTimeout bounds how long Close waits for the client to close
// after close_notify (ktls.Conn.CloseLingering): enough for a client to
// drain a response the kernel still holds (a few MiB), even a slow one.
const httpLingerTimeout = 5 * time.Second

// handshake runs the TLS handshake once, bounded by the timeout. The ktls
// connection would otherwise run it unbounded on the first Read or Write.
func (c *httpConn) handshake() error {
	if c.handshook.Load() {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	if err := c.kc.HandshakeContext(ctx); err != nil {
		return err
	}
	if c.gatePreface {
		c.gate = &prefaceGate{h2: c.kc.ConnectionState().NegotiatedProtocol == "h2"}
	}
	c.handshook.Store(true)
	return nil
}

// Read reads plaintext, after the handshake.
func (c *httpConn) Read(p []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	if c.gate != nil {
		return c.gate.read(c.kc, p)
	}
	return c.kc.Read(p)
}

// Write writes plaintext, after the handshake.
func (c *httpConn) Write(p []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.kc.Write(p)
}

// WriteTo copies the plaintext to w; a hijacked connection (a WebSocket
// proxied by reverse_proxy) thus splices when RX is in the kernel.
func (c *httpConn) WriteTo(w io.Writer) (int64, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	var copied int64
	if g := c.gate; g != nil {
		var buf [len(http2.ClientPreface)]byte
		for g.pending() {
			n, err := g.read(c.kc, buf[:])
			m, werr := w.Write(buf[:n])
			copied += int64(m)
			switch {
			case werr != nil:
				return copied, werr
			case err == io.EOF:
				return copied, nil
			case err != nil:
				return copied, err
			}
		}
	}
	n, err := c.kc.WriteTo(w)
	return copied + n, err
}

// CloseWrite sends close_notify and shuts down the sending side; net/http
// uses it to close HTTP/1 connections gracefully.
func (c *httpConn) CloseWrite() error {
	if err := c.handshake(); err != nil {
		return err
	}
	return c.kc.CloseWrite()
}

// SpliceSource returns the kernel socket when RX runs in the kernel, so
// the splice data path (a sandbox tunnel routed by a layer4 listener wrapper
// after this one) reads decrypted bytes from it.
func (c *httpConn) SpliceSource() (syscall.RawConn, bool) { return c.kc.SpliceSource() }

// SpliceSink returns the kernel socket when TX runs in the kernel, so the
// splice data path writes bytes that the kernel encrypts.
func (c *httpConn) SpliceSink() (syscall.RawConn, bool) { return c.kc.SpliceSink() }

// Close sends close_notify (after a completed handshake) and closes. An
// HTTP connection closes in the background once the client closed too or
// httpLingerTimeout passed, so that the end of a response still in the
// kernel reaches the client, while the caller (net/http closes idle
// connections holding its server's lock) does not wait for it.
func (c *httpConn) Close() error {
	if c.layer4.Load() {
		return c.kc.Close()
	}
	c.close.Do(func() { go c.kc.CloseLingering(httpLingerTimeout) })
	return nil
}

// Abort closes the connection as a failure (ktls.Conn.Abort): a sandbox
// tunnel routed here by a layer4 listener wrapper ends so when it fails.
func (c *httpConn) Abort() error { return c.kc.Abort() }

// Refuse closes the connection as refused (ktls.Conn.Refuse): a rejected
// sandbox tunnel routed here ends so.
func (c *httpConn) Refuse() error { return c.kc.Refuse() }

// LocalAddr returns the local address.
func (c *httpConn) LocalAddr() net.Addr { return c.kc.LocalAddr() }

// RemoteAddr returns the client's address.
func (c *httpConn) RemoteAddr() net.Addr { return c.kc.RemoteAddr() }

// SetDeadline sets the read and write deadlines.
func (c *httpConn) SetDeadline(t time.Time) error { return c.kc.SetDeadline(t) }

// SetReadDeadline sets the read deadline.
func (c *httpConn) SetReadDeadline(t time.Time) error { return c.kc.SetReadDeadline(t) }

// SetWriteDeadline sets the write deadline.
func (c *httpConn) SetWriteDeadline(t time.Time) error { return c.kc.SetWriteDeadline(t) }

// session returns c under the variant that embeds it (for ktls_session).
func (c *httpConn) session() *httpConn { return c }

// tlsState returns the connection's TLS state for Caddy's r.TLS.
func (c *httpConn) tlsState() *tls.ConnectionState {
	st := c.kc.ConnectionState()
	return &st
}

// stateConn reports its TLS state to Caddy the standard way, through
// ConnectionState, so Caddy logs nothing; Caddy then hides its other
// optional methods from net/http, and bodies are written with write(2).
type stateConn struct{ *httpConn }

// ConnectionState returns the TLS state of the finished handshake.
func (c *stateConn) ConnectionState() tls.ConnectionState { return c.kc.ConnectionState() }

// sendfileConn gives net/http its ReadFrom, so file bodies go out with
// sendfile(2); its TLS state reaches requests through the server's
// connection context instead of ConnectionState.
type sendfileConn struct{ *httpConn }

// ReadFrom copies r to the connection. With TX in the kernel and a file
// under r (net/http and Caddy wrap it in *io.LimitedReaders, which the ktls
// package unwraps) the kernel reads the file with sendfile(2) and encrypts
// it; otherwise the bytes are copied through Write.
func (c *sendfileConn) ReadFrom(r io.Reader) (int64, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	_, kernelTX := c.kc.SpliceSink()
	_, isFile := innermostReader(r).(*os.File)
	n, err := c.kc.ReadFrom(r)
	countReadFrom(kernelTX && isFile, n)
	return n, err
}

// innermostReader returns the reader under any nesting of *io.LimitedReader.
func innermostReader(r io.Reader) io.Reader {
	for {
		lr, ok := r.(*io.LimitedReader)
		if !ok {
			return r
		}
		r = lr.R
	}
}

// Interface guards.
var (
	_ caddy.Provisioner     = (*ListenerWrapper)(nil)
	_ caddy.Validator       = (*ListenerWrapper)(nil)
	_ caddy.ListenerWrapper = (*ListenerWrapper)(nil)
	_ io.ReaderFrom         = (*sendfileConn)(nil)
)
