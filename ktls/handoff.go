package ktls

// Handoff and adoption: a connection whose record layer runs entirely in
// the kernel (TLS_TX and TLS_RX installed, nothing of a record held in this
// process) moves to another process as its socket plus a HandoffState. The
// keys, the record sequence numbers and any record the kernel holds stay
// in the socket; the state carries what only this package knows: the
// TLS 1.3 traffic secrets a later KeyUpdate derives the next keys from, the
// key wear counts, the KeyUpdate rate limit's tokens, and which ends have
// been closed.
//
// The order of a move:
//
//  1. The caller stops using the Conn: no Read, Write or splice in
//     progress (a reader blocked in Read is released with a deadline in
//     the past). Handoff refuses with HandoffBusy while a Read, Write,
//     ReadFrom, WriteTo or a splice's BeginSeal..EndSeal holds the Conn; a
//     splice(2) out of the socket (SpliceSource) holds nothing, so the
//     caller must have stopped it.
//  2. Handoff checks that the connection can move, reads the kernel's
//     record sequence numbers, and returns the state and a duplicate of the
//     socket's descriptor. From then on every use of the Conn fails with
//     ErrHandedOff; Close only releases this process's descriptors: no
//     close_notify, no shutdown(2), no SO_LINGER, which would all act on
//     the socket the new owner holds.
//  3. The caller sends the descriptor and the encoded state to the other
//     process (internal/fdpass), then closes its descriptor and the Conn.
//     If the transfer fails, Adopt in this process takes the connection
//     back from the same descriptor and state: the socket was not touched.
//  4. The other process calls Adopt, which checks the socket against the
//     state with getsockopt(2) (ULP, version, cipher, key, record sequence
//     numbers) and returns a Conn that continues where the old one stopped.
//
// The state holds the traffic secrets: whoever reads it can decrypt the
// rest of the session and forge records. The channel that carries it must
// be private to the two processes (a Unix socket that only the service's
// user can reach, whose peer credentials are checked); Zero wipes a state's
// secrets once it is sent, and the caller wipes the encoded bytes.

import (
	"bytes"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"slices"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/tcpfile"
	"github.com/ktlsingress/caddy-ktls/internal/wire"
)

// HandoffVersion is the version of HandoffState's encoding (its first
// byte). A decoder refuses every other version.
const HandoffVersion = 4

// ErrHandedOff is returned by every use of a Conn after Handoff.
var ErrHandedOff = errors.New("ktls: the connection was handed off to another owner")

// HandoffReason says why Handoff refused to move a connection. The Conn is
// left as it was: the caller goes on using it (or drains it).
type HandoffReason string

// The reasons Handoff refuses.
const (
	// The handshake has not completed, or failed.
	HandoffNotEstablished HandoffReason = "not-established"
	// A direction runs in userspace (offload disabled, RX kept in
	// userspace, or the kernel refused a step); Offload().Reason says why.
	HandoffNotOffloaded HandoffReason = "not-offloaded"
	// A Read, Write or splice holds the connection.
	HandoffBusy HandoffReason = "busy"
	// Decrypted bytes are buffered in this process, not yet returned by
	// Read: they exist nowhere else.
	HandoffBufferedPlaintext HandoffReason = "buffered-plaintext"
	// A KeyUpdate is owed to the peer (an answer to its update_requested,
	// or our request at the record limit) and the socket could not take it
	// without waiting.
	HandoffKeyUpdatePending HandoffReason = "key-update-pending"
	// The connection is closing, closed, failed, or already handed off.
	HandoffEnded HandoffReason = "ended"
	// The kernel did not answer (getsockopt, dup).
	HandoffKernel HandoffReason = "kernel"
	// The kernel has sealed more records under the current key than the
	// key wear accounting counted: the count a new owner would continue
	// from cannot be vouched for.
	HandoffRecordCount HandoffReason = "record-count"
)

// HandoffError is Handoff's refusal.
type HandoffError struct {
	Reason HandoffReason
	Err    error
}

func (e *HandoffError) Error() string {
	return fmt.Sprintf("ktls: handoff refused (%s): %v", e.Reason, e.Err)
}

func (e *HandoffError) Unwrap() error { return e.Err }

