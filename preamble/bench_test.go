package preamble

import (
	"crypto/ed25519"
	"testing"
	"time"
)

// BenchmarkVerify measures the forwarder's happy path: a bound frame with a
// fresh nonce, parsed, signature-checked, policy-checked and recorded in the
// replay cache. Frames are signed before the timer starts.
func BenchmarkVerify(b *testing.B) {
	now := time.Unix(1_800_000_000, 0)
	k := ed25519.NewKeyFromSeed(exampleSeed)
	s, err := NewSigner("gw", k)
	if err != nil {
		b.Fatal(err)
	}
	s.Now = func() time.Time { return now }
	binding := exampleBinding
	frames := make([][]byte, b.N)
	for i := range frames {
		c := sampleClaims()
		c.Binding = binding
		if frames[i], err = s.Sign(c); err != nil {
			b.Fatal(err)
		}
	}
	v := mustVerifier(b, VerifierConfig{
		Keys:            map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)},
		RequireBinding:  true,
		ReplayCacheSize: b.N + 1,
		Now:             func() time.Time { return now },
	})
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if _, err := v.Verify(frames[i], binding); err != nil {
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
// one bare ed25519.Verify over a message of the same size.
func BenchmarkEd25519Verify(b *testing.B) {
	frame := readGolden(b, "valid-ipv6-bound")
	msg := append([]byte(SignatureContext), frame[:len(frame)-SignatureLen]...)
	sig := frame[len(frame)-SignatureLen:]
	b.ReportAllocs()
	for b.Loop() {
		if !ed25519.Verify(examplePub, msg, sig) {
			b.Fatal("example signature does not verify")
		}
	}
}
