package preamble

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// testClock is a settable clock for verifiers and signers.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func newKey(t testing.TB) ed25519.PrivateKey {
	t.Helper()
	_, k, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func mustSigner(t testing.TB, id string, k ed25519.PrivateKey, clock *testClock) *Signer {
	t.Helper()
	s, err := NewSigner(id, k)
	if err != nil {
		t.Fatal(err)
	}
	if clock != nil {
		s.Now = clock.Now
	}
	return s
}

func mustVerifier(t testing.TB, cfg VerifierConfig) *Verifier {
	t.Helper()
	v, err := NewVerifier(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func sampleClaims() Claims {
	return Claims{SandboxID: "sbx-1", Target: netip.MustParseAddrPort("10.0.0.7:8080")}
}

func wantReason(t *testing.T, err error, want Reason) {
	t.Helper()
	if got := ReasonOf(err); got != string(want) {
		t.Fatalf("reason %q, want %q (err: %v)", got, want, err)
	}
	if err != nil && !strings.Contains(err.Error(), string(want)) {
		t.Fatalf("error text %q does not name the reason %q", err, want)
	}
}

func TestRoundTripClaims(t *testing.T) {
	clock := &testClock{now: time.Unix(1_800_000_000, 0)}
	k := newKey(t)
	s := mustSigner(t, "gw-1", k, clock)
	v := mustVerifier(t, VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw-1": k.Public().(ed25519.PublicKey)}, Now: clock.Now})
	in := sampleClaims()
	in.Target = netip.MustParseAddrPort("[2001:db8::5]:65535")
	in.Binding = bytes.Repeat([]byte{7}, BindingLen)
	frame, err := s.Sign(in)
	if err != nil {
		t.Fatal(err)
	}
	c, err := v.Verify(frame, in.Binding)
	if err != nil {
		t.Fatal(err)
	}
	if c.KeyID != "gw-1" || c.SandboxID != in.SandboxID || c.Target != in.Target || !bytes.Equal(c.Binding, in.Binding) {
		t.Fatalf("claims %+v", c)
	}
	if !c.IssuedAt.Equal(clock.Now()) || c.ExpiresAt.Sub(c.IssuedAt) != DefaultTTL || c.Nonce == ([NonceLen]byte{}) {
		t.Fatalf("defaults not applied: iat %v exp %v nonce %x", c.IssuedAt, c.ExpiresAt, c.Nonce)
	}
}

func TestReplayedNonce(t *testing.T) {
	v := goldenVerifier(t, false)
	frame := readGolden(t, "valid-ipv4")
	if _, err := v.Verify(frame, nil); err != nil {
		t.Fatal(err)
	}
	_, err := v.Verify(frame, nil)
	wantReason(t, err, ReasonReplayedNonce)
}

// TestReplayedNonceAnyExpiry: a nonce once accepted is refused for
// MaxTTL + 2*MaxSkew, whatever validity window the frame that brings it
// again signs (docs/preamble.md §6 step 9), and may be forgotten after
// that window plus one bucket.
func TestReplayedNonceAnyExpiry(t *testing.T) {
	const skew, maxTTL = 30, 120 // the golden configuration
	clock := &testClock{now: exampleNow}
	v := mustVerifier(t, VerifierConfig{
		Keys:    map[string]ed25519.PublicKey{exampleKeyID: examplePub},
		MaxSkew: skew * time.Second, MaxTTL: maxTTL * time.Second, Now: clock.Now,
	})
	s := mustSigner(t, exampleKeyID, exampleKey, nil)
	sign := func(iat, exp int64) []byte {
		t.Helper()
		c := sampleClaims()
		c.Nonce = [NonceLen]byte(exampleNonce)
		c.IssuedAt, c.ExpiresAt = time.Unix(iat, 0), time.Unix(exp, 0)
		f, err := s.Sign(c)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	iat := int64(exampleIssued)
	if _, err := v.Verify(sign(iat, iat+30), nil); err != nil {
		t.Fatal(err)
	}
	accepted := clock.Now().Unix()
	// The cases seen live: the same nonce with expires_at 1 s and 60 s
	// later than the accepted frame's.
	for _, later := range []int64{1, 60} {
		_, err := v.Verify(sign(iat, iat+30+later), nil)
		if ReasonOf(err) != string(ReasonReplayedNonce) {
			t.Errorf("expires_at %+d s: %v, want replayed-nonce", later, err)
		}
	}
	// Every frame with this nonce that passes the time checks now: each
	// validity window from 1 s to max_ttl, expires_at +1 s and +60 s among
	// them, and other issue times.
	for _, i := range []int64{iat - skew, iat, iat + skew} {
		for exp := i + 1; exp <= i+maxTTL; exp++ {
			if exp < accepted-skew {
				continue
			}
			_, err := v.Verify(sign(i, exp), nil)
			if ReasonOf(err) != string(ReasonReplayedNonce) {
				t.Fatalf("issued %+d s, expiring %+d s: %v, want replayed-nonce", i-iat, exp-(iat+30), err)
			}
		}
	}
	// Up to the end of the window, fresh frames reusing the nonce are still
	// refused: a frame valid at acceptance could not be valid any more, but
	// the rule does not depend on what the new frame claims.
	for _, after := range []int64{1, 60, skew + maxTTL, maxTTL + 2*skew} {
		clock.now = time.Unix(accepted+after, 0)
		now := clock.now.Unix()
		_, err := v.Verify(sign(now, now+30), nil)
		if ReasonOf(err) != string(ReasonReplayedNonce) {
			t.Fatalf("%d s after acceptance: %v, want replayed-nonce", after, err)
		}
	}
	// Past the window and one bucket (180/14 + 1 = 13 s), it is forgotten.
	clock.now = time.Unix(accepted+replayHold(maxTTL+2*skew), 0)
	now := clock.now.Unix()
	if _, err := v.Verify(sign(now, now+30), nil); err != nil {
		t.Fatalf("%d s after acceptance the nonce is still refused: %v", replayHold(maxTTL+2*skew), err)
	}
	if _, err := v.Verify(sign(now, now+31), nil); ReasonOf(err) != string(ReasonReplayedNonce) {
		t.Fatalf("the nonce accepted again is not refused: %v", err)
	}
}

// TestChannelBindingTLS13Only: Go's crypto/tls, as the forwarder runs it,
// negotiates the extended master secret on TLS 1.2 (its exporter works,
// which Go allows only with EMS), and ChannelBinding still refuses the
// session: version 1 binds TLS 1.3 sessions only, by choice, as
// docs/preamble.md §4 says.
func TestChannelBindingTLS13Only(t *testing.T) {
	_, sc, cc := mtlsConfigs(t, tls.VersionTLS12)
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	server, client := tls.Server(a, sc), tls.Client(b, cc)
	done := make(chan error, 1)
	go func() { done <- server.Handshake() }()
	if err := client.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for side, cs := range map[string]tls.ConnectionState{"forwarder": server.ConnectionState(), "gateway": client.ConnectionState()} {
		if cs.Version != tls.VersionTLS12 {
			t.Fatalf("%s: version %#x, want TLS 1.2", side, cs.Version)
		}
		if _, err := cs.ExportKeyingMaterial(ChannelBindingLabel, nil, BindingLen); err != nil {
			t.Fatalf("%s: TLS 1.2 exporter refused (no extended master secret?): %v", side, err)
		}
		if b, ok := ChannelBinding(cs); ok || b != nil {
			t.Fatalf("%s: ChannelBinding of a TLS 1.2 session = %x, %v; want none", side, b, ok)
		}
	}
	sec4 := specSection(t, 4)
	if strings.Contains(sec4, "does not offer") || !strings.Contains(sec4, "negotiates the extended master secret") {
		t.Errorf("docs/preamble.md §4 must say that the forwarder negotiates the extended master secret on TLS 1.2 and binds TLS 1.3 only by choice")
	}
}

// TestReplayCacheBounded fills the cache to capacity, checks that it fails
// closed, and that expired buckets are reclaimed so that a long stream of
// nonces never holds more than capacity entries.
func TestReplayCacheBounded(t *testing.T) {
	const capacity = 64
	clock := &testClock{now: time.Unix(1_800_000_000, 0)}
	k := newKey(t)
	s := mustSigner(t, "gw", k, clock)
	v := mustVerifier(t, VerifierConfig{
		Keys:    map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)},
		MaxSkew: 5 * time.Second, MaxTTL: 10 * time.Second, ReplayCacheSize: capacity, Now: clock.Now,
	})
	sign := func() []byte {
		c := sampleClaims()
		c.ExpiresAt = clock.Now().Add(10 * time.Second)
		f, err := s.Sign(c)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	for i := range capacity {
		if _, err := v.Verify(sign(), nil); err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
	}
	_, err := v.Verify(sign(), nil)
	wantReason(t, err, ReasonReplayCacheFull)
	clock.Advance(22 * time.Second) // the burst is past the window (10 + 2*5 s) and its 2-second bucket

	accepted := 0
	for i := range 5000 {
		if i%2 == 0 {
			clock.Advance(time.Second)
		}
		_, err := v.Verify(sign(), nil)
		switch ReasonOf(err) {
		case "":
			accepted++
		case string(ReasonReplayCacheFull):
		default:
			t.Fatalf("frame %d: %v", i, err)
		}
		if n := v.replay.Len(); n > capacity {
			t.Fatalf("replay cache holds %d nonces, capacity %d", n, capacity)
		}
	}
	// 2 frames a second, each held for the window (MaxTTL + 2*MaxSkew =
	// 20 s) after its acceptance plus at most its 2-second bucket, needs at
	// most 2*22 = 44 < 64 slots: every frame must pass.
	if accepted != 5000 {
		t.Fatalf("%d of 5000 frames accepted after expiry reclaim, want all", accepted)
	}
}

// TestVerifyAllocs: in steady state the happy path of Verify, on a frame
// already read into its buffer, allocates nothing, replay-cache insert
// included. The stream runs at the peak rate its cache is sized for; the
// warm-up batch takes each of the 16 buckets (80 frames each) to its working
// size, and the measured batch goes round all of them again, so expired
// buckets are recycled inside the measurement. The count is exact: with one
// run AllocsPerRun returns the mallocs of the one measured call, and that
// call is the whole batch.
func TestVerifyAllocs(t *testing.T) {
	const rate, batch = 40, 1400
	st := newSteadyStream(t, 5*time.Second, 10*time.Second, 10*time.Second, rate, 2*batch)
	failed := 0
	allocs := testing.AllocsPerRun(1, func() { // called twice: a warm-up batch, then the measured one
		for range batch {
			if st.verifyNext() != nil {
				failed++
			}
		}
	})
	if failed != 0 {
		t.Fatalf("%d of %d steady-state frames rejected", failed, 2*batch)
	}
	if capacity := st.v.replay.capacity; st.v.replay.Len() > capacity || st.next <= capacity {
		t.Fatalf("cache holds %d nonces after %d frames, capacity %d: the stream did not recycle buckets", st.v.replay.Len(), st.next, capacity)
	}
	if allocs != 0 {
		t.Fatalf("the measured %d verifications made %v allocations, want 0", batch, allocs)
	}
}

// TestSharedReplayCache: a frame accepted under one configuration is a
// replay under the next one when both share the cache.
func TestSharedReplayCache(t *testing.T) {
	rc, err := NewReplayCache(16, 3*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]ed25519.PublicKey{exampleKeyID: examplePub}
	now := func() time.Time { return exampleNow }
	before := mustVerifier(t, VerifierConfig{Keys: keys, ReplayCache: rc, Now: now})
	after := mustVerifier(t, VerifierConfig{Keys: keys, ReplayCache: rc, Now: now, RequireBinding: true})
	frame := readGolden(t, "valid-ipv6-bound")
	if _, err := before.Verify(frame, exampleBinding); err != nil {
		t.Fatal(err)
	}
	_, err = after.Verify(frame, exampleBinding)
	wantReason(t, err, ReasonReplayedNonce)
	if rc.Len() != 1 {
		t.Fatalf("shared cache holds %d nonces, want 1", rc.Len())
	}
	if _, err := NewVerifier(VerifierConfig{Keys: keys, ReplayCache: rc, MaxTTL: 10 * time.Minute}); err == nil {
		t.Fatal("a cache window shorter than MaxTTL + 2*MaxSkew was accepted")
	}
	if _, err := NewVerifier(VerifierConfig{Keys: keys, ReplayCache: rc, ReplayCacheSize: 5}); err == nil {
		t.Fatal("ReplayCache and ReplayCacheSize together were accepted")
	}
	for _, bad := range []struct {
		size   int
		window time.Duration
	}{{0, time.Minute}, {-1, time.Minute}, {10, time.Millisecond}} {
		if _, err := NewReplayCache(bad.size, bad.window); err == nil {
			t.Errorf("NewReplayCache(%d, %v) accepted", bad.size, bad.window)
		}
	}
}

func TestKeyRotation(t *testing.T) {
	clock := &testClock{now: time.Unix(1_800_000_000, 0)}
	oldKey, newKeyPriv := newKey(t), newKey(t)
	oldSigner, newSigner := mustSigner(t, "k-2026-01", oldKey, clock), mustSigner(t, "k-2026-02", newKeyPriv, clock)
	both := mustVerifier(t, VerifierConfig{Now: clock.Now, Keys: map[string]ed25519.PublicKey{
		"k-2026-01": oldKey.Public().(ed25519.PublicKey), "k-2026-02": newKeyPriv.Public().(ed25519.PublicKey),
	}})
	onlyNew := mustVerifier(t, VerifierConfig{Now: clock.Now, Keys: map[string]ed25519.PublicKey{
		"k-2026-02": newKeyPriv.Public().(ed25519.PublicKey),
	}})
	for _, s := range []*Signer{oldSigner, newSigner} {
		f, err := s.Sign(sampleClaims())
		if err != nil {
			t.Fatal(err)
		}
		c, err := both.Verify(f, nil)
		if err != nil || c.KeyID != s.KeyID() {
			t.Fatalf("%s: claims %+v err %v", s.KeyID(), c, err)
		}
	}
	f, err := oldSigner.Sign(sampleClaims())
	if err != nil {
		t.Fatal(err)
	}
	_, err = onlyNew.Verify(f, nil)
	wantReason(t, err, ReasonUnknownKey)
	// A frame signed by the new key but labelled with the old ID fails the signature.
	impostor := mustSigner(t, "k-2026-01", newKeyPriv, clock)
	f, err = impostor.Sign(sampleClaims())
	if err != nil {
		t.Fatal(err)
	}
	_, err = both.Verify(f, nil)
	wantReason(t, err, ReasonBadSignature)
}

func TestNonCriticalExtensionReturned(t *testing.T) {
	c, err := goldenVerifier(t, false).Verify(readGolden(t, "valid-noncritical-extension"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Extensions) != 2 || c.Extensions[0].Type != 1 || string(c.Extensions[0].Value) != "hello" || c.Extensions[1].Critical() {
		t.Fatalf("extensions %+v", c.Extensions)
	}
}

// TestBindingUnavailable: a bound frame arriving on a connection without a
// channel binding (TLS 1.2) is rejected.
func TestBindingUnavailable(t *testing.T) {
	_, err := goldenVerifier(t, false).Verify(readGolden(t, "valid-ipv6-bound"), nil)
	wantReason(t, err, ReasonBindingMismatch)
}

// TestReadFrameStopsAtFrame: the tenant bytes after the frame stay unread.
func TestReadFrameStopsAtFrame(t *testing.T) {
	frame := readGolden(t, "valid-ipv4")
	tenant := []byte("GET / HTTP/1.1\r\n\r\n")
	r := bytes.NewReader(append(append([]byte(nil), frame...), tenant...))
	got, err := ReadFrame(r, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, frame) {
		t.Fatalf("frame %x, want %x", got, frame)
	}
	rest, _ := io.ReadAll(r)
	if !bytes.Equal(rest, tenant) {
		t.Fatalf("left %q after the frame, want %q", rest, tenant)
	}
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("connection reset") }

func TestReadFrameErrors(t *testing.T) {
	frame := readGolden(t, "valid-ipv4")
	t.Run("truncated-header", func(t *testing.T) {
		_, err := ReadFrame(bytes.NewReader(frame[:5]), 0)
		wantReason(t, err, ReasonTruncated)
	})
	t.Run("truncated-body", func(t *testing.T) {
		_, err := ReadFrame(bytes.NewReader(frame[:len(frame)-1]), 0)
		wantReason(t, err, ReasonTruncated)
	})
	t.Run("empty", func(t *testing.T) {
		_, err := ReadFrame(bytes.NewReader(nil), 0)
		wantReason(t, err, ReasonTruncated)
	})
	t.Run("cap-lower-than-frame", func(t *testing.T) {
		r := bytes.NewReader(frame)
		_, err := ReadFrame(r, len(frame)-1)
		wantReason(t, err, ReasonOversized)
		if r.Len() != len(frame)-HeaderLen {
			t.Fatalf("read %d bytes, want only the %d-byte header", len(frame)-r.Len(), HeaderLen)
		}
	})
	t.Run("read-failed", func(t *testing.T) {
		_, err := ReadFrame(failingReader{}, 0)
		wantReason(t, err, ReasonReadFailed)
	})
	t.Run("timeout", func(t *testing.T) {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		go b.Write(frame[:20])
		a.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := ReadFrame(a, 0)
		wantReason(t, err, ReasonTimeout)
	})
}

func TestVerifierCapLowerThanFrame(t *testing.T) {
	frame := readGolden(t, "valid-ipv4")
	v := mustVerifier(t, VerifierConfig{
		Keys: map[string]ed25519.PublicKey{exampleKeyID: examplePub}, MaxFrameLen: len(frame) - 1,
		Now: func() time.Time { return exampleNow },
	})
	_, err := v.Verify(frame, nil)
	wantReason(t, err, ReasonOversized)
}

func TestSignRefusesBadClaims(t *testing.T) {
	s := mustSigner(t, "gw", newKey(t), nil)
	cases := map[string]struct {
		edit func(*Claims)
		want Reason
	}{
		"empty-sandbox":   {func(c *Claims) { c.SandboxID = "" }, ReasonBadSandboxID},
		"long-sandbox":    {func(c *Claims) { c.SandboxID = strings.Repeat("a", MaxSandboxIDLen+1) }, ReasonBadSandboxID},
		"space-sandbox":   {func(c *Claims) { c.SandboxID = "a b" }, ReasonBadSandboxID},
		"mapped-v4":       {func(c *Claims) { c.Target = netip.MustParseAddrPort("[::ffff:10.0.0.1]:80") }, ReasonBadTarget},
		"compatible-v4":   {func(c *Claims) { c.Target = netip.MustParseAddrPort("[::10.0.0.1]:80") }, ReasonBadTarget},
		"zone":            {func(c *Claims) { c.Target = netip.MustParseAddrPort("[fe80::1%eth0]:80") }, ReasonBadTarget},
		"unspecified":     {func(c *Claims) { c.Target = netip.MustParseAddrPort("0.0.0.0:80") }, ReasonBadTarget},
		"multicast":       {func(c *Claims) { c.Target = netip.MustParseAddrPort("[ff02::1]:80") }, ReasonBadTarget},
		"port-0":          {func(c *Claims) { c.Target = netip.MustParseAddrPort("10.0.0.1:0") }, ReasonBadTarget},
		"no-target":       {func(c *Claims) { c.Target = netip.AddrPort{} }, ReasonBadTarget},
		"short-binding":   {func(c *Claims) { c.Binding = []byte{1, 2, 3} }, ReasonMalformed},
		"inverted-window": {func(c *Claims) { c.IssuedAt = time.Unix(100, 0); c.ExpiresAt = time.Unix(99, 0) }, ReasonMalformed},
		"ext-order":       {func(c *Claims) { c.Extensions = []Extension{{Type: 2}, {Type: 2}} }, ReasonBadExtension},
		"too-big":         {func(c *Claims) { c.Extensions = []Extension{{Type: 1, Value: make([]byte, 1000)}} }, ReasonOversized},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			c := sampleClaims()
			tc.edit(&c)
			_, err := s.Sign(c)
			wantReason(t, err, tc.want)
		})
	}
	if _, err := NewSigner("bad id", newKey(t)); ReasonOf(err) != string(ReasonBadKeyID) {
		t.Fatalf("NewSigner with a bad key ID: %v", err)
	}
	if _, err := NewSigner("gw", ed25519.PrivateKey{1, 2}); err == nil {
		t.Fatal("NewSigner accepted a 2-byte key")
	}
}

// TestTargetEncodings: an IPv4 target has one encoding, family 4. Its
// IPv4-mapped (::ffff:a.b.c.d) and IPv4-compatible (::a.b.c.d, all of ::/96
// but :: and ::1) forms in family 6 are bad-target, judged by the package
// and the spec-only decoder alike, and so is an address of the NAT64
// local-use prefix 64:ff9b:1::/48 whose u octet (bits 64-71) is not zero;
// other IPv6 unicast addresses, loopback, NAT64, SIIT and 6to4 ones
// included, are valid frames (what they may reach is the forwarder's
// target policy).
func TestTargetEncodings(t *testing.T) {
	keys := map[string]ed25519.PublicKey{exampleKeyID: examplePub}
	for _, tc := range []struct {
		addr string
		want Reason
	}{
		{"::ffff:10.1.2.3", ReasonBadTarget},
		{"::ffff:169.254.169.254", ReasonBadTarget},
		{"::10.1.2.3", ReasonBadTarget},
		{"::169.254.169.254", ReasonBadTarget},
		{"::127.0.0.1", ReasonBadTarget},
		{"::0.0.0.2", ReasonBadTarget},
		{"::ffff", ReasonBadTarget}, // ::0.0.255.255
		{"::255.255.255.255", ReasonBadTarget},
		{"::", ReasonBadTarget},
		{"::1", ""},
		{"::1:0:0", ""},    // ::/96's neighbour ::1:0:0/96: not IPv4-compatible
		{"::fffe:0:1", ""}, // nor is ::fffe:0:0/96
		{"64:ff9b::a9fe:a9fe", ""},
		{"64:ff9b:1::a01:203", ""},
		{"64:ff9b:1:a9fe:a9:fe00:a01:203", ""}, // a well-formed /48 reading: the policy judges it
		// 64:ff9b:1::/48 with the u octet (bits 64-71) not zero: no
		// RFC 6052 address, whatever the translator's prefix length.
		{"64:ff9b:1:0:100::", ReasonBadTarget},
		{"64:ff9b:1:0:ff00::a01:203", ReasonBadTarget},
		{"64:ff9b:1:a9fe:a9fe:a9fe:a9fe:a9fe", ReasonBadTarget},
		{"64:ff9b:1:0:ff::a01:203", ""},   // byte 9 is not the u octet
		{"64:ff9b:2:0:ff00::a01:203", ""}, // outside 64:ff9b:1::/48
		{"64:ff9b::ff00:0:a01:203", ""},   // 64:ff9b::/32 outside both NAT64 prefixes
		{"::ffff:0:a9fe:a9fe", ""},        // SIIT IPv4-translated: the policy judges it
		{"2002:a9fe:a9fe::1", ""},         // 6to4: the policy judges it
		{"10.1.2.3", ""},
	} {
		f := exampleFrame()
		f.target(tc.addr)
		frame := buildFrame(f)
		_, err := goldenVerifier(t, false).Verify(frame, exampleBinding)
		_, spec := specVerdict(frame, keys, exampleNow.Unix(), 30, 120, exampleBinding, false)
		if ReasonOf(err) != string(tc.want) || spec != string(tc.want) {
			t.Errorf("target %s: package says %q, spec decoder %q, want %q (err: %v)", tc.addr, ReasonOf(err), spec, tc.want, err)
		}
	}
}

func TestNewVerifierRejectsBadConfig(t *testing.T) {
	pub := examplePub
	for name, cfg := range map[string]VerifierConfig{
		"no-keys":       {},
		"bad-key-id":    {Keys: map[string]ed25519.PublicKey{"a b": pub}},
		"short-key":     {Keys: map[string]ed25519.PublicKey{"a": pub[:31]}},
		"cap-too-big":   {Keys: map[string]ed25519.PublicKey{"a": pub}, MaxFrameLen: MaxFrameLen + 1},
		"cap-too-small": {Keys: map[string]ed25519.PublicKey{"a": pub}, MaxFrameLen: 100},
		"negative-skew": {Keys: map[string]ed25519.PublicKey{"a": pub}, MaxSkew: -time.Second},
		"tiny-ttl":      {Keys: map[string]ed25519.PublicKey{"a": pub}, MaxTTL: time.Millisecond},
		"negative-size": {Keys: map[string]ed25519.PublicKey{"a": pub}, ReplayCacheSize: -1},
	} {
		if _, err := NewVerifier(cfg); err == nil {
			t.Errorf("%s: NewVerifier accepted %+v", name, cfg)
		}
	}
}

func TestReasonsListed(t *testing.T) {
	seen := map[Reason]bool{}
	for _, r := range Reasons() {
		if seen[r] || r == "" || r == "other" {
			t.Fatalf("reason %q duplicated or reserved", r)
		}
		seen[r] = true
	}
	for _, gc := range goldenCases {
		if gc.reason != "" && !seen[gc.reason] {
			t.Fatalf("golden reason %q missing from Reasons()", gc.reason)
		}
	}
	if ReasonOf(nil) != "" || ReasonOf(errors.New("x")) != "other" {
		t.Fatal("ReasonOf of nil or a foreign error")
	}
}

// specSection returns the text of section n of docs/preamble.md, from its
// "## n." heading to the next heading of that level.
func specSection(t *testing.T, n int) string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join("..", "docs", "preamble.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), fmt.Sprintf("\n## %d. ", n))
	if !ok {
		t.Fatalf("docs/preamble.md has no section %d", n)
	}
	section, _, _ := strings.Cut(rest, "\n## ")
	return section
}

// TestReasonsMatchSpec ties Reasons() to the reason table of
// docs/preamble.md §7 (same set, each once), requires §6, the order of
// checks, to place every reason, and §7 to document ReasonOther outside the
// table, so that code and spec cannot drift apart.
func TestReasonsMatchSpec(t *testing.T) {
	code := map[string]bool{}
	for _, r := range Reasons() {
		code[string(r)] = true
	}
	table := map[string]bool{}
	for _, line := range strings.Split(specSection(t, 7), "\n") {
		cell, ok := strings.CutPrefix(line, "| `")
		if !ok {
			continue
		}
		r, _, ok := strings.Cut(cell, "` |")
		if !ok || table[r] {
			t.Fatalf("§7 row %q: want one row per reason, \"| `reason` | meaning |\"", line)
		}
		table[r] = true
		if !code[r] {
			t.Errorf("§7 lists %q, which Reasons() lacks", r)
		}
	}
	// ReasonOther is a metrics label, not a Reason: §7 documents it outside
	// the table (a row would fail the check above).
	if !strings.Contains(specSection(t, 7), "`"+ReasonOther+"`") {
		t.Errorf("§7 does not document the label %q that ReasonOf gives an error that is no rejection", ReasonOther)
	}
	order := specSection(t, 6)
	for r := range code {
		if !table[r] {
			t.Errorf("Reasons() has %q, which the §7 table lacks", r)
		}
		if !strings.Contains(order, "`"+r+"`") {
			t.Errorf("§6 (order of checks) does not place %q", r)
		}
	}
}

func TestKeyFiles(t *testing.T) {
	k := newKey(t)
	pub := k.Public().(ed25519.PublicKey)
	privPEM, err := MarshalPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParsePrivateKey(privPEM)
	if err != nil || !back.Equal(k) {
		t.Fatalf("private key round trip: %v", err)
	}
	a, err := MarshalPublicKey("gw-a", pub)
	if err != nil {
		t.Fatal(err)
	}
	other := newKey(t).Public().(ed25519.PublicKey)
	b, err := MarshalPublicKey(KeyIDFor(other), other)
	if err != nil {
		t.Fatal(err)
	}
	ring, err := ParseKeyring(append(a, b...))
	if err != nil {
		t.Fatal(err)
	}
	if len(ring) != 2 || !ring["gw-a"].Equal(pub) || !ring[KeyIDFor(other)].Equal(other) {
		t.Fatalf("keyring %v", ring)
	}
	if _, err := ParseKeyring(append(a, a...)); err == nil {
		t.Fatal("duplicate key IDs accepted")
	}
	if _, err := ParseKeyring([]byte("nothing")); err == nil {
		t.Fatal("empty keyring accepted")
	}
	if !strings.HasPrefix(KeyIDFor(pub), "ed25519-") || len(KeyIDFor(pub)) != len("ed25519-")+16 {
		t.Fatalf("derived key ID %q", KeyIDFor(pub))
	}
}

// forwarder is an in-test mTLS server that does what the real forwarder
// does: read the frame exactly, verify it against the session's channel
// binding, then echo the tenant bytes until the client half-closes.
type forwarder struct {
	ln      net.Listener
	v       *Verifier
	results chan error
	claims  chan Claims
	wg      sync.WaitGroup
}

func startForwarder(t *testing.T, ca *testpki.CA, serverCfg *tls.Config, v *Verifier) *forwarder {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", serverCfg)
	if err != nil {
		t.Fatal(err)
	}
	f := &forwarder{ln: ln, v: v, results: make(chan error, 8), claims: make(chan Claims, 8)}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f.wg.Add(1)
			go func() {
				defer f.wg.Done()
				f.results <- f.serve(c.(*tls.Conn))
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); f.wg.Wait() })
	return f
}