// PeerEnd says how the peer's stream ended before a handoff.
type PeerEnd string

const (
	PeerEndNone        PeerEnd = ""             // the peer's stream is open
	PeerEndCloseNotify PeerEnd = "close_notify" // the peer sent close_notify (Read returned io.EOF)
	PeerEndEOF         PeerEnd = "eof"          // the transport ended at a record boundary without close_notify (Read returned io.EOF)
)

// HandoffDirection is one direction's key state at a handoff.
type HandoffDirection struct {
	// Secret is the current TLS 1.3 application traffic secret, from which
	// a KeyUpdate derives the next key; empty for TLS 1.2. Sensitive.
	Secret []byte
	// Seq is the kernel's record sequence number (getsockopt TLS_TX or
	// TLS_RX): the records the current key has protected.
	Seq uint64
	// Bound is the key wear accounting's upper bound of those records
	// (wear.go). TX: Seq <= Bound, or Handoff refuses. RX: records that
	// carry no plaintext (empty records, and the peer's control records)
	// are counted only when the kernel's count is read, so Seq may exceed
	// Bound.
	Bound uint64
	// Mode is where the kernel seals or opens this direction's records
	// (ModeSW or ModeHW), as the Conn learned it when the key went in: the
	// kernel does not change it while the socket lives.
	Mode Mode
}

// HandoffState is what a process needs, beyond the socket, to continue a
// fully offloaded connection. It holds secrets (HandoffDirection.Secret):
// see the package's handoff notes for the channel it may travel over.
type HandoffState struct {
	Version     uint16 // TLS version
	CipherSuite uint16 // crypto/tls cipher suite ID
	Client      bool   // the Conn was the client side
	TX, RX      HandoffDirection
	// RXNoPad: TLS_RX_EXPECT_NO_PAD is in effect on the socket.
	RXNoPad bool
	// CloseNotifySent: we sent close_notify (CloseWrite); writes fail.
	CloseNotifySent bool
	// PeerEnd: how the peer's stream ended, if it did; Read then returns io.EOF.
	PeerEnd PeerEnd
	// KeyUpdateAsked: we asked the peer to update its key (at the record
	// limit) and it has not yet.
	KeyUpdateAsked bool
	// KeyUpdateTokens and KeyUpdateLast are the KeyUpdate rate limit's
	// bucket (Options.KeyUpdateLimit): tokens left, and when it was last
	// taken from (zero: never).
	KeyUpdateTokens float64
	KeyUpdateLast   time.Time
	// RecordLimit and KeyUpdateLimit are the connection's
	// Options.RecordLimit and Options.KeyUpdateLimit (zero: the defaults):
	// a connection keeps the limits it was made with, in its new owner
	// too.
	RecordLimit    uint64
	KeyUpdateLimit Rate
	// What ConnectionState reports after adoption.
	ServerName         string
	NegotiatedProtocol string
	DidResume          bool
	PeerCertificates   [][]byte // DER, leaf first
}

// Zero overwrites the traffic secrets in s. Encoded copies are the caller's
// to wipe.
func (s *HandoffState) Zero() {
	clear(s.TX.Secret)
	clear(s.RX.Secret)
}

// Handoff stops this process's use of c and returns what another owner
// needs to continue it: the state and the socket, c's own (no descriptor
// is duplicated for it), to pass on (fdpass.Send reads its descriptor
// under its RawConn's Control) or to Adopt in this process; it is valid
// until c is closed. It refuses with a *HandoffError, leaving c working,
// unless both directions run in the kernel, no Read, Write or splice holds
// c, and nothing of the peer's stream is buffered here. A KeyUpdate owed
// to the peer is sent first. After a successful Handoff every use of c
// fails with ErrHandedOff, and Close releases c's own descriptors only.
func (c *Conn) Handoff() (HandoffState, syscall.Conn, error) {
	st, err := c.handoff()
	if err != nil {
		stats.handoffRefused.Add(1)
		return HandoffState{}, nil, err
	}
	stats.handedOff.Add(1)
	return st, c.sock, nil
}

