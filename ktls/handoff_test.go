package ktls

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// wantHandoffRefused fails t unless err is a *HandoffError with reason,
// whose text contains says.
func wantHandoffRefused(t *testing.T, err error, reason HandoffReason, says string) {
	t.Helper()
	var he *HandoffError
	if !errors.As(err, &he) || he.Reason != reason || !strings.Contains(err.Error(), says) {
		t.Fatalf("Handoff: %v; want a refusal (%s) saying %q", err, reason, says)
	}
}

// TestHandoffRefusesUserspaceTLS: a Conn whose session runs in crypto/tls
// (offload disabled) cannot move, Handoff says why, and the Conn goes on:
// 256 KiB each way, SHA-256 checked, close_notify both ways.
func TestHandoffRefusesUserspaceTLS(t *testing.T) {
	checkNoFDLeak(t, kerneltest.OpenFDs)
	scfg, ccfg := newTestPKI(t).configs(connCase{version: tls.VersionTLS13})
	pr, err := dialPair(t, scfg, ccfg, Options{Disable: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	before := Stats()
	st, sock, err := pr.server.Handoff()
	wantHandoffRefused(t, err, HandoffNotOffloaded, "offload reason disabled")
	if sock != nil || st.Version != 0 {
		t.Fatalf("a refused Handoff returned %v and a state of version %#x", sock, st.Version)
	}
	if got := Stats().HandoffRefused - before.HandoffRefused; got != 1 {
		t.Errorf("HandoffRefused moved by %d, want 1", got)
	}
	exchange(t, pr, smallBytes)
}

// TestHandoffBeforeHandshake: Handoff neither runs nor waits for the
// handshake (a net.Pipe with nobody at the other end would block it).
func TestHandoffBeforeHandshake(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	c := Server(a, &tls.Config{}, Options{})
	_, _, err := c.Handoff()
	wantHandoffRefused(t, err, HandoffNotEstablished, "has not completed")
}

// fakeRawConn is the raw conn of a socket that is not there: Control runs
// f on descriptor -1 (every syscall on it fails with EBADF), or fails.
type fakeRawConn struct{ err error }

func (r fakeRawConn) Control(f func(fd uintptr)) error {
	if r.err != nil {
		return r.err
	}
	f(^uintptr(0))
	return nil
}
func (r fakeRawConn) Read(f func(fd uintptr) bool) error {
	return r.Control(func(fd uintptr) { f(fd) })
}
func (r fakeRawConn) Write(f func(fd uintptr) bool) error {
	return r.Control(func(fd uintptr) { f(fd) })
}

// offloadedConn is a Conn in the state a completed handshake with both
// directions in the kernel leaves, over no socket: Handoff's checks run on
// it until it asks the kernel.
func offloadedConn() *Conn {
	c := &Conn{keys: &keyCapture{}, rawSock: fakeRawConn{}}
	c.off = Offload{TX: ModeSW, RX: ModeSW, Version: tls.VersionTLS13, CipherSuite: tls.TLS_AES_128_GCM_SHA256}
	c.hsDone.Store(true)
	return c
}

// TestHandoffRefusals: each state a connection cannot move in is refused
// with its reason before anything changes: the Conn's reads, writes and
// buffered bytes are as they were. The last case reaches the kernel, which
// is not there.
func TestHandoffRefusals(t *testing.T) {
	for _, tc := range []struct {
		name   string
		set    func(c *Conn) (undo func())
		reason HandoffReason
		says   string
	}{
		{"handshake failed", func(c *Conn) func() { c.hsErr = errors.New("bad certificate"); return nil },
			HandoffNotEstablished, "bad certificate"},
		{"rx in userspace", func(c *Conn) func() { c.off.RX = ModeUserspace; c.off.Reason = ReasonRXDisabled; return nil },
			HandoffNotOffloaded, "RX userspace (offload reason rx-disabled)"},
		{"rx opener", func(c *Conn) func() { c.opener = &recordOpener{}; return nil },
			HandoffNotOffloaded, "offload reason"},
		{"tx in userspace", func(c *Conn) func() { c.off.TX = ModeUserspace; return nil },
			HandoffNotOffloaded, "TX userspace"},
		{"buffered plaintext", func(c *Conn) func() { c.pending = []byte("12345"); return nil },
			HandoffBufferedPlaintext, "5 decrypted bytes"},
		{"reader busy", func(c *Conn) func() { c.readMu.Lock(); return c.readMu.Unlock },
			HandoffBusy, "Read"},
		{"writer busy", func(c *Conn) func() { c.writeMu.Lock(); return c.writeMu.Unlock },
			HandoffBusy, "Write"},
		{"failed", func(c *Conn) func() { c.readErr = AlertError(20); return nil },
			HandoffEnded, "bad_record_mac"},
		{"closing", func(c *Conn) func() { c.closing.Store(true); return nil },
			HandoffEnded, "closing"},
		{"handed off", func(c *Conn) func() { c.handedOff.Store(true); return nil },
			HandoffEnded, ErrHandedOff.Error()},
		{"key update owed", func(c *Conn) func() {
			c.txWant.Store(wantAnswer)
			c.rawSock = fakeRawConn{err: errors.New("no room")}
			return nil
		}, HandoffKeyUpdatePending, "no room"},
		{"kernel", func(c *Conn) func() { return nil },
			HandoffKernel, "bad file descriptor"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := offloadedConn()
			undo := tc.set(c)
			readErr, pending := c.readErr, bytes.Clone(c.pending)
			_, sock, err := c.Handoff()
			if undo != nil {
				undo()
			}
			wantHandoffRefused(t, err, tc.reason, tc.says)
			if sock != nil || c.handedOff.Load() != (tc.name == "handed off") || c.readErr != readErr || !bytes.Equal(c.pending, pending) {
				t.Fatalf("the refusal changed the Conn: socket %v, handed off %v, read error %v, %d bytes pending",
					sock, c.handedOff.Load(), c.readErr, len(c.pending))
			}
			// Neither lock was left held.
			if !c.readMu.TryLock() || !c.writeMu.TryLock() {
				t.Fatal("Handoff left a lock held")
			}
		})
	}
}

// TestHandedOffConnRefusesUse: after Handoff every use of the Conn fails
// with ErrHandedOff, and Close, Abort and Refuse release the Conn's own
// descriptors without a byte to the peer (no close_notify, no alert) and
// without shutting the socket down: what the new owner writes on the same
// socket reaches the peer. Over plain TCP, with the handoff's end state set
// by hand (a host without kTLS cannot make one).
func TestHandedOffConnRefusesUse(t *testing.T) {
	for _, end := range []string{"Close", "Abort", "Refuse", "CloseWrite+Close"} {
		t.Run(end, func(t *testing.T) {
			checkNoFDLeak(t, kerneltest.OpenFDs)
			peer, conn := loopbackPair(t)
			sock := conn.(*net.TCPConn)
			defer peer.Close()
			rc, err := sock.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			c := offloadedConn()
			c.raw, c.sock, c.rawSock = sock, sock, rc
			// The new owner's descriptor, as a receiving process gets one.
			f, err := sock.File()
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			// What Handoff leaves.
			c.handedOff.Store(true)
			c.readErr = ErrHandedOff

			for name, use := range map[string]func() error{
				"Read":     func() error { _, err := c.Read(make([]byte, 1)); return err },
				"Write":    func() error { _, err := c.Write([]byte("x")); return err },
				"ReadFrom": func() error { _, err := c.ReadFrom(strings.NewReader("x")); return err },
				"WriteTo":  func() error { _, err := c.WriteTo(io.Discard); return err },
				"Opened":   func() error { return c.Opened(1) },
				"BeginSeal": func() error {
					err := c.BeginSeal(0)
					if err == nil {
						c.EndSeal(0)
					}
					return err
				},
				"SyscallConn": func() error { _, err := c.SyscallConn(); return err },
				"Handoff":     func() error { _, _, err := c.Handoff(); return err },
			} {
				if err := use(); !errors.Is(err, ErrHandedOff) {
					t.Errorf("%s after Handoff: %v, want ErrHandedOff", name, err)
				}
			}
			if _, ok := c.SpliceSource(); ok {
				t.Error("SpliceSource after Handoff")
			}
			if _, ok := c.SpliceSink(); ok {
				t.Error("SpliceSink after Handoff")
			}
			var err2 error
			switch end {
			case "Close":
				err2 = c.Close()
			case "Abort":
				err2 = c.Abort()
			case "Refuse":
				err2 = c.Refuse()
			case "CloseWrite+Close":
				if err := c.CloseWrite(); !errors.Is(err, ErrHandedOff) {
					t.Errorf("CloseWrite after Handoff: %v", err)
				}
				err2 = c.Close()
			}
			if err2 != nil {
				t.Fatalf("%s: %v", end, err2)
			}
			// The new owner's descriptor: its bytes are the first the
			// peer reads, and the peer's reach it.
			nc, err := net.FileConn(f)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			if _, err := nc.Write([]byte("new owner")); err != nil {
				t.Fatal(err)
			}
			nc.(*net.TCPConn).CloseWrite()
			got, err := io.ReadAll(peer)
			if err != nil || string(got) != "new owner" {
				t.Fatalf("the peer read %q, %v; want only the new owner's bytes", got, err)
			}
			if _, err := peer.Write([]byte("back")); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 4)
			if _, err := io.ReadFull(nc, buf); err != nil || string(buf) != "back" {
				t.Fatalf("the new owner read %q, %v", buf, err)
			}
		})
	}
}

