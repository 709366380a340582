package ktls

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Layered is a raw conn that reads through a userspace buffer over a kernel
// socket (such as caddy-l4's *layer4.Connection, adapted by the caller).
type Layered interface {
	net.Conn
	// Socket returns the kernel TCP socket under the layer once the layer
	// holds no unread bytes; an error otherwise (the connection then falls
	// back with ReasonBufferedBytes). Nil and no error: there is no TCP
	// socket under the layer (ReasonNotTCP).
	Socket() (*net.TCPConn, error)
}

// Conn is a TLS connection whose record layer runs in the kernel when it
// can, and in crypto/tls when it cannot. It implements net.Conn.
type Conn struct {
	raw      net.Conn
	isClient bool
	opts     Options
	record   *recordConn
	// tlsConn runs the handshake, and every direction left in userspace.
	// Once both directions are in the kernel and no session ticket can
	// arrive for it (a server, or a client that does not resume), it is
	// dropped, with its record buffers and AEAD states: finalState then
	// answers ConnectionState.
	tlsConn    atomic.Pointer[tls.Conn]
	finalState atomic.Pointer[tls.ConnectionState]
	keys       *keyCapture

	hsMu   sync.Mutex
	hsDone atomic.Bool
	hsErr  error
	off    Offload
	// hsWrites: the record conn's writes when the handshake ended; more
	// since mean crypto/tls has sealed records under its application key.
	hsWrites int64

	// Set once by the handshake when a direction runs in the kernel.
	sock    *net.TCPConn
	rawSock syscall.RawConn
	// rx reads the kernel socket when RX runs there (partial.go); rd is
	// its read deadline.
	rx *rxReader
	rd readDeadline

	readMu    sync.Mutex
	readFn    func(fd uintptr) bool // kernelRead's callback, made once
	readBuf   []byte                // kernelRead's call: its buffer and results
	readN     int
	readErrno error
	pending   []byte      // decrypted bytes not yet returned by Read
	readErr   error       // sticky: io.EOF after close_notify, or a fatal error
	notified  atomic.Bool // the peer's close_notify was read
	// readSince: a Read ran since the handshake; with RX in userspace,
	// crypto/tls may then hold a record it read (Gone).
	readSince atomic.Bool

	// Client session tickets (ticket.go), under readMu.
	resume      bool   // the client config has a session cache and tickets on
	ticketsFed  uint64 // records fed to crypto/tls under the server's first key
	ticketsLost bool   // crypto/tls's input is out of step: feed no more
	rxSecret    []byte // current TLS 1.3 RX secret (for KeyUpdate)
	opener      *recordOpener
	limiter     tokenBucket
	ctrlBuf     []byte

	// Key wear (wear.go): upper bounds of the records the current keys
	// protect, under readMu (rx*) and writeMu (txBound).
	rxBound uint64
	rxAsked bool          // the peer was asked to update its key
	txWant  atomic.Uint32 // KeyUpdates to send before the next record (wantAnswer, wantAsk)

	writeMu   sync.Mutex
	txBound   uint64
	txSecret  []byte // current TLS 1.3 TX secret (for KeyUpdate)
	wroteEOF  bool   // close_notify sent (on the userspace path too, for Abort)
	closeOnce sync.Once
	closeErr  error
	// tlsWriteFailed: a Write through crypto/tls (TX in userspace) failed.
	// crypto/tls seals a record, spending its sequence number, before it
	// writes it, so its close_notify would then not authenticate at the
	// peer: Close closes the socket without one, and CloseWrite refuses.
	tlsWriteFailed atomic.Bool

	// Handoff (handoff.go). handedOff is set under readMu and writeMu;
	// closing is set by Close and the aborts before they touch the socket,
	// and Handoff refuses once it is.
	handedOff atomic.Bool
	closing   atomic.Bool
	// adopted is the connection state of a Conn made by Adopt, which has no
	// tls.Conn.
	adopted *tls.ConnectionState
}

// Server returns a server-side Conn over raw. The handshake runs lazily on
// the first Read, Write or Handshake, never in the caller's accept loop.
func Server(raw net.Conn, cfg *tls.Config, opts Options) *Conn {
	return newConn(raw, cfg, opts, false)
}

// Client returns a client-side Conn over raw, with the same lazy handshake.
// With a ClientSessionCache in cfg, the TLS 1.3 session tickets the server
// sends after the handshake reach the cache although reads run in the
// kernel (ticket.go), so a later Client resumes, and a resumed session is
// offloaded like a full one. crypto/tls logs no master secret for a resumed
// TLS 1.2 session, so a client that resumes one (its ClientSessionCache
// holds the session from the handshake) stays in userspace TLS with
// ReasonKeyCapture.
func Client(raw net.Conn, cfg *tls.Config, opts Options) *Conn {
	return newConn(raw, cfg, opts, true)
}