func (c *Conn) handoff() (HandoffState, error) {
	refuse := func(reason HandoffReason, format string, args ...any) (HandoffState, error) {
		return HandoffState{}, &HandoffError{Reason: reason, Err: fmt.Errorf(format, args...)}
	}
	if !c.hsDone.Load() {
		return refuse(HandoffNotEstablished, "the handshake has not completed")
	}
	if c.hsErr != nil {
		return refuse(HandoffNotEstablished, "the handshake failed: %w", c.hsErr)
	}
	// Lock order as everywhere: readMu, then writeMu. A holder is a Read,
	// Write or splice in progress, which the caller should have stopped:
	// waiting for it could take as long as the peer likes.
	if !c.readMu.TryLock() {
		return refuse(HandoffBusy, "a Read, WriteTo or Opened is in progress")
	}
	defer c.readMu.Unlock()
	if !c.writeMu.TryLock() {
		return refuse(HandoffBusy, "a Write, ReadFrom or splice into the socket is in progress")
	}
	defer c.writeMu.Unlock()
	switch {
	case c.handedOff.Load():
		return refuse(HandoffEnded, "%w", ErrHandedOff)
	case c.closing.Load():
		return refuse(HandoffEnded, "the connection is closing")
	case c.off.TX == ModeUserspace || c.off.RX == ModeUserspace || c.opener != nil:
		return refuse(HandoffNotOffloaded, "TX %v, RX %v (offload reason %s)", c.off.TX, c.off.RX, c.off.Reason)
	case len(c.pending) > 0:
		return refuse(HandoffBufferedPlaintext, "%d decrypted bytes not yet read", len(c.pending))
	case c.readErr != nil && !errors.Is(c.readErr, io.EOF):
		return refuse(HandoffEnded, "the connection failed: %w", c.readErr)
	}
	if c.txWant.Load() != 0 && !c.wroteEOF {
		if err := controlFD(c.rawSock, c.sendWantedLocked); err != nil {
			return refuse(HandoffKeyUpdatePending, "sending the KeyUpdate owed to the peer: %w", err)
		}
	}
	txSeq, err := c.kernelSeq(optTLSTX)
	if err != nil {
		return refuse(HandoffKernel, "%w", err)
	}
	rxSeq, err := c.kernelSeq(optTLSRX)
	if err != nil {
		return refuse(HandoffKernel, "%w", err)
	}
	if txSeq > c.txBound {
		return refuse(HandoffRecordCount, "the kernel sealed %d records under the current key, the key wear accounting counted at most %d", txSeq, c.txBound)
	}
	cs := c.ConnectionState()
	st := HandoffState{
		Version:            c.off.Version,
		CipherSuite:        c.off.CipherSuite,
		Client:             c.isClient,
		TX:                 HandoffDirection{Secret: bytes.Clone(c.txSecret), Seq: txSeq, Bound: c.txBound, Mode: c.off.TX},
		RX:                 HandoffDirection{Secret: bytes.Clone(c.rxSecret), Seq: rxSeq, Bound: c.rxBound, Mode: c.off.RX},
		RXNoPad:            c.off.RXNoPad,
		CloseNotifySent:    c.wroteEOF,
		KeyUpdateAsked:     c.rxAsked,
		KeyUpdateTokens:    c.limiter.tokens,
		KeyUpdateLast:      c.limiter.last,
		RecordLimit:        c.opts.RecordLimit,
		KeyUpdateLimit:     c.opts.KeyUpdateLimit,
		ServerName:         cs.ServerName,
		NegotiatedProtocol: cs.NegotiatedProtocol,
		DidResume:          cs.DidResume,
	}
	for _, cert := range cs.PeerCertificates {
		st.PeerCertificates = append(st.PeerCertificates, bytes.Clone(cert.Raw))
	}
	if c.readErr != nil {
		st.PeerEnd = PeerEndEOF
		if c.notified.Load() {
			st.PeerEnd = PeerEndCloseNotify
		}
	}
	c.handedOff.Store(true)
	c.readErr = ErrHandedOff
	// The secrets live on in st only; this Conn will not derive a key again.
	clear(c.txSecret)
	clear(c.rxSecret)
	c.keys.wipe()
	return st, nil
}