// testState is a valid TLS 1.3 state.
func testState() HandoffState {
	return HandoffState{
		Version: tls.VersionTLS13, CipherSuite: tls.TLS_AES_128_GCM_SHA256,
		TX:      HandoffDirection{Secret: bytes.Repeat([]byte{1}, 32), Seq: 7, Bound: 9, Mode: ModeSW},
		RX:      HandoffDirection{Secret: bytes.Repeat([]byte{2}, 32), Seq: 1 << 60, Bound: 3, Mode: ModeHW},
		RXNoPad: true, CloseNotifySent: true, PeerEnd: PeerEndCloseNotify, KeyUpdateAsked: true,
		KeyUpdateTokens: 12.5, KeyUpdateLast: time.Date(2026, 5, 4, 3, 2, 1, 123456789, time.UTC),
		ServerName: "sandbox.example", NegotiatedProtocol: "h2", DidResume: true,
		PeerCertificates: [][]byte{{0x30, 1, 2}, {0x30, 3}},
		RecordLimit:      4096, KeyUpdateLimit: Rate{PerSecond: 2.5, Burst: 7},
	}
}

// TestHandoffStateEncoding: a state survives Encode and DecodeHandoffState
// field for field, its version first; the decoded state holds none of the
// encoding's bytes (the caller wipes them); Zero wipes the secrets.
func TestHandoffStateEncoding(t *testing.T) {
	st := testState()
	b, err := st.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if b[0] != HandoffVersion {
		t.Fatalf("encoding starts with %d, want the version %d", b[0], HandoffVersion)
	}
	got, err := DecodeHandoffState(b)
	if err != nil {
		t.Fatal(err)
	}
	if !statesEqual(got, st) {
		t.Fatalf("decoded %+v\nwant    %+v", got, st)
	}
	clear(b)
	if !statesEqual(got, st) {
		t.Fatalf("after the encoding was wiped, the decoded state is %+v", got)
	}
	// TLS 1.2 carries no secrets; nothing set is nothing decoded.
	st12 := HandoffState{Version: tls.VersionTLS12, CipherSuite: tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
		TX: HandoffDirection{Seq: 5, Bound: 5, Mode: ModeSW}, RX: HandoffDirection{Seq: 4, Bound: 40, Mode: ModeSW}}
	b, err = st12.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := DecodeHandoffState(b); err != nil || !statesEqual(got, st12) || got.PeerCertificates != nil || !got.KeyUpdateLast.IsZero() {
		t.Fatalf("TLS 1.2: %+v, %v", got, err)
	}
	tx := st.TX.Secret
	st.Zero()
	if !bytes.Equal(tx, make([]byte, 32)) || !bytes.Equal(st.RX.Secret, make([]byte, 32)) {
		t.Fatal("Zero left secrets")
	}
}

