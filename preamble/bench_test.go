package preamble

import (
	"crypto/ed25519"
	"testing"
	"time"
)

// steadyStream is a gateway fleet's traffic as a forwarder sees it in steady
// state: bound frames with fresh nonces, signed before use and verified at
// the instant they were issued, with a clock that advances rate frames per
// second. The verifier's replay cache is sized by the rule of
// docs/preamble.md §6 for that rate (rate × (W + W/14 + 1 s), W = MaxTTL +
// 2 × MaxSkew: how long a nonce is held), so its acceptance-time buckets
// fill, expire and get recycled as in production instead of one bucket
// growing for ever.
type steadyStream struct {
	v      *Verifier
	frames [][]byte
	start  time.Time
	step   time.Duration // clock advance per frame
	next   int
}

func newSteadyStream(tb testing.TB, skew, maxTTL, ttl time.Duration, rate, n int) *steadyStream {
	tb.Helper()
	k := ed25519.NewKeyFromSeed(exampleSeed)
	st := &steadyStream{frames: make([][]byte, n), start: time.Unix(1_800_000_000, 0), step: time.Second / time.Duration(rate)}
	s := mustSigner(tb, "gw", k, nil)
	for i := range st.frames {
		c := sampleClaims()
		c.Binding = exampleBinding
		c.IssuedAt = st.start.Add(time.Duration(i) * st.step)
		c.ExpiresAt = c.IssuedAt.Add(ttl)
		var err error
		if st.frames[i], err = s.Sign(c); err != nil {
			tb.Fatal(err)
		}
	}
	st.v = mustVerifier(tb, VerifierConfig{
		Keys:            map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)},
		MaxSkew:         skew,
		MaxTTL:          maxTTL,
		ReplayCacheSize: rate * int(replayHold(int64((maxTTL+2*skew)/time.Second))),
		RequireBinding:  true,
		Now:             st.now,
	})
	return st
}

func (st *steadyStream) now() time.Time { return st.start.Add(time.Duration(st.next) * st.step) }

// verifyNext verifies the next frame at its issue time.
func (st *steadyStream) verifyNext() error {
	_, err := st.v.Verify(st.frames[st.next], exampleBinding)
	st.next++
	return err
}

// BenchmarkVerify measures the forwarder's happy path in steady state
// (steadyStream): parse, signature, policy and replay-cache insert of a bound
// frame already read into its buffer, under the default skew and TTLs. At 64
// frames a second each 13-second acceptance bucket takes 832 frames and the
// 16 buckets come round again every 13,312, so a run of 20,000 iterations
// recycles buckets; the cache holds 64 × 193 = 12,352 nonces at most. Frames
// are signed before the timer starts.
func BenchmarkVerify(b *testing.B) {
	st := newSteadyStream(b, DefaultMaxSkew, DefaultMaxTTL, DefaultTTL, 64, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if err := st.verifyNext(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParse isolates the structural checks (everything but Ed25519 and
// the replay cache).
func BenchmarkParse(b *testing.B) {
	frame := readGolden(b, "valid-ipv6-bound")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := parse(frame, MaxFrameLen); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSign measures the gateway side.
func BenchmarkSign(b *testing.B) {
	s, err := NewSigner("gw", ed25519.NewKeyFromSeed(exampleSeed))
	if err != nil {
		b.Fatal(err)
	}
	c := sampleClaims()
	c.Binding = exampleBinding
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Sign(c); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEd25519Verify is the floor BenchmarkVerify is measured against:
// one bare ed25519.Verify of a frame like BenchmarkVerify's, same size. The
// two run side by side (bench-host.sh pairs them round by round), so their
// difference is the package's own cost.
func BenchmarkEd25519Verify(b *testing.B) {
	frame := newSteadyStream(b, DefaultMaxSkew, DefaultMaxTTL, DefaultTTL, 64, 1).frames[0]
	msg := append([]byte(SignatureContext), frame[:len(frame)-SignatureLen]...)
	sig := frame[len(frame)-SignatureLen:]
	b.ReportAllocs()
	for b.Loop() {
		if !ed25519.Verify(examplePub, msg, sig) {
			b.Fatal("the frame's signature does not verify")
		}
	}
}