// closeLocal releases this process's descriptors of a handed-off
// connection and nothing else: the socket lives on in its new owner.
func (c *Conn) closeLocal() error {
	return errors.Join(ignoreClosed(c.sock.Close()), closeIfDifferent(c.raw, c.sock))
}

// ErrAdoptMismatch is returned by Adopt when the socket's kernel TLS state
// is not the one the HandoffState describes.
var ErrAdoptMismatch = errors.New("ktls: the socket's kernel TLS state does not match the handoff state")

// Adopt returns a Conn over a socket whose kernel TLS state another Conn
// handed off (Handoff), in this process or another: s is a descriptor
// received from another process (an *os.File), or the socket Handoff
// returned. It does not take s: the Conn holds a descriptor of its own,
// and the caller closes s (the socket Handoff returned closes with its
// Conn). The socket keeps
// its options (Nagle, keepalive, TCP_USER_TIMEOUT) as they were. It must
// carry the "tls" ULP with TLS_TX and TLS_RX installed for st's version and
// cipher, at st's record sequence numbers, and for TLS 1.3 with the keys
// st's secrets derive; otherwise Adopt fails (ErrAdoptMismatch, or an error
// naming what is missing) and leaves the socket untouched.
//
// The Conn behaves as one after a handshake with both directions offloaded:
// key wear continues from st's counts under st's limits (RecordLimit,
// KeyUpdateLimit: the connection's own, as it was made), a KeyUpdate
// (either side's) derives the next key from st's secrets, and the closed
// ends stay closed. From opts it takes only the Observer: the options that
// choose an offload (Disable, DisableRX, RequireOffload, ExpectNoPad,
// TXZeroCopyRO) were applied to the socket at its handshake and stay as
// they are. No Observer event reports the adoption. A client Conn passes
// no later session ticket to a session cache: the tls.Conn that held the
// resumption secret stayed with the old owner.
func Adopt(s syscall.Conn, st HandoffState, opts Options) (*Conn, error) {
	if err := st.validate(); err != nil {
		return nil, err
	}
	var peerCerts []*x509.Certificate
	for i, der := range st.PeerCertificates {
		cert, err := parseAdoptedCert(der)
		if err != nil {
			return nil, fmt.Errorf("ktls: adopt: peer certificate %d: %w", i, err)
		}
		peerCerts = append(peerCerts, cert)
	}
	// The socket keeps its Nagle and keepalive settings (net.FileConn
	// alone would set Go's defaults on it).
	sock, err := tcpfile.Conn(s)
	if err != nil {
		return nil, fmt.Errorf("ktls: adopt: %w", err)
	}
	rawSock, err := sock.SyscallConn()
	if err == nil {
		err = checkAdoptable(rawSock, &st)
	}
	if err != nil {
		sock.Close()
		return nil, err
	}
	opts.RecordLimit, opts.KeyUpdateLimit = st.RecordLimit, st.KeyUpdateLimit
	c := &Conn{raw: sock, isClient: st.Client, opts: opts, record: newRecordConn(sock), keys: &keyCapture{}}
	c.sock, c.rawSock = sock, rawSock
	// The modes are the ones the kernel reported to the Conn that handed
	// it off (sock_diag, at its handshake): no query of its own here.
	c.off = Offload{TX: st.TX.Mode, RX: st.RX.Mode, RXNoPad: st.RXNoPad, Reason: ReasonNone, Version: st.Version, CipherSuite: st.CipherSuite}
	if c.off.RX != ModeUserspace {
		c.rx = newRXReader(&c.rd, rawSock)
		c.rd.setSock(sock)
	}
	c.adopted = &tls.ConnectionState{
		Version:            st.Version,
		HandshakeComplete:  true,
		DidResume:          st.DidResume,
		CipherSuite:        st.CipherSuite,
		NegotiatedProtocol: st.NegotiatedProtocol,
		ServerName:         st.ServerName,
		PeerCertificates:   peerCerts,
	}
	c.txSecret, c.rxSecret = bytes.Clone(st.TX.Secret), bytes.Clone(st.RX.Secret)
	c.txBound, c.rxBound = max(st.TX.Bound, st.TX.Seq), max(st.RX.Bound, st.RX.Seq)
	c.rxAsked = st.KeyUpdateAsked
	c.limiter = newTokenBucket(opts.KeyUpdateLimit)
	c.limiter.tokens = min(st.KeyUpdateTokens, float64(c.limiter.rate.Burst))
	if now := time.Now(); st.KeyUpdateLast.After(now) {
		c.limiter.last = now
	} else {
		c.limiter.last = st.KeyUpdateLast
	}
	c.wroteEOF = st.CloseNotifySent
	if st.PeerEnd != PeerEndNone {
		c.readErr = io.EOF
		c.notified.Store(st.PeerEnd == PeerEndCloseNotify)
	}
	c.hsDone.Store(true)
	stats.adopted.Add(1)
	return c, nil
}

