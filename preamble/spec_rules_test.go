package preamble

import (
	"crypto/ed25519"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// TestTimeWholeSeconds: docs/preamble.md §6 step 7. now is the clock's Unix
// time rounded down, and a configured skew or max_ttl with a fraction of a
// second is rounded down too: 1.9 s of skew is 1 s, 500 ms is none (and
// not the default), a 1.9 s max_ttl is 1 s.
func TestTimeWholeSeconds(t *testing.T) {
	const base = 1_800_000_000
	k := newKey(t)
	s := mustSigner(t, "gw", k, nil)
	frame := func(iat, exp int64) []byte {
		c := sampleClaims()
		c.IssuedAt, c.ExpiresAt = time.Unix(iat, 0), time.Unix(exp, 0)
		f, err := s.Sign(c)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	verify := func(skew, ttl time.Duration, now time.Time, f []byte) Reason {
		v := mustVerifier(t, VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)},
			MaxSkew: skew, MaxTTL: ttl, Now: func() time.Time { return now }})
		_, err := v.Verify(f, nil)
		return Reason(ReasonOf(err))
	}
	at := func(sec int64, frac time.Duration) time.Time { return time.Unix(sec, 0).Add(frac) }
	for _, tc := range []struct {
		name      string
		skew, ttl time.Duration
		now       time.Time
		iat, exp  int64
		want      Reason
	}{
		// now rounds down: 0.999 s past base is base.
		{"expiring-now-late-in-the-second", 500 * time.Millisecond, time.Minute, at(base, 999*time.Millisecond), base - 30, base, ""},
		{"expired-a-second-ago", 500 * time.Millisecond, time.Minute, at(base, 0), base - 30, base - 1, ReasonExpired},
		{"issued-in-the-current-second", 500 * time.Millisecond, time.Minute, at(base, 0), base, base + 30, ""},
		{"issued-next-second-no-skew", 500 * time.Millisecond, time.Minute, at(base, 999*time.Millisecond), base + 1, base + 30, ReasonNotYetValid},
		// 1.9 s of skew is 1 s.
		{"skew-1.9s-allows-1s", 1900 * time.Millisecond, time.Minute, at(base, 0), base + 1, base + 30, ""},
		{"skew-1.9s-refuses-2s", 1900 * time.Millisecond, time.Minute, at(base, 0), base + 2, base + 30, ReasonNotYetValid},
		{"skew-1.9s-expired-2s-ago", 1900 * time.Millisecond, time.Minute, at(base, 0), base - 30, base - 2, ReasonExpired},
		// max_ttl 1.9 s is 1 s.
		{"ttl-1.9s-allows-1s", time.Second, 1900 * time.Millisecond, at(base, 0), base, base + 1, ""},
		{"ttl-1.9s-refuses-2s", time.Second, 1900 * time.Millisecond, at(base, 0), base, base + 2, ReasonTTLTooLong},
	} {
		if got := verify(tc.skew, tc.ttl, tc.now, frame(tc.iat, tc.exp)); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
	if _, err := NewVerifier(VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)}, MaxTTL: 999 * time.Millisecond}); err == nil {
		t.Error("a max_ttl under 1 s was accepted")
	}
	step7 := specSection(t, 6)
	for _, want := range []string{"rounded down", "`1.9s` is 1 s"} {
		if !strings.Contains(step7, want) {
			t.Errorf("docs/preamble.md §6 step 7 does not say %q", want)
		}
	}
}