func newConn(raw net.Conn, cfg *tls.Config, opts Options, isClient bool) *Conn {
	c := &Conn{raw: raw, isClient: isClient, opts: opts, record: newRecordConn(raw), keys: &keyCapture{}}
	c.limiter = newTokenBucket(opts.KeyUpdateLimit)
	if isClient {
		c.tlsConn.Store(tls.Client(c.record, c.keys.clientConfig(cfg)))
		c.resume = cfg != nil && cfg.ClientSessionCache != nil && !cfg.SessionTicketsDisabled
	} else {
		c.tlsConn.Store(tls.Server(c.record, c.keys.serverConfig(cfg)))
	}
	return c
}

// keyCapture collects the secrets crypto/tls logs for one connection.
type keyCapture struct {
	mu          sync.Mutex
	secrets     map[string][]byte // by NSS key log label
	ticketsSent int               // TLS 1.3 NewSessionTicket records sealed under the server's application key

	resumedSuite uint16 // suite of the TLS 1.2 session kept by noteSession
}

// Write parses NSS key log lines (label, client random, secret in hex).
func (k *keyCapture) Write(p []byte) (int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.secrets == nil {
		k.secrets = map[string][]byte{}
	}
	for line := range strings.Lines(string(p)) {
		f := strings.Fields(line)
		if len(f) != 3 {
			continue
		}
		secret, err := hex.DecodeString(f[2])
		if err != nil {
			return 0, fmt.Errorf("ktls: key log line: %w", err)
		}
		k.secrets[f[0]] = secret
		if f[0] == "CLIENT_RANDOM" {
			random, err := hex.DecodeString(f[1])
			if err != nil {
				return 0, fmt.Errorf("ktls: key log line: %w", err)
			}
			k.secrets["client-random"] = random
		}
	}
	return len(p), nil
}

// wipe overwrites every captured secret.
func (k *keyCapture) wipe() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, v := range k.secrets {
		clear(v)
	}
}

func (k *keyCapture) get(label string) []byte {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.secrets[label]
}

// clientConfig clones cfg with the key log bound to this connection.
func (k *keyCapture) clientConfig(cfg *tls.Config) *tls.Config {
	if cfg == nil {
		cfg = &tls.Config{}
	}
	clone := cfg.Clone()
	clone.KeyLogWriter = k
	return clone
}

// serverConfig clones cfg for one connection: the key log is bound to this
// connection, and so is the config GetConfigForClient returns (Caddy always
// uses it), so keys are captured whichever config runs the handshake.
func (k *keyCapture) serverConfig(cfg *tls.Config) *tls.Config {
	if cfg == nil {
		cfg = &tls.Config{}
	}
	clone := cfg.Clone()
	k.bindServer(clone, cfg)
	if get := cfg.GetConfigForClient; get != nil {
		clone.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			chosen, err := get(hello)
			if err != nil || chosen == nil {
				return chosen, err
			}
			perConn := chosen.Clone()
			perConn.GetConfigForClient = nil
			k.bindServer(perConn, chosen)
			return perConn, nil
		}
	}
	return clone
}

// bindServer sets the key log on clone and counts TLS 1.3 session tickets.
// Tickets are sealed and opened with orig's keys: a fresh clone would make
// its own automatic ticket keys, and no ticket could resume on another
// connection.
//
// The count is the TX sequence number: every TLS 1.3 ticket crypto/tls
// wraps is written as exactly one record under the application key during
// the handshake. Counting WrapSession calls does not depend on how
// crypto/tls buffers and flushes its flights, which counting written records
// after the key log event would.
func (k *keyCapture) bindServer(clone, orig *tls.Config) {
	clone.KeyLogWriter = k
	wrap, unwrap := orig.WrapSession, orig.UnwrapSession
	clone.WrapSession = func(cs tls.ConnectionState, ss *tls.SessionState) ([]byte, error) {
		var ticket []byte
		var err error
		if wrap != nil {
			ticket, err = wrap(cs, ss)
		} else {
			ticket, err = orig.EncryptTicket(cs, ss)
		}
		if err == nil && cs.Version == tls.VersionTLS13 {
			k.mu.Lock()
			k.ticketsSent++
			k.mu.Unlock()
		}
		return ticket, err
	}
	clone.UnwrapSession = func(identity []byte, cs tls.ConnectionState) (*tls.SessionState, error) {
		var ss *tls.SessionState
		var err error
		if unwrap != nil {
			ss, err = unwrap(identity, cs)
		} else {
			ss, err = orig.DecryptTicket(identity, cs)
		}
		if err == nil && ss != nil {
			k.noteSession(ss)
		}
		return ss, err
	}
}