// checkAdoptable compares the socket's kernel TLS state with st: the "tls"
// ULP, and per direction the version, cipher and record sequence number
// and, for TLS 1.3, the key st's secret derives (the kernel returns its
// crypto_info, key included, on getsockopt).
func checkAdoptable(rc syscall.RawConn, st *HandoffState) error {
	var ulp [16]byte
	var n int
	if err := controlFD(rc, func(fd int) (err error) {
		n, err = getsockoptBytes(fd, unix.IPPROTO_TCP, unix.TCP_ULP, ulp[:])
		return err
	}); err != nil {
		return fmt.Errorf("ktls: adopt: reading the socket's ULP: %w", err)
	}
	if name := cString(ulp[:n]); name != "tls" {
		return fmt.Errorf("ktls: adopt: the socket has no kernel TLS (ULP %q)", name)
	}
	cs, err := suiteFor(st.Version, st.CipherSuite)
	if err != nil {
		return err
	}
	for _, d := range []struct {
		name string
		opt  int
		dir  *HandoffDirection
	}{{"TX", optTLSTX, &st.TX}, {"RX", optTLSRX, &st.RX}} {
		info, err := readCryptoInfo(rc, d.opt, cs)
		if err != nil {
			return fmt.Errorf("ktls: adopt: %s: %w", d.name, err)
		}
		if !info.is(cs) {
			return fmt.Errorf("%w: %s: %v", ErrAdoptMismatch, d.name, info.mismatch(cs))
		}
		err = info.matches(st, cs, d.dir)
		info.wipe()
		if err != nil {
			return fmt.Errorf("%w: %s: %v", ErrAdoptMismatch, d.name, err)
		}
	}
	return nil
}

// matches compares the kernel's direction with the state's.
func (k *kernelInfo) matches(st *HandoffState, cs *cipherSuite, d *HandoffDirection) error {
	if k.seq != d.Seq {
		return fmt.Errorf("record sequence number %d in the kernel, %d in the state", k.seq, d.Seq)
	}
	if st.Version != tls.VersionTLS13 {
		return nil
	}
	// The key alone says that the socket is the state's and that its
	// secret is the one a KeyUpdate continues from: the static IV comes
	// from the same secret, installed with the key, and costs a second
	// HKDF-Expand-Label per direction to check.
	key, err := trafficKey(st.CipherSuite, d.Secret)
	if err != nil {
		return err
	}
	defer clear(key)
	if subtle.ConstantTimeCompare(key, k.key) != 1 {
		return errors.New("the kernel's key is not the one the state's traffic secret derives")
	}
	return nil
}