// TestReplayCacheExact: docs/preamble.md §6, "Replay cache", to the second.
// With W = max_ttl + 2 × skew = 20 s the buckets are w = 20/14 + 1 = 2 s
// wide. A nonce accepted at second t is refused at every now <= t + W and
// forgotten at the first step 9 at or after (t/w + 1)·w + W: t + W + 1 for
// the last second of a bucket, t + W + 2 for the first. Nonces of a bucket
// not yet freed count against the size although they are past W, and a
// clock stepped back onto a bucket slot still in use fails closed.
func TestReplayCacheExact(t *testing.T) {
	const skew, ttl, W, w = 5, 10, 20, 2
	const base = 1_800_000_000 // even: the first second of a bucket
	if replayWidth(W) != w {
		t.Fatalf("bucket width %d, want %d", replayWidth(W), w)
	}
	k := newKey(t)
	pub := k.Public().(ed25519.PublicKey)
	clock := &testClock{now: time.Unix(base, 0)}
	newV := func(size int) *Verifier {
		return mustVerifier(t, VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw": pub},
			MaxSkew: skew * time.Second, MaxTTL: ttl * time.Second, ReplayCacheSize: size, Now: clock.Now})
	}
	s := mustSigner(t, "gw", k, nil)
	var nonce byte
	sign := func(n byte) []byte {
		c := sampleClaims()
		c.Nonce[0], c.Nonce[1] = 1, n
		now := clock.Now().Unix()
		c.IssuedAt, c.ExpiresAt = time.Unix(now, 0), time.Unix(now+ttl, 0)
		f, err := s.Sign(c)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	set := func(sec int64) { clock.now = time.Unix(sec, 0).Add(700 * time.Millisecond) }
	for _, tc := range []struct {
		t      int64 // acceptance second
		forget int64 // first second it is forgotten
	}{
		{base, base + W + 2},     // first second of its bucket: held W + w
		{base + 1, base + W + 2}, // last second: held W + 1
	} {
		v := newV(100)
		nonce++
		set(tc.t)
		if _, err := v.Verify(sign(nonce), nil); err != nil {
			t.Fatal(err)
		}
		for now := tc.t + 1; now < tc.forget; now++ {
			set(now)
			if _, err := v.Verify(sign(nonce), nil); ReasonOf(err) != string(ReasonReplayedNonce) {
				t.Fatalf("accepted at %+d: at %+d: %v, want replayed-nonce", tc.t-base, now-base, err)
			}
		}
		set(tc.forget)
		if _, err := v.Verify(sign(nonce), nil); err != nil {
			t.Fatalf("accepted at %+d: at %+d (forgotten): %v", tc.t-base, tc.forget-base, err)
		}
	}

	// Four nonces at base fill a cache of 4. At base + W + 1 all four were
	// accepted more than W ago, but their bucket is freed only at
	// base + W + 2: until then a new nonce finds no room.
	v := newV(4)
	set(base)
	for i := range 4 {
		if _, err := v.Verify(sign(byte(100+i)), nil); err != nil {
			t.Fatal(err)
		}
	}
	set(base + W + 1)
	if _, err := v.Verify(sign(200), nil); ReasonOf(err) != string(ReasonReplayCacheFull) {
		t.Fatalf("at +W+1 with a full bucket not yet freed: %v, want replay-cache-full", err)
	}
	if _, err := v.Verify(sign(100), nil); ReasonOf(err) != string(ReasonReplayedNonce) {
		t.Fatalf("a held nonce at +W+1: %v, want replayed-nonce (the lookup comes before the room check)", err)
	}
	set(base + W + 2)
	if _, err := v.Verify(sign(200), nil); err != nil {
		t.Fatalf("at +W+2, the bucket freed: %v", err)
	}

	// The clock steps back 16 buckets: the new nonce's bucket slot still
	// holds the later epoch, which is not freed: replay-cache-full.
	v = newV(100)
	set(base)
	if _, err := v.Verify(sign(210), nil); err != nil {
		t.Fatal(err)
	}
	set(base - 16*w)
	if _, err := v.Verify(sign(211), nil); ReasonOf(err) != string(ReasonReplayCacheFull) {
		t.Fatalf("clock stepped back onto a used slot: %v, want replay-cache-full", err)
	}
	set(base - 16*w + 1*w)
	if _, err := v.Verify(sign(211), nil); err != nil {
		t.Fatalf("clock stepped back onto a free slot: %v", err)
	}
}

// TestSpecWalkExample: docs/preamble.md §2.2's example of a length that
// fits and is read on is what the package and the spec-only decoder say:
// the worked example with key_id length 200 and a TLV 0x0001 of 280 bytes
// "x" is 427 bytes and bad-target.
func TestSpecWalkExample(t *testing.T) {
	f := exampleFrame()
	f.kidLen, f.extensions = 200, tlv(0x0001, strings.Repeat("x", 280))
	frame := buildFrame(f)
	_, err := goldenVerifier(t, false).Verify(frame, exampleBinding)
	_, spec := specVerdict(frame, map[string]ed25519.PublicKey{exampleKeyID: examplePub}, exampleNow.Unix(), 30, 120, exampleBinding, false)
	if len(frame) != 427 || ReasonOf(err) != string(ReasonBadTarget) || spec != string(ReasonBadTarget) {
		t.Fatalf("%d bytes, package %q, spec decoder %q; §2.2 says 427 bytes, bad-target", len(frame), ReasonOf(err), spec)
	}
	sec2 := specSection(t, 2)
	for _, want := range []string{"427 bytes in all", "(`0x78`)", "A length that does not run past the signature is believed"} {
		if !strings.Contains(sec2, want) {
			t.Errorf("docs/preamble.md §2.2 does not say %q", want)
		}
	}
	if strings.Contains(sec2, "a key_id length\nof 200 is `truncated`, not `bad-key-id`;") {
		t.Error("docs/preamble.md §2.2 still says a key_id length of 200 is always truncated")
	}
}

// TestAssignedExtensionsMandatory: docs/preamble.md §3 makes the value
// checks of the types version 1 assigns mandatory, and the package applies
// them wherever a frame or an extension is judged: Verify, Sign, and
// ClientIdentity's parser.
func TestAssignedExtensionsMandatory(t *testing.T) {
	sec3 := specSection(t, 3)
	if strings.Contains(sec3, "A verifier that knows an assigned type") || !strings.Contains(sec3, "**must**\ncheck their values") {
		t.Error("docs/preamble.md §3 does not make the checks of assigned types mandatory for version 1")
	}
	bad := Extension{Type: ExtClientIdentity, Value: append([]byte{4, 192, 0, 2, 7, 0xc3, 0x50}, "a\u202eb"...)}
	if _, err := mustSigner(t, exampleKeyID, exampleKey, nil).Sign(Claims{SandboxID: "s", Target: netip.MustParseAddrPort("10.0.0.1:1"), Extensions: []Extension{bad}}); ReasonOf(err) != string(ReasonBadExtension) {
		t.Errorf("Sign: %v, want bad-extension", err)
	}
	f := exampleFrame()
	f.extensions = append(tlv(ExtClientIdentity, string(bad.Value)), tlv(0x0011, "")...)
	if _, err := goldenVerifier(t, false).Verify(buildFrame(f), nil); ReasonOf(err) != string(ReasonBadExtension) {
		t.Errorf("Verify: %v, want bad-extension", err)
	}
}