// noteSession keeps the master secret of a TLS 1.2 session offered for
// resumption: crypto/tls logs no CLIENT_RANDOM line for a resumed TLS 1.2
// handshake. SessionState.Bytes is documented as opaque, so the layout
// (crypto/tls ticket.go: u16 version, u8 type, u16 suite, u64 created_at,
// u8-prefixed secret) is checked strictly; anything unexpected leaves the
// secret uncaptured and the connection falls back with ReasonKeyCapture.
func (k *keyCapture) noteSession(ss *tls.SessionState) {
	b, err := ss.Bytes()
	if err != nil || len(b) < 14 {
		return
	}
	version, sessionType, secretLen := binary.BigEndian.Uint16(b), b[2], int(b[13])
	if version != tls.VersionTLS12 || sessionType != 1 || secretLen != 48 || len(b) < 14+secretLen {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.secrets == nil {
		k.secrets = map[string][]byte{}
	}
	k.secrets["resumed-master"] = b[14 : 14+secretLen]
	k.resumedSuite = binary.BigEndian.Uint16(b[3:5])
}

// resumedMaster returns the master secret noted for a resumed TLS 1.2
// session of the given suite.
func (k *keyCapture) resumedMaster(suite uint16) []byte {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.resumedSuite != suite {
		return nil
	}
	return k.secrets["resumed-master"]
}

func (k *keyCapture) tickets() uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return uint64(k.ticketsSent)
}

// Handshake runs the TLS handshake and the offload, once.
func (c *Conn) Handshake() error { return c.HandshakeContext(context.Background()) }

// HandshakeContext is Handshake with a context bounding the TLS handshake.
func (c *Conn) HandshakeContext(ctx context.Context) error {
	if c.hsDone.Load() {
		return c.hsErr
	}
	c.hsMu.Lock()
	defer c.hsMu.Unlock()
	if c.hsDone.Load() {
		return c.hsErr
	}
	var state tls.ConnectionState
	state, c.hsErr = c.handshake(ctx)
	c.hsDone.Store(true)
	if c.hsErr == nil && c.kernelTX() && c.kernelRX() && !c.resume {
		// Dropped after hsDone: a caller that finds tlsConn nil knows
		// the handshake ended, both directions in the kernel.
		c.finalState.Store(&state)
		c.tlsConn.Store(nil)
	}
	return c.hsErr
}

// handshake runs under hsMu; nothing reads the socket before it returns,
// so the ULP is never installed under a concurrent reader (CVE-2025-38616:
// kTLS must own the receive queue from the moment it is attached). It
// returns the session's state after a completed handshake.
func (c *Conn) handshake(ctx context.Context) (tls.ConnectionState, error) {
	start := time.Now()
	if err := c.tlsConn.Load().HandshakeContext(ctx); err != nil {
		c.off = Offload{Reason: ReasonHandshakeFailed}
		c.report(Event{Kind: EventHandshake, Offload: c.off, Err: err, Duration: time.Since(start)})
		return tls.ConnectionState{}, err
	}
	state := c.tlsConn.Load().ConnectionState()
	c.hsWrites = c.record.writes.Load()
	c.off = Offload{Version: state.Version, CipherSuite: state.CipherSuite}
	reason, err := c.offload(state)
	c.off.Reason = reason
	ev := Event{Kind: EventHandshake, Offload: c.off, Err: err, Duration: time.Since(start)}
	switch {
	case reason == ReasonSetsockoptRX:
		// TX is in the kernel: the tls.Conn can no longer write, so the
		// connection is closed rather than left half-working.
		stats.closedAfterTX.Add(1)
		c.raw.Close()
		c.report(ev)
		c.report(Event{Kind: EventClosed, Offload: c.off, Err: err})
		return state, &OffloadError{Reason: reason, Err: err}
	case c.opts.RequireOffload && c.off.TX == ModeUserspace:
		// A refusal, and the session is in userspace TLS: a reset. A
		// close_notify would tell the peer that its stream is complete.
		oerr := &OffloadError{Reason: reason, Err: err}
		c.report(ev)
		c.report(Event{Kind: EventRefused, Offload: c.off, Err: oerr})
		c.abort(AlertAccessDenied)
		return state, oerr
	}
	c.report(ev)
	return state, nil
}

func (c *Conn) report(ev Event) {
	if ev.Kind == EventHandshake {
		countOutcome(ev.Offload)
	}
	if c.opts.Observer != nil {
		ev.Remote = c.raw.RemoteAddr()
		c.opts.Observer(ev)
	}
}