// validate checks what a decoder cannot: the suite, and secrets present
// exactly where a KeyUpdate needs them, of the suite's hash length.
func (s *HandoffState) validate() error {
	cs, err := suiteFor(s.Version, s.CipherSuite)
	if err != nil {
		return fmt.Errorf("ktls: handoff state: %w", err)
	}
	for _, d := range []struct {
		name string
		dir  HandoffDirection
	}{{"tx", s.TX}, {"rx", s.RX}} {
		if d.dir.Mode != ModeSW && d.dir.Mode != ModeHW {
			return fmt.Errorf("ktls: handoff state: %s: a direction in mode %v is not in the kernel", d.name, d.dir.Mode)
		}
		switch {
		case s.Version == tls.VersionTLS13:
			if err := checkSecret(cs, d.dir.Secret); err != nil {
				return fmt.Errorf("ktls: handoff state: %s: %w", d.name, err)
			}
		case len(d.dir.Secret) != 0:
			return fmt.Errorf("ktls: handoff state: %s: a %s state carries no traffic secret", d.name, tls.VersionName(s.Version))
		}
	}
	switch s.PeerEnd {
	case PeerEndNone, PeerEndCloseNotify, PeerEndEOF:
	default:
		return fmt.Errorf("ktls: handoff state: unknown peer end %q", s.PeerEnd)
	}
	if math.IsNaN(s.KeyUpdateTokens) || math.IsInf(s.KeyUpdateTokens, 0) || s.KeyUpdateTokens < 0 {
		return fmt.Errorf("ktls: handoff state: KeyUpdate tokens %v", s.KeyUpdateTokens)
	}
	if s.RecordLimit > MaxRecordLimit {
		return fmt.Errorf("ktls: handoff state: record limit %d above %d", s.RecordLimit, MaxRecordLimit)
	}
	if r := s.KeyUpdateLimit; math.IsNaN(r.PerSecond) || math.IsInf(r.PerSecond, 0) || r.PerSecond < 0 || r.Burst < 0 {
		return fmt.Errorf("ktls: handoff state: KeyUpdate rate %v per second, burst %d", r.PerSecond, r.Burst)
	}
	for i, der := range s.PeerCertificates {
		if len(der) == 0 {
			return fmt.Errorf("ktls: handoff state: peer certificate %d is empty", i)
		}
	}
	return nil
}

// HandoffVersionError is a state encoded in a version this package does
// not read.
type HandoffVersionError struct {
	Got int
}

func (e *HandoffVersionError) Error() string {
	return fmt.Sprintf("ktls: handoff state version %d, this build reads only version %d", e.Got, HandoffVersion)
}

// peerEnds numbers the PeerEnd values in the encoding.
var peerEnds = []PeerEnd{PeerEndNone, PeerEndCloseNotify, PeerEndEOF}

// Encode returns s in the current HandoffVersion (internal/wire): the TLS
// version and cipher suite, the flags (client, close_notify sent,
// KeyUpdate asked, resumed, RX expects no padding), the peer's end, TX
// then RX (secret, record sequence, wear bound, mode), the KeyUpdate
// bucket (tokens, last), the limits (records, KeyUpdates per second and
// burst), the server name, the ALPN protocol and the peer's certificates.
// The bytes hold the traffic secrets: the caller wipes them once sent.
func (s *HandoffState) Encode() ([]byte, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	return s.encode(), nil
}

// encode is Encode of a state already validated.
func (s *HandoffState) encode() []byte {
	size := 128 + len(s.TX.Secret) + len(s.RX.Secret) + len(s.ServerName) + len(s.NegotiatedProtocol)
	for _, der := range s.PeerCertificates {
		size += len(der) + 3
	}
	w := wire.NewWriter(HandoffVersion, size)
	w.Uint16(s.Version)
	w.Uint16(s.CipherSuite)
	w.Bool(s.Client)
	w.Bool(s.CloseNotifySent)
	w.Bool(s.KeyUpdateAsked)
	w.Bool(s.DidResume)
	w.Bool(s.RXNoPad)
	w.Uint(uint64(slices.Index(peerEnds, s.PeerEnd)))
	for _, d := range []*HandoffDirection{&s.TX, &s.RX} {
		w.Bytes(d.Secret)
		w.Uint(d.Seq)
		w.Uint(d.Bound)
		w.Uint(uint64(d.Mode))
	}
	w.Float(s.KeyUpdateTokens)
	w.Time(s.KeyUpdateLast)
	w.Uint(s.RecordLimit)
	w.Float(s.KeyUpdateLimit.PerSecond)
	w.Int(int64(s.KeyUpdateLimit.Burst))
	w.Text(s.ServerName)
	w.Text(s.NegotiatedProtocol)
	w.Uint(uint64(len(s.PeerCertificates)))
	for _, der := range s.PeerCertificates {
		w.Bytes(der)
	}
	return w.B
}