func (f *forwarder) serve(c *tls.Conn) error {
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if err := c.Handshake(); err != nil {
		return err
	}
	frame, err := ReadFrame(c, f.v.MaxFrameLen())
	if err != nil {
		return err
	}
	binding, _ := ChannelBinding(c.ConnectionState())
	claims, err := f.v.Verify(frame, binding)
	if err != nil {
		return err
	}
	f.claims <- claims
	c.SetReadDeadline(time.Time{})
	if _, err := io.Copy(c, c); err != nil {
		return err
	}
	return c.CloseWrite()
}

func mtlsConfigs(t *testing.T, maxVersion uint16) (*testpki.CA, *tls.Config, *tls.Config) {
	ca := testpki.NewCA(t, "preamble-test-ca")
	server, client := ca.Server(t), ca.Client(t, "gateway")
	sc := &tls.Config{Certificates: []tls.Certificate{server.TLS}, ClientCAs: ca.Pool, ClientAuth: tls.RequireAndVerifyClientCert, MaxVersion: maxVersion}
	cc := &tls.Config{Certificates: []tls.Certificate{client.TLS}, RootCAs: ca.Pool, ServerName: "localhost"}
	return ca, sc, cc
}

// dialSend is a gateway in crypto/tls for these tests: it dials addr and
// writes the preamble with Send. (gateway.Dialer is the gateway's dialer.)
func dialSend(ctx context.Context, addr string, cfg *tls.Config, signer *Signer, claims Claims) (*tls.Conn, error) {
	nc, err := (&tls.Dialer{Config: cfg}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	conn := nc.(*tls.Conn)
	if err := Send(ctx, conn, signer, claims); err != nil {
		conn.Close()
		return nil, err
	}
	return conn, nil
}

// TestSendEcho: Send binds the frame to the TLS 1.3 session, the forwarder
// verifies it with binding required, and 1 MiB of tenant bytes comes back
// intact through the half-closed tunnel. The same frame replayed on another
// connection is rejected for its binding.
func TestSendEcho(t *testing.T) {
	fdsBefore := kerneltest.OpenFDs(t)
	ca, sc, cc := mtlsConfigs(t, 0)
	k := newKey(t)
	v := mustVerifier(t, VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)}, RequireBinding: true})
	f := startForwarder(t, ca, sc, v)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	conn, err := dialSend(ctx, f.ln.Addr().String(), cc, mustSigner(t, "gw", k, nil), sampleClaims())
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("tenant-bytes-0123456789"), 1<<20/23)
	go func() {
		conn.Write(payload)
		conn.CloseWrite()
	}()
	echoed, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if sha256.Sum256(echoed) != sha256.Sum256(payload) || len(echoed) != len(payload) {
		t.Fatalf("echoed %d bytes, want %d with the same SHA-256", len(echoed), len(payload))
	}
	if err := <-f.results; err != nil {
		t.Fatalf("forwarder: %v", err)
	}
	if c := <-f.claims; c.SandboxID != "sbx-1" || len(c.Binding) != BindingLen {
		t.Fatalf("forwarder saw claims %+v", c)
	}

	// Capture a bound frame from one session and replay it on another.
	var captured []byte
	captureCfg := cc.Clone()
	raw, err := tls.Dial("tcp", f.ln.Addr().String(), captureCfg)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := ChannelBinding(raw.ConnectionState())
	c := sampleClaims()
	c.Binding = b
	captured, err = mustSigner(t, "gw", k, nil).Sign(c)
	if err != nil {
		t.Fatal(err)
	}
	raw.Close()
	<-f.results // the forwarder sees the first session end without a frame
	replay, err := tls.Dial("tcp", f.ln.Addr().String(), cc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := replay.Write(captured); err != nil {
		t.Fatal(err)
	}
	wantReason(t, <-f.results, ReasonBindingMismatch)
	replay.Close()

	f.ln.Close()
	f.wg.Wait()
	if after := kerneltest.OpenFDs(t); after > fdsBefore {
		t.Fatalf("%d fds open after the test, %d before", after, fdsBefore)
	}
}