// offload installs what it can and returns the reason for what it did not.
// Before TLS_TX succeeds every failure leaves the tls.Conn in charge. What
// the connection itself rules out (version, suite, buffered bytes, socket,
// keys) is checked before the kernel is asked, so its reason is reported on
// any kernel, not hidden behind no-kernel-support.
func (c *Conn) offload(state tls.ConnectionState) (Reason, error) {
	if c.opts.Disable {
		return ReasonDisabled, errors.New("offload disabled by configuration")
	}
	if state.Version != tls.VersionTLS13 && state.Version != tls.VersionTLS12 {
		return ReasonVersion, fmt.Errorf("version %s", tls.VersionName(state.Version))
	}
	if _, err := suiteFor(state.Version, state.CipherSuite); err != nil {
		return ReasonCipher, fmt.Errorf("cipher %s", tls.CipherSuiteName(state.CipherSuite))
	}
	if !c.record.atRecordBoundary() {
		return ReasonBufferedBytes, errors.New("handshake ended inside a record")
	}
	sock, reason, err := kernelSocket(c.raw)
	if err != nil {
		return reason, err
	}
	rawSock, err := sock.SyscallConn()
	if err != nil {
		return ReasonNotTCP, err
	}
	tx, rx, err := c.directionKeys(state)
	if err != nil {
		return ReasonKeyCapture, err
	}
	if caps := Probe(); caps.ULP != nil {
		return ReasonNoKernelSupport, caps.ULP
	} else if !caps.Supports(state.Version, state.CipherSuite, !c.opts.DisableRX) {
		return ReasonCipher, fmt.Errorf("kernel refused cipher %s", tls.CipherSuiteName(state.CipherSuite))
	}
	if err := controlFD(rawSock, func(fd int) error {
		return unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_ULP, "tls")
	}); err != nil {
		return ReasonSetsockoptULP, err
	}
	// With the ULP attached but no key installed the socket still passes
	// plain bytes, so the tls.Conn can carry on after a TLS_TX failure.
	if err := c.install(rawSock, optTLSTX, state, tx); err != nil {
		return ReasonSetsockoptTX, err
	}
	c.sock, c.rawSock = sock, rawSock
	c.txSecret = tx.secret
	// Records sealed under the key before it reached the kernel (a TLS 1.3
	// server's tickets, TLS 1.2's Finished) count toward its wear.
	c.txBound, c.rxBound = tx.seq, rx.seq
	c.off.TX = ModeSW
	if c.opts.TXZeroCopyRO {
		if err := controlFD(rawSock, func(fd int) error {
			return unix.SetsockoptInt(fd, unix.SOL_TLS, optTXZeroCopyRO, 1)
		}); err != nil {
			return ReasonSetsockoptRX, fmt.Errorf("TLS_TX_ZEROCOPY_RO: %w", err)
		}
	}
	reason = ReasonNone
	if c.opts.DisableRX {
		c.opener, err = newRecordOpener(state.Version, state.CipherSuite, rx.key, rx.iv, rx.seq)
		if err != nil {
			return ReasonSetsockoptRX, err
		}
		c.rxSecret = rx.secret
		reason = ReasonRXDisabled
	} else {
		if err := c.install(rawSock, optTLSRX, state, rx); err != nil {
			return ReasonSetsockoptRX, err
		}
		c.rxSecret = rx.secret
		c.off.RX = ModeSW
		c.rx = newRXReader(&c.rd, rawSock)
		c.rd.setSock(sock)
		if c.opts.ExpectNoPad && state.Version == tls.VersionTLS13 {
			if err := controlFD(rawSock, func(fd int) error {
				return unix.SetsockoptInt(fd, unix.SOL_TLS, optRXExpectNoPad, 1)
			}); err != nil {
				return ReasonSetsockoptRX, fmt.Errorf("TLS_RX_EXPECT_NO_PAD: %w", err)
			}
		}
	}
	// The kernel, not our choice, says whether a direction went to a NIC.
	if info, err := readULPInfo(rawSock); err == nil {
		c.off.TX = info.TX
		if !c.opts.DisableRX {
			c.off.RX = info.RX
		}
		c.off.RXNoPad = info.RXNoPad
	}
	return reason, nil
}

// kernelSocket finds the TCP socket under raw.
func kernelSocket(raw net.Conn) (*net.TCPConn, Reason, error) {
	switch r := raw.(type) {
	case *net.TCPConn:
		return r, ReasonNone, nil
	case Layered:
		sock, err := r.Socket()
		switch {
		case err != nil:
			return nil, ReasonBufferedBytes, err
		case sock == nil:
			return nil, ReasonNotTCP, fmt.Errorf("no TCP socket under %T", raw)
		}
		return sock, ReasonNone, nil
	}
	return nil, ReasonNotTCP, fmt.Errorf("%T is not a TCP connection", raw)
}

// directionState is one direction's keys as installed.
type directionState struct {
	secret, key, iv []byte // secret: TLS 1.3 traffic secret (nil for 1.2)
	seq             uint64
}

