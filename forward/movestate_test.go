package forward

import (
	"bytes"
	"crypto/tls"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// movedKTLSTunnel is a kernel TLS tunnel's state as it moves: a TLS 1.3
// session whose peer sent a two-certificate ECDSA chain, and a relay that
// spliced both ways.
func movedKTLSTunnel(t testing.TB) (MovedTunnel, ktls.HandoffState) {
	t.Helper()
	ca := testpki.NewCA(t, "gateways")
	leaf := ca.Client(t, "gateway-1")
	st := ktls.HandoffState{Version: tls.VersionTLS13, CipherSuite: tls.TLS_AES_128_GCM_SHA256,
		TX:              ktls.HandoffDirection{Secret: bytes.Repeat([]byte{1}, 32), Seq: 7, Bound: 9, Mode: ktls.ModeSW},
		RX:              ktls.HandoffDirection{Secret: bytes.Repeat([]byte{2}, 32), Seq: 3, Bound: 3, Mode: ktls.ModeSW},
		KeyUpdateTokens: 10, ServerName: "forwarder.example", NegotiatedProtocol: "sandbox",
		PeerCertificates: [][]byte{leaf.TLS.Certificate[0], ca.Cert.Raw}}
	conn, err := st.Encode()
	if err != nil {
		t.Fatal(err)
	}
	var relay splice.PauseState
	relay.Dirs[splice.AToB] = splice.PausedDirection{Bytes: 1234, SpliceBytes: 1234, Spliced: true}
	relay.Dirs[splice.BToA] = splice.PausedDirection{Bytes: 5678, SpliceBytes: 5000, CopyBytes: 678, ControlRecords: 1, Pending: 99}
	now := time.Now().UTC()
	return MovedTunnel{
		Tunnel: TunnelState{ID: 12345, Sandbox: "sbx-0123456789abcdef", Target: "10.1.2.3:8080", Peer: "192.0.2.7:51234",
			Certificate: "gateway-1", CertificateNames: []string{"gateway-1", "gw.example"}, KeyID: "gw-key-1", Key: bytes.Repeat([]byte{9}, 32),
			Opened: now.Add(-time.Hour), LastActivity: now, ToSandbox: 1234, FromSandbox: 5678},
		Conn: conn, Relay: relay,
	}, st
}

// TestMovedTunnelEncoding: a moved tunnel's state comes back field for
// field, the session's bytes a copy of their own; another version, a
// state cut anywhere or with more after it, and a relay Resume could not
// continue are refused with what is wrong, and nothing of the session is
// returned.
func TestMovedTunnelEncoding(t *testing.T) {
	mt, _ := movedKTLSTunnel(t)
	b, err := mt.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if b[0] != MovedTunnelVersion {
		t.Fatalf("encoding starts with %d, want the version %d", b[0], MovedTunnelVersion)
	}
	got, err := DecodeMovedTunnel(b)
	if err != nil {
		t.Fatal(err)
	}
	clear(b) // the receiver wipes the state it read
	if !got.Tunnel.Opened.Equal(mt.Tunnel.Opened) || !got.Tunnel.LastActivity.Equal(mt.Tunnel.LastActivity) {
		t.Fatalf("times %v, %v; want %v, %v", got.Tunnel.Opened, got.Tunnel.LastActivity, mt.Tunnel.Opened, mt.Tunnel.LastActivity)
	}
	if !reflect.DeepEqual(got, mt) {
		t.Fatalf("decoded %+v\nwant    %+v", got, mt)
	}
	if _, err := ktls.DecodeHandoffState(got.Conn); err != nil {
		t.Fatalf("the session's state: %v", err)
	}

	b, _ = mt.Encode()
	for i := range len(b) {
		if got, err := DecodeMovedTunnel(b[:i]); err == nil || got.Conn != nil {
			t.Fatalf("cut at %d of %d: %v, conn %d bytes; want a refusal", i, len(b), err, len(got.Conn))
		}
	}
	other := bytes.Clone(b)
	other[0] = MovedTunnelVersion + 1
	badRelay := mt
	badRelay.Relay.Dirs[splice.AToB].CopyBytes = 1 // 1234 bytes, 1234 spliced and 1 copied
	if _, err := badRelay.Encode(); err == nil {
		t.Fatal("Encode took a relay whose counts do not add up")
	}
	for _, tc := range []struct {
		name string
		in   []byte
		says string
	}{
		{"next version", other, "moved tunnel version 3, this build adopts 2"},
		{"version 1 (JSON)", []byte(`{"version":1}`), "moved tunnel version 123, this build adopts 2"},
		{"trailing", append(bytes.Clone(b), 0), "data after the last field"},
		{"relay of another version", func() []byte {
			c := bytes.Clone(b)
			c[len(c)-len(mustEncode(t, mt.Relay))] = splice.PauseVersion + 1
			return c
		}(), "pause state version 3"},
	} {
		if got, err := DecodeMovedTunnel(tc.in); err == nil || !strings.Contains(err.Error(), tc.says) || got.Conn != nil {
			t.Errorf("%s: %v; want an error saying %q", tc.name, err, tc.says)
		}
	}
}

func mustEncode(t *testing.T, s splice.PauseState) []byte {
	t.Helper()
	b, err := s.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestMovedStandbyEncoding: a moved standby connection's state comes back
// field for field; another version, a state cut anywhere or with more
// after it are refused.
func TestMovedStandbyEncoding(t *testing.T) {
	ms := MovedStandby{Forwarder: "fwd-digest", Peer: "192.0.2.7:40000", Binding: []byte("exporter binding"),
		Certificate: "gateway-1", CertificateNames: []string{"gateway-1"}, CertificateVerified: true,
		StandbyBegan: time.Date(2026, 12, 6, 1, 2, 3, 4, time.UTC), Conn: []byte{3, 1, 2, 3}}
	b := ms.Encode()
	got, err := DecodeMovedStandby(b)
	if err != nil || !reflect.DeepEqual(got, ms) {
		t.Fatalf("decoded %+v, %v\nwant    %+v", got, err, ms)
	}
	for i := range len(b) {
		if _, err := DecodeMovedStandby(b[:i]); err == nil {
			t.Fatalf("cut at %d of %d: decoded", i, len(b))
		}
	}
	if _, err := DecodeMovedStandby(append(bytes.Clone(b), 0)); err == nil || !strings.Contains(err.Error(), "data after the last field") {
		t.Fatalf("trailing byte: %v", err)
	}
	b[0] = MovedStandbyVersion + 1
	if _, err := DecodeMovedStandby(b); err == nil || !strings.Contains(err.Error(), "moved standby connection version 3, this build adopts 2") {
		t.Fatalf("next version: %v", err)
	}
}

// FuzzMovedTunnel: no input makes DecodeMovedTunnel panic, and a state it
// accepts encodes to exactly its input.
func FuzzMovedTunnel(f *testing.F) {
	mt, _ := movedKTLSTunnel(f)
	b, err := mt.Encode()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Add((&MovedStandby{Peer: "p"}).Encode())
	f.Fuzz(func(t *testing.T, b []byte) {
		if mt, err := DecodeMovedTunnel(b); err == nil {
			again, err := mt.Encode()
			if err != nil || !bytes.Equal(again, b) {
				t.Fatalf("accepted %x, which encodes as %x, %v", b, again, err)
			}
		}
		if ms, err := DecodeMovedStandby(b); err == nil {
			if again := ms.Encode(); !bytes.Equal(again, b) {
				t.Fatalf("accepted %x as a standby connection, which encodes as %x", b, again)
			}
		}
	})
}

// BenchmarkMovedTunnelState is what a kernel TLS tunnel's state costs on
// the move, without the sockets: encoding it in the old process (the
// session's state, then the tunnel's with the relay's) and decoding it in
// the new one (the tunnel's, then the session's).
func BenchmarkMovedTunnelState(b *testing.B) {
	mt, st := movedKTLSTunnel(b)
	enc, err := mt.Encode()
	if err != nil {
		b.Fatal(err)
	}
	b.Run("encode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			conn, err := st.Encode()
			if err != nil {
				b.Fatal(err)
			}
			m := mt
			m.Conn = conn
			if _, err := m.Encode(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(len(enc)), "B/state")
	})
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			m, err := DecodeMovedTunnel(enc)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := ktls.DecodeHandoffState(m.Conn); err != nil {
				b.Fatal(err)
			}
		}
	})
}