// TestSendOwnConnection: a gateway that makes its own TLS connection (here
// over a TCP connection it dialed itself) writes a bound preamble with Send,
// which the forwarder accepts with binding required; a canceled context
// writes nothing and says why.
func TestSendOwnConnection(t *testing.T) {
	ca, sc, cc := mtlsConfigs(t, 0)
	k := newKey(t)
	v := mustVerifier(t, VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)}, RequireBinding: true})
	f := startForwarder(t, ca, sc, v)
	signer := mustSigner(t, "gw", k, nil)
	dial := func() *tls.Conn {
		raw, err := net.Dial("tcp", f.ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		conn := tls.Client(raw, cc)
		if err := conn.Handshake(); err != nil {
			t.Fatal(err)
		}
		return conn
	}

	conn := dial()
	if err := Send(context.Background(), conn, signer, sampleClaims()); err != nil {
		t.Fatal(err)
	}
	if c := <-f.claims; c.SandboxID != "sbx-1" || len(c.Binding) != BindingLen {
		t.Fatalf("forwarder saw claims %+v", c)
	}
	conn.Close()
	if err := <-f.results; err != nil {
		t.Fatalf("forwarder: %v", err)
	}

	conn = dial()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Send(ctx, conn, signer, sampleClaims()); !errors.Is(err, context.Canceled) {
		t.Fatalf("Send with a canceled context: %v, want context.Canceled", err)
	}
	if err := Send(context.Background(), conn, nil, sampleClaims()); err == nil {
		t.Fatal("Send without a Signer succeeded")
	}
	conn.Close()
	<-f.results // the session ended without a frame
}