// directionKeys derives TX and RX keys and sequence numbers from the
// captured secrets.
func (c *Conn) directionKeys(state tls.ConnectionState) (tx, rx directionState, err error) {
	if state.Version == tls.VersionTLS13 {
		ours, theirs := "SERVER_TRAFFIC_SECRET_0", "CLIENT_TRAFFIC_SECRET_0"
		if c.isClient {
			ours, theirs = theirs, ours
		}
		if tx, err = tls13Direction(state.CipherSuite, c.keys.get(ours), ours); err != nil {
			return tx, rx, err
		}
		if rx, err = tls13Direction(state.CipherSuite, c.keys.get(theirs), theirs); err != nil {
			return tx, rx, err
		}
		// RX starts at 0: the peer sent nothing under its application key
		// that we read (the record conn stopped at its Finished). A client
		// receives the server's NewSessionTicket later, through Read.
		if !c.isClient {
			tx.seq = c.keys.tickets()
		}
		return tx, rx, nil
	}
	master, clientRandom := c.keys.get("CLIENT_RANDOM"), c.keys.get("client-random")
	first := c.record.firstOut
	if c.isClient {
		first = c.record.firstIn
	}
	if master == nil && state.DidResume && !c.isClient {
		master, clientRandom = c.keys.resumedMaster(state.CipherSuite), clientHelloRandom(c.record.firstIn)
	}
	serverRand, ok := serverRandom(first)
	if master == nil || clientRandom == nil || !ok {
		return tx, rx, errors.New("TLS 1.2 master secret or randoms not captured")
	}
	block, err := tls12Keys(state.CipherSuite, master, clientRandom, serverRand)
	if err != nil {
		return tx, rx, err
	}
	// Each side has sealed and opened exactly one record (Finished) under
	// the new keys.
	tx = directionState{key: block.ServerKey, iv: block.ServerIV, seq: 1}
	rx = directionState{key: block.ClientKey, iv: block.ClientIV, seq: 1}
	if c.isClient {
		tx, rx = rx, tx
	}
	return tx, rx, nil
}

func tls13Direction(suite uint16, secret []byte, label string) (directionState, error) {
	if secret == nil {
		return directionState{}, fmt.Errorf("%s not captured", label)
	}
	key, iv, err := trafficKeys(suite, secret)
	if err != nil {
		return directionState{}, err
	}
	return directionState{secret: secret, key: key, iv: iv}, nil
}

func (c *Conn) install(rc syscall.RawConn, opt int, state tls.ConnectionState, d directionState) error {
	info, err := cryptoInfo(state.Version, state.CipherSuite, d.key, d.iv, d.seq)
	if err != nil {
		return err
	}
	return controlFD(rc, func(fd int) error { return setsockoptBytes(fd, unix.SOL_TLS, opt, info) })
}

// Offload reports what the handshake did; the zero value before it ran.
func (c *Conn) Offload() Offload {
	if !c.hsDone.Load() {
		return Offload{}
	}
	return c.off
}

// ConnectionState returns the TLS state of the handshake.
// For a Conn made by Adopt it is what the HandoffState carried: no
// verified chains, and no session resumption data.
func (c *Conn) ConnectionState() tls.ConnectionState {
	if c.adopted != nil {
		return *c.adopted
	}
	if tc := c.tlsConn.Load(); tc != nil {
		return tc.ConnectionState()
	}
	// Dropped (stored after finalState).
	return *c.finalState.Load()
}

// NetConn returns the raw conn given to Server or Client.
func (c *Conn) NetConn() net.Conn { return c.raw }

// SyscallConn returns the kernel socket's raw conn.
func (c *Conn) SyscallConn() (syscall.RawConn, error) {
	if c.handedOff.Load() {
		return nil, ErrHandedOff
	}
	if c.hsDone.Load() && c.rawSock != nil {
		return c.rawSock, nil
	}
	sc, ok := c.raw.(syscall.Conn)
	if !ok {
		return nil, fmt.Errorf("ktls: %T has no syscall.RawConn", c.raw)
	}
	return sc.SyscallConn()
}

// SpliceSource returns the socket when RX runs in the kernel, so splice(2)
// reads decrypted bytes from it.
func (c *Conn) SpliceSource() (syscall.RawConn, bool) {
	if c.hsDone.Load() && c.hsErr == nil && c.off.RX != ModeUserspace && !c.handedOff.Load() {
		return c.rawSock, true
	}
	return nil, false
}

// BeginWait tells c that its reader is about to wait on SpliceSource's
// RawConn (its Read); EndWait, with what that Read returned, that the wait
// is over. EndWait returns true when c ended the wait itself, with the
// deadline error, to have the reader ask again: part of a record has been
// queued for longer than the kernel could need to complete it
// (partial.go). Neither may be called without the other.
func (c *Conn) BeginWait() {
	if c.rx != nil {
		c.rx.begin()
	}
}

// EndWait: see BeginWait.
func (c *Conn) EndWait(err error) (again bool) {
	return c.rx != nil && c.rx.end(err)
}

// SpliceSink returns the socket when TX runs in the kernel, so splice(2)
// writes to it get encrypted.
func (c *Conn) SpliceSink() (syscall.RawConn, bool) {
	if c.hsDone.Load() && c.hsErr == nil && c.off.TX != ModeUserspace && !c.handedOff.Load() {
		return c.rawSock, true
	}
	return nil, false
}

// LocalAddr returns the local address.
func (c *Conn) LocalAddr() net.Addr { return c.raw.LocalAddr() }

// RemoteAddr returns the remote address.
func (c *Conn) RemoteAddr() net.Addr { return c.raw.RemoteAddr() }