// DecodeHandoffState decodes what Encode wrote. It refuses another version
// (*HandoffVersionError), a state cut short or with anything after it, and
// a state Adopt could not use. The state's bytes are not kept: the caller
// wipes them.
func DecodeHandoffState(b []byte) (HandoffState, error) {
	r := wire.NewReader(b)
	if v := r.Version(); r.Err() == nil && v != HandoffVersion {
		return HandoffState{}, &HandoffVersionError{Got: int(v)}
	}
	var s HandoffState
	r.Field("tls version")
	s.Version = r.Uint16()
	r.Field("cipher suite")
	s.CipherSuite = r.Uint16()
	r.Field("flags")
	s.Client, s.CloseNotifySent, s.KeyUpdateAsked, s.DidResume, s.RXNoPad = r.Bool(), r.Bool(), r.Bool(), r.Bool(), r.Bool()
	r.Field("peer end")
	s.PeerEnd = peerEnds[r.Index(len(peerEnds))]
	for _, d := range []struct {
		name string
		dir  *HandoffDirection
	}{{"tx", &s.TX}, {"rx", &s.RX}} {
		r.Field(d.name)
		d.dir.Secret = r.Bytes()
		d.dir.Seq = r.Uint()
		d.dir.Bound = r.Uint()
		d.dir.Mode = Mode(r.Index(int(ModeHW) + 1))
	}
	r.Field("key update bucket")
	s.KeyUpdateTokens = r.Float()
	s.KeyUpdateLast = r.Time()
	r.Field("limits")
	s.RecordLimit = r.Uint()
	s.KeyUpdateLimit.PerSecond = r.Float()
	burst := r.Int()
	s.KeyUpdateLimit.Burst = int(burst)
	r.Field("server name")
	s.ServerName = r.Text()
	r.Field("alpn")
	s.NegotiatedProtocol = r.Text()
	r.Field("peer certificates")
	if n := r.Count(); n > 0 {
		s.PeerCertificates = make([][]byte, n)
		for i := range s.PeerCertificates {
			s.PeerCertificates[i] = r.Bytes()
		}
	}
	err := r.End()
	if err == nil && int64(s.KeyUpdateLimit.Burst) != burst {
		err = fmt.Errorf("KeyUpdate burst %d", burst)
	}
	if err != nil {
		s.Zero()
		return HandoffState{}, fmt.Errorf("ktls: handoff state: %w", err)
	}
	if err := s.validate(); err != nil {
		s.Zero()
		return HandoffState{}, err
	}
	return s, nil
}

// HandOffConn is Handoff for c, a *Conn, with the state encoded: what
// forward.Config.HandOffConn takes. Any other connection is refused.
func HandOffConn(c net.Conn) ([]byte, syscall.Conn, error) {
	kc, ok := c.(*Conn)
	if !ok {
		return nil, nil, &HandoffError{Reason: HandoffNotOffloaded, Err: fmt.Errorf("a %T is no kernel TLS connection", c)}
	}
	st, sock, err := kc.Handoff()
	if err != nil {
		return nil, nil, err
	}
	defer st.Zero()
	b, err := st.Encode()
	if err != nil {
		return nil, nil, err
	}
	return b, sock, nil
}

// AdoptConn returns what forward.Config.AdoptConn takes: Adopt of an
// encoded state with opts, and the function that drops the Conn without
// ending its session (its descriptors close, nothing is sent): for a
// connection whose session stays with the process that handed it over.
func AdoptConn(opts Options) func(state []byte, s syscall.Conn) (net.Conn, func(), error) {
	return func(state []byte, s syscall.Conn) (net.Conn, func(), error) {
		st, err := DecodeHandoffState(state)
		if err != nil {
			return nil, nil, err
		}
		defer st.Zero()
		c, err := Adopt(s, st, opts)
		if err != nil {
			return nil, nil, err
		}
		return c, c.forget, nil
	}
}

// forget releases an adopted Conn that was never used, its session left
// to the process that handed it over: the secrets are wiped, this
// process's descriptors closed, nothing sent.
func (c *Conn) forget() {
	c.readMu.Lock()
	c.writeMu.Lock()
	c.handedOff.Store(true)
	c.readErr = ErrHandedOff
	clear(c.txSecret)
	clear(c.rxSecret)
	c.keys.wipe()
	c.writeMu.Unlock()
	c.readMu.Unlock()
	c.closeLocal()
}