func statesEqual(a, b HandoffState) bool {
	if !a.KeyUpdateLast.Equal(b.KeyUpdateLast) {
		return false
	}
	a.KeyUpdateLast, b.KeyUpdateLast = time.Time{}, time.Time{}
	return reflect.DeepEqual(a, b)
}

// TestHandoffStateDecodeStrict: the decoder refuses a state of another
// version, cut short or with more after it, and one Adopt could not use,
// saying what.
func TestHandoffStateDecodeStrict(t *testing.T) {
	st := testState()
	good, err := st.Encode()
	if err != nil {
		t.Fatal(err)
	}
	// edit encodes a changed state without Encode's checks: Decode must
	// make them.
	edit := func(f func(s *HandoffState)) []byte {
		s := testState()
		f(&s)
		return s.encode()
	}
	other := bytes.Clone(good)
	other[0] = HandoffVersion + 1
	for _, tc := range []struct {
		name string
		in   []byte
		says string
	}{
		{"next version", other, fmt.Sprintf("version %d, this build reads only version %d", HandoffVersion+1, HandoffVersion)},
		{"version 2 (JSON)", []byte(`{"v":2}`), fmt.Sprintf("version 123, this build reads only version %d", HandoffVersion)},
		{"empty", nil, "version: the state ends"},
		{"cut short", good[:len(good)-1], "peer certificates: the state ends"},
		{"trailing data", append(bytes.Clone(good), 0), "data after the last field"},
		{"unknown peer end", func() []byte { b := bytes.Clone(good); b[10] = 3; return b }(), "peer end: 3: a number past the values it numbers"},
		{"flag 2", func() []byte { b := bytes.Clone(good); b[5] = 2; return b }(), "flags: a boolean other than 0 or 1"},
		{"short secret", edit(func(s *HandoffState) { s.RX.Secret = s.RX.Secret[:3] }), "rx: ktls: traffic secret for TLS_AES_128_GCM_SHA256 is 3 bytes, want 32"},
		{"a direction in userspace", edit(func(s *HandoffState) { s.TX.Mode = ModeUserspace }), "tx: a direction in mode userspace is not in the kernel"},
		{"unknown mode", edit(func(s *HandoffState) { s.RX.Mode = ModeHW + 1 }), "rx: 3: a number past the values it numbers"},
		{"TLS 1.3 without secret", edit(func(s *HandoffState) { s.TX.Secret = nil }), "tx: ktls: traffic secret"},
		{"TLS 1.2 with secret", edit(func(s *HandoffState) {
			s.Version, s.CipherSuite = tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
		}), "a TLS 1.2 state carries no traffic secret"},
		{"unsupported suite", edit(func(s *HandoffState) { s.CipherSuite = tls.TLS_RSA_WITH_AES_128_CBC_SHA }), "not a supported TLS 1.3 cipher suite"},
		{"unknown version", edit(func(s *HandoffState) { s.Version = tls.VersionTLS11 }), "unsupported TLS version"},
		{"negative tokens", edit(func(s *HandoffState) { s.KeyUpdateTokens = -1 }), "KeyUpdate tokens -1"},
		{"NaN tokens", edit(func(s *HandoffState) { s.KeyUpdateTokens = math.NaN() }), "KeyUpdate tokens NaN"},
		{"record limit above the most", edit(func(s *HandoffState) { s.RecordLimit = MaxRecordLimit + 1 }), "record limit 16777217 above 16777216"},
		{"negative KeyUpdate rate", edit(func(s *HandoffState) { s.KeyUpdateLimit.PerSecond = -1 }), "KeyUpdate rate -1 per second"},
		{"negative burst", edit(func(s *HandoffState) { s.KeyUpdateLimit.Burst = -1 }), "burst -1"},
		{"empty certificate", edit(func(s *HandoffState) { s.PeerCertificates = [][]byte{{}} }), "peer certificate 0 is empty"},
		{"certificates past the end", func() []byte {
			s := testState()
			s.PeerCertificates = nil
			b := s.encode()
			return append(b[:len(b)-1], 0xff, 0xff, 0x03) // 65535 certificates in 2 bytes
		}(), "peer certificates: the state ends"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := DecodeHandoffState(tc.in)
			if err == nil || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("DecodeHandoffState(%x) = %v; want an error saying %q", tc.in, err, tc.says)
			}
			if st.Version != 0 || st.TX.Secret != nil {
				t.Fatalf("a refused decode returned a state: %+v", st)
			}
			if strings.HasPrefix(tc.name, "next version") {
				var ve *HandoffVersionError
				if !errors.As(err, &ve) || ve.Got != HandoffVersion+1 {
					t.Fatalf("%v: want a *HandoffVersionError for version %d", err, HandoffVersion+1)
				}
			}
		})
	}
	// Encode refuses what Decode would.
	bad := testState()
	bad.RX.Secret = bad.RX.Secret[:5]
	if _, err := bad.Encode(); err == nil {
		t.Fatal("Encode took a 5-byte secret")
	}
}