// SetDeadline sets both deadlines, on the kernel socket too.
func (c *Conn) SetDeadline(t time.Time) error {
	return c.rd.set(t, func(t time.Time) error { return c.deadline(t, net.Conn.SetDeadline) })
}

// SetReadDeadline sets the read deadline.
func (c *Conn) SetReadDeadline(t time.Time) error {
	return c.rd.set(t, func(t time.Time) error { return c.deadline(t, net.Conn.SetReadDeadline) })
}

// SetWriteDeadline sets the write deadline.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	return c.deadline(t, net.Conn.SetWriteDeadline)
}

func (c *Conn) deadline(t time.Time, set func(net.Conn, time.Time) error) error {
	err := set(c.raw, t)
	if c.hsDone.Load() && c.sock != nil && net.Conn(c.sock) != c.raw {
		err = errors.Join(err, set(c.sock, t))
	}
	return err
}

// kernelTX reports whether writes go to the kernel.
func (c *Conn) kernelTX() bool { return c.hsErr == nil && c.off.TX != ModeUserspace }

// kernelRX reports whether reads come from the kernel.
func (c *Conn) kernelRX() bool { return c.hsErr == nil && c.off.RX != ModeUserspace }

// Write writes application data.
func (c *Conn) Write(p []byte) (int, error) {
	if err := c.Handshake(); err != nil {
		return 0, err
	}
	if !c.kernelTX() {
		n, err := c.tlsConn.Load().Write(p)
		if err != nil {
			c.tlsWriteFailed.Store(true)
		}
		return n, err
	}
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if err := c.writableLocked(); err != nil {
		return 0, err
	}
	written := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), maxSealChunk)]
		if err := c.beforeSealLocked(-1); err != nil {
			return written, err
		}
		n, err := c.sock.Write(chunk)
		c.txBound += sealedBound(int64(n))
		written += n
		if err != nil {
			return written, err
		}
		p = p[n:]
	}
	return written, nil
}

// writableLocked is nil when a record may be sealed: the connection was
// neither handed off nor closed for writing. Caller holds writeMu.
func (c *Conn) writableLocked() error {
	switch {
	case c.handedOff.Load():
		return ErrHandedOff
	case c.wroteEOF:
		return errWriteAfterClose
	}
	return nil
}

// Close sends close_notify (when the handshake completed) and closes. After
// Handoff it closes this process's descriptors only. With TX in userspace,
// after a Write that failed it closes without close_notify, which could not
// authenticate (tlsWriteFailed): the peer reads an end without it.
func (c *Conn) Close() error {
	c.closing.Store(true)
	if c.record != nil && c.record.closeWriting.Load() {
		// A CloseWrite waits for the peer to take close_notify: Close
		// does not wait behind it.
		c.raw.SetWriteDeadline(time.Unix(1, 0))
	}
	c.closeOnce.Do(func() {
		if c.hsDone.Load() && !c.kernelTX() && c.tlsWriteFailed.Load() {
			c.closeErr = ignoreClosed(c.raw.Close())
			return
		}
		if !c.hsDone.Load() || !c.kernelTX() {
			// tls.Conn.Close sends close_notify after a completed
			// handshake and closes the raw conn.
			if tc := c.tlsConn.Load(); tc != nil {
				c.closeErr = tc.Close()
				return
			}
			// The handshake ended meanwhile, both directions in the
			// kernel (tlsConn dropped): on below.
		}
		c.writeMu.Lock()
		if c.handedOff.Load() {
			c.writeMu.Unlock()
			c.closeErr = c.closeLocal()
			return
		}
		if !c.wroteEOF {
			// Do not let a peer that stopped reading hold Close forever.
			c.sock.SetWriteDeadline(time.Now().Add(5 * time.Second))
			c.sendControlLocked(recordAlert, closeNotify)
			c.wroteEOF = true
		}
		c.writeMu.Unlock()
		c.closeErr = errors.Join(ignoreClosed(c.sock.Close()), closeIfDifferent(c.raw, c.sock))
	})
	return c.closeErr
}

// Abort closes c as a failure, so that the peer cannot take the end for an
// orderly one (a relay whose other side failed: the stream it carried was
// cut). On the kernel path a fatal internal_error alert follows what is
// already queued, so the peer reads every byte sent before it and then the
// error; if the alert cannot be queued at once (the peer stopped reading),
// or on the userspace path, where crypto/tls sends alerts only from its own
// failures, the socket is reset instead (SO_LINGER 0), never waited on.
// After close_notify (CloseWrite) the peer already has an orderly end of
// what we sent, which a reset could cut short: Abort is then Close.
func (c *Conn) Abort() error { return c.abort(alertInternalError) }

