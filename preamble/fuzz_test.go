package preamble

import (
	"bytes"
	"crypto/ed25519"
	"testing"
	"time"
)

// FuzzParse feeds arbitrary bytes to ReadFrame and Verify. Properties: no
// panic; ReadFrame never consumes more than the frame it returns; the package
// and the spec-only decoder (specVerdict) agree on every verdict; and an
// accepted frame is the canonical encoding of its claims (re-signing them
// reproduces it byte for byte, Ed25519 being deterministic).
func FuzzParse(f *testing.F) {
	for _, gc := range goldenCases {
		f.Add(readGolden(f, gc.name), gc.requireBinding)
	}
	keys := map[string]ed25519.PublicKey{exampleKeyID: examplePub}
	signer, err := NewSigner(exampleKeyID, exampleKey)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte, requireBinding bool) {
		r := bytes.NewReader(data)
		frame, err := ReadFrame(r, 0)
		if err == nil {
			if consumed := len(data) - r.Len(); consumed != len(frame) || !bytes.Equal(frame, data[:consumed]) {
				t.Fatalf("ReadFrame consumed %d bytes, returned a %d-byte frame", consumed, len(frame))
			}
		}
		v, err := NewVerifier(VerifierConfig{
			Keys: keys, MaxSkew: 30 * time.Second, MaxTTL: 120 * time.Second,
			RequireBinding: requireBinding, ReplayCacheSize: 4,
			Now: func() time.Time { return exampleNow },
		})
		if err != nil {
			t.Fatal(err)
		}
		c, err := v.Verify(data, exampleBinding)
		_, specReason := specVerdict(data, keys, exampleNow.Unix(), 30, 120, exampleBinding, requireBinding)
		if ReasonOf(err) != specReason {
			t.Fatalf("package says %q (%v), spec decoder says %q", ReasonOf(err), err, specReason)
		}
		if err != nil {
			return
		}
		again, err := signer.Sign(c)
		if err != nil {
			t.Fatalf("accepted claims do not re-sign: %v", err)
		}
		if !bytes.Equal(again, data) {
			t.Fatalf("accepted frame is not canonical:\n got %x\nwant %x", again, data)
		}
	})
}