// FuzzHandoffState: no input makes DecodeHandoffState panic, and a state
// it accepts encodes to exactly its input: one encoding per state.
func FuzzHandoffState(f *testing.F) {
	for _, s := range []HandoffState{testState(), {Version: tls.VersionTLS12, CipherSuite: tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
		TX: HandoffDirection{Mode: ModeSW}, RX: HandoffDirection{Mode: ModeSW}}} {
		b, err := s.Encode()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := DecodeHandoffState(b)
		if err != nil {
			return
		}
		again, err := st.Encode()
		if err != nil {
			t.Fatalf("a decoded state does not encode: %v", err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("accepted %x, which encodes as %x", b, again)
		}
	})
}

// noFileConn is a syscall.Conn with no File method.
type noFileConn struct{}

func (noFileConn) SyscallConn() (syscall.RawConn, error) { return nil, errors.New("unused") }

// TestAdoptRefusesPlainSocket: Adopt checks the socket before anything
// else: a TCP socket without kernel TLS is refused with the reason, the
// descriptors Adopt duplicated are closed, and the socket carries bytes as
// before; the same for a received file and for a socket of this process
// as Handoff returns it. An invalid state is refused before the socket is
// looked at.
func TestAdoptRefusesPlainSocket(t *testing.T) {
	checkNoFDLeak(t, kerneltest.OpenFDs)
	peer, conn := loopbackPair(t)
	sock := conn.(*net.TCPConn)
	defer peer.Close()
	defer sock.Close()
	f, err := sock.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st := testState()
	st.PeerCertificates = nil
	for _, s := range []syscall.Conn{f, sock} {
		before := kerneltest.OpenFDs(t)
		c, err := Adopt(s, st, Options{})
		if c != nil || err == nil || !strings.Contains(err.Error(), `the socket has no kernel TLS (ULP "")`) {
			t.Fatalf("Adopt of a plain TCP socket (%T): %v, %v", s, c, err)
		}
		if after := kerneltest.OpenFDs(t); after != before {
			t.Fatalf("%T: %d descriptors before Adopt, %d after its refusal", s, before, after)
		}
	}
	if _, err := Adopt(noFileConn{}, st, Options{}); err == nil || !strings.Contains(err.Error(), "tcpfile: a ktls.noFileConn has no file") {
		t.Fatalf("Adopt of a descriptor holder that is neither a file nor a socket: %v", err)
	}
	bad := testState()
	bad.TX.Secret = nil
	if _, err := Adopt(f, bad, Options{}); err == nil || !strings.Contains(err.Error(), "tx: ktls: traffic secret") {
		t.Fatalf("Adopt of a state without a TX secret: %v", err)
	}
	bad = testState()
	bad.PeerCertificates = [][]byte{{1, 2, 3}}
	if _, err := Adopt(f, bad, Options{}); err == nil || !strings.Contains(err.Error(), "peer certificate 0") {
		t.Fatalf("Adopt of a state with a bad certificate: %v", err)
	}
	if _, err := sock.Write([]byte("still")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(peer, buf); err != nil || string(buf) != "still" {
		t.Fatalf("after the refusals the peer read %q, %v", buf, err)
	}
}