// Refuse closes c as a refused connection: as Abort, but the fatal alert is
// access_denied, so that the peer can tell a request refused after the
// handshake (a sandbox forwarder's rejected preamble: nothing reached any
// target) from a stream cut short (internal_error). On the kernel path the
// alert is followed by FIN, and what the peer still sends is read and
// discarded until it closes, for at most RefuseLinger: closed with unread
// bytes, the socket would answer them with a reset, and at the peer a
// reset can overtake the alert (kTLS reports a pending reset before the
// records queued ahead of it, and once a write has consumed the reset the
// next read is a plain end of stream), so the refusal would arrive as a
// failure or as an orderly end. With TX in userspace (kernel TLS off, or
// the ULP refused because the peer's FIN came first) a TLS 1.3 session
// that has written nothing since the handshake is refused the same way,
// with the alert sealed by this package; otherwise it is reset, as Abort.
func (c *Conn) Refuse() error { return c.abort(AlertAccessDenied) }

// RefuseLinger bounds how long Refuse reads what the peer still sends.
const RefuseLinger = time.Second

// abort is Abort and Refuse, with the alert description to send.
func (c *Conn) abort(alert uint8) error {
	c.closing.Store(true)
	c.writeMu.Lock()
	orderly := c.wroteEOF || c.handedOff.Load()
	c.writeMu.Unlock()
	if orderly {
		return c.Close()
	}
	c.closeOnce.Do(func() {
		if !c.hsDone.Load() || !c.kernelTX() {
			if alert == AlertAccessDenied && c.hsDone.Load() && c.refuseInUserspace() {
				return
			}
			// Not through tls.Conn.Close: its close_notify would reach the
			// peer ahead of the reset.
			if rc, err := c.SyscallConn(); err == nil {
				setResetOnClose(rc)
			}
			c.closeErr = ignoreClosed(c.raw.Close())
			return
		}
		c.writeMu.Lock()
		if c.handedOff.Load() {
			c.writeMu.Unlock()
			c.closeErr = c.closeLocal()
			return
		}
		c.wroteEOF = true
		err := controlFD(c.rawSock, func(fd int) error {
			_, err := unix.SendmsgN(fd, []byte{alertLevelFatal, alert}, recordTypeCmsg(recordAlert), nil, unix.MSG_DONTWAIT)
			if err == nil && !tcpTookAll(fd) {
				// close(2) drops what kTLS sealed but TCP did not take (a
				// record sent in part reaches the peer truncated, then
				// FIN): the reset is the failure end then.
				err = unix.ENOBUFS
			}
			if err == nil && alert == AlertAccessDenied {
				err = unix.Shutdown(fd, unix.SHUT_WR)
			}
			return err
		})
		if err != nil {
			setResetOnClose(c.rawSock)
		}
		c.writeMu.Unlock()
		if err == nil && alert == AlertAccessDenied {
			c.discardUntilEOF(time.Now().Add(RefuseLinger))
		}
		c.closeErr = errors.Join(ignoreClosed(c.sock.Close()), closeIfDifferent(c.raw, c.sock))
	})
	return c.closeErr
}

// refuseInUserspace sends access_denied, then FIN, on a session whose TX
// runs in crypto/tls, which sends alerts only of its own failures, and
// drains the peer as the kernel path does. The record is sealed here with
// the captured key, at the sequence number crypto/tls would use: known
// while it has sealed nothing since the handshake (a server's tickets are
// part of that). Only TLS 1.3. false: nothing was sent, and the caller
// resets the connection.
func (c *Conn) refuseInUserspace() bool {
	if c.hsErr != nil || c.off.Version != tls.VersionTLS13 || c.record.writes.Load() != c.hsWrites {
		return false
	}
	ours, seq := "SERVER_TRAFFIC_SECRET_0", c.keys.tickets()
	if c.isClient {
		ours, seq = "CLIENT_TRAFFIC_SECRET_0", 0
	}
	secret := c.keys.get(ours)
	if secret == nil {
		return false
	}
	record, err := sealRecord13(c.off.CipherSuite, secret, seq, recordAlert, []byte{alertLevelFatal, AlertAccessDenied})
	if err != nil {
		return false
	}
	sock, _, err := kernelSocket(c.raw)
	if err != nil {
		return false
	}
	c.raw.SetWriteDeadline(time.Now().Add(time.Second))
	if _, err := c.raw.Write(record); err != nil {
		// The caller's reset ends it, and cuts off any part sent.
		return false
	}
	c.writeMu.Lock()
	c.wroteEOF = true
	c.writeMu.Unlock()
	sock.CloseWrite()
	c.raw.SetReadDeadline(time.Now().Add(RefuseLinger))
	io.Copy(io.Discard, c.raw)
	c.closeErr = ignoreClosed(c.raw.Close())
	return true
}

// discardUntilEOF reads and drops what the peer sends, records of any type
// (recvmsg with room for the record type: read(2) would stop at a control
// record), until the peer's end, an error or deadline. It does not take
// readMu: it runs while c closes, after its readers.
func (c *Conn) discardUntilEOF(deadline time.Time) {
	if c.sock.SetReadDeadline(deadline) != nil {
		return
	}
	buf, oob := make([]byte, 16<<10), make([]byte, unix.CmsgSpace(1))
	for {
		var n int
		var serr error
		err := c.rawSock.Read(func(fd uintptr) bool {
			n, _, _, _, serr = unix.Recvmsg(int(fd), buf, oob, 0)
			return serr != unix.EAGAIN
		})
		if err != nil || serr != nil || n == 0 {
			return
		}
	}
}