// TestSendTLS12Unbound: on TLS 1.2 Send sends an unbound frame, which a
// forwarder that requires binding rejects.
func TestSendTLS12Unbound(t *testing.T) {
	ca, sc, cc := mtlsConfigs(t, tls.VersionTLS12)
	k := newKey(t)
	v := mustVerifier(t, VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)}, RequireBinding: true})
	f := startForwarder(t, ca, sc, v)
	conn, err := dialSend(context.Background(), f.ln.Addr().String(), cc, mustSigner(t, "gw", k, nil), sampleClaims())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	wantReason(t, <-f.results, ReasonBindingRequired)
}

// TestConcurrentVerify shares one Verifier between goroutines, as the
// forwarder does: every fresh frame passes once and its replay fails.
func TestConcurrentVerify(t *testing.T) {
	k := newKey(t)
	v := mustVerifier(t, VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)}})
	s := mustSigner(t, "gw", k, nil)
	const workers, perWorker = 8, 50
	errs := make(chan error, workers)
	for range workers {
		go func() {
			for range perWorker {
				f, err := s.Sign(sampleClaims())
				if err == nil {
					_, err = v.Verify(f, nil)
				}
				if err == nil {
					if _, err = v.Verify(f, nil); ReasonOf(err) == string(ReasonReplayedNonce) {
						err = nil
					} else {
						err = errors.New("replay not detected: " + ReasonOf(err))
					}
				}
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := v.replay.Len(); n != workers*perWorker {
		t.Fatalf("replay cache holds %d nonces, want %d", n, workers*perWorker)
	}
}

// TestReplayWindow: the window is MaxTTL + 2*MaxSkew in whole seconds,
// defaults for zeros, at least 1s; a shared cache of exactly that window
// serves a verifier of those values, one a second shorter does not.
func TestReplayWindow(t *testing.T) {
	for _, tc := range []struct {
		ttl, skew, want time.Duration
	}{
		{0, 0, DefaultMaxTTL + 2*DefaultMaxSkew},
		{90 * time.Second, 1500 * time.Millisecond, 92 * time.Second},
		{1500 * time.Millisecond, 0, time.Second + 2*DefaultMaxSkew},
		{time.Second, time.Nanosecond, time.Second},
		{-time.Second, -time.Second, time.Second},
	} {
		if got := ReplayWindow(tc.ttl, tc.skew); got != tc.want {
			t.Errorf("ReplayWindow(%v, %v) = %v, want %v", tc.ttl, tc.skew, got, tc.want)
		}
	}
	keys := map[string]ed25519.PublicKey{exampleKeyID: examplePub}
	w := ReplayWindow(90*time.Second, 1500*time.Millisecond)
	for _, window := range []time.Duration{w, w - time.Second} {
		rc, err := NewReplayCache(16, window)
		if err != nil {
			t.Fatal(err)
		}
		_, err = NewVerifier(VerifierConfig{Keys: keys, ReplayCache: rc, MaxTTL: 90 * time.Second, MaxSkew: 1500 * time.Millisecond})
		if (err == nil) != (window == w) {
			t.Errorf("a shared cache of %v for a window of %v: NewVerifier error %v", window, w, err)
		}
	}
}