// tcpTookAll reports whether the socket's send buffer has room (64 KiB of
// SO_SNDBUF left by SO_MEMINFO's wmem_queued): kTLS hands TCP records until
// TCP refuses, so with room there nothing sealed is left in kTLS.
func tcpTookAll(fd int) bool {
	const memSndbuf, memWmemQueued = 3, 5 // SK_MEMINFO_SNDBUF, SK_MEMINFO_WMEM_QUEUED (__u32 each)
	var mem [64]byte
	n, err := getsockoptBytes(fd, unix.SOL_SOCKET, unix.SO_MEMINFO, mem[:])
	if err != nil || n < (memWmemQueued+1)*4 {
		return false
	}
	field := func(i int) uint64 { return uint64(binary.NativeEndian.Uint32(mem[4*i:])) }
	return field(memWmemQueued)+64<<10 <= field(memSndbuf)
}

// setResetOnClose makes close(2) of the socket send a reset and drop what
// is still queued (SO_LINGER on, timeout 0).
func setResetOnClose(rc syscall.RawConn) {
	controlFD(rc, func(fd int) error {
		return unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	})
}

// CloseLingering closes c without losing what is queued for the peer, as
// nginx's lingering_close does. A socket closed with unread bytes in its
// receive queue, or that receives bytes after close(2), answers with a
// RST, and a RST discards whatever the peer had not yet acknowledged: the
// end of a response. An HTTP/2 server closes one second after its last
// stream ended while the client, still draining that stream, keeps sending
// flow-control updates. So: send close_notify and, on the kernel path, a
// FIN after the queued data; read and discard until the peer closes or
// timeout passes; then close. Before a completed handshake it is Close.
func (c *Conn) CloseLingering(timeout time.Duration) error {
	if c.hsDone.Load() {
		deadline := time.Now().Add(timeout)
		c.SetWriteDeadline(deadline)
		if c.CloseWrite() == nil {
			c.SetReadDeadline(deadline)
			buf := make([]byte, 4096)
			for {
				if _, err := c.Read(buf); err != nil {
					break
				}
			}
		}
	}
	return c.Close()
}

// closeIfDifferent closes a layer over the socket too. Either may already
// be closed (a fatal read error closes the socket), which is not an error
// of Close.
func closeIfDifferent(raw net.Conn, sock *net.TCPConn) error {
	if raw == net.Conn(sock) {
		return nil
	}
	return ignoreClosed(raw.Close())
}

func ignoreClosed(err error) error {
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

var closeNotify = []byte{1, 0} // alert level warning, description close_notify

// CloseWrite sends close_notify and shuts down the write side; reading
// goes on. It waits for the peer to take close_notify as long as a Write
// would: up to the write deadline (SetWriteDeadline); on the userspace
// path a Close meanwhile ends the wait.
func (c *Conn) CloseWrite() error {
	if err := c.Handshake(); err != nil {
		return err
	}
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if !c.kernelTX() {
		if c.tlsWriteFailed.Load() {
			return errCloseNotifyAfterFailedWrite
		}
		// Bounded by the caller's write deadline, as on the kernel
		// path (recordConn.SetWriteDeadline); a Close meanwhile ends
		// the wait. Paired with Close: one of the two sees the other.
		c.record.closeWriting.Store(true)
		defer c.record.closeWriting.Store(false)
		if c.closing.Load() {
			c.record.closeWriting.Store(false)
		}
		err := c.tlsConn.Load().CloseWrite()
		c.wroteEOF = err == nil
		return err
	}
	if c.handedOff.Load() {
		return ErrHandedOff
	}
	if c.wroteEOF {
		return nil
	}
	if err := c.sendControlLocked(recordAlert, closeNotify); err != nil {
		return err
	}
	c.wroteEOF = true
	return c.sock.CloseWrite()
}

// errCloseNotifyAfterFailedWrite: CloseWrite with TX in userspace after a
// Write that failed, whose close_notify the peer could not authenticate.
var errCloseNotifyAfterFailedWrite = errors.New("ktls: no close_notify after a failed write: the peer could not authenticate it")

// sendControlLocked writes one non-data record through kTLS TX: sendmsg
// with the record type in a TLS_SET_RECORD_TYPE cmsg. Caller holds writeMu.
func (c *Conn) sendControlLocked(recordType byte, payload []byte) error {
	oob := recordTypeCmsg(recordType)
	var serr error
	err := c.rawSock.Write(func(fd uintptr) bool {
		_, serr = unix.SendmsgN(int(fd), payload, oob, nil, 0)
		return serr != unix.EAGAIN
	})
	if err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("ktls: send record type %d: %w", recordType, serr)
	}
	c.txBound++
	return nil
}
