package preamble

import (
	"crypto/ed25519"
	"fmt"
	"strings"
	"testing"
	"time"
)

// Sandbox IDs are case-insensitive: CanonicalSandboxID lowercases A-Z
// (and nothing else) and applies the canonical grammar, whose first byte
// is a letter or a digit, so no ID is "." or ".." or starts with a dot.
func TestCanonicalSandboxID(t *testing.T) {
	long := strings.Repeat("a", MaxSandboxIDLen)
	for in, want := range map[string]string{
		"sbx-1":               "sbx-1",
		"SBX-LIM2":            "sbx-lim2",
		"Sbx-R2":              "sbx-r2",
		"0.a_B-c":             "0.a_b-c",
		"a..":                 "a..",
		"a":                   "a",
		strings.ToUpper(long): long,
	} {
		got, err := CanonicalSandboxID(in)
		if err != nil || got != want {
			t.Errorf("CanonicalSandboxID(%q) = %q, %v; want %q", in, got, err, want)
		}
		if err := CheckSandboxID(want); err != nil {
			t.Errorf("CheckSandboxID(%q), canonical: %v", want, err)
		}
	}
	for in, detail := range map[string]string{
		"":                          "is 0 bytes",
		".":                         "the first a letter or a digit",
		"..":                        "the first a letter or a digit",
		".a":                        "the first a letter or a digit",
		"-a":                        "the first a letter or a digit",
		"_a":                        "the first a letter or a digit",
		".SBX":                      "the first a letter or a digit",
		"a/b":                       "want 1..128 bytes of [a-z0-9._-]",
		"a b":                       "want 1..128 bytes of [a-z0-9._-]",
		"\u212a":                    "want 1..128 bytes", // KELVIN SIGN: not "k"
		"sbx-\u0130":                "want 1..128 bytes", // LATIN CAPITAL I WITH DOT: not "i"
		long + "a":                  "is 129 bytes",
		strings.ToUpper(long) + "A": "is 129 bytes",
	} {
		got, err := CanonicalSandboxID(in)
		if err == nil || got != "" {
			t.Errorf("CanonicalSandboxID(%q) = %q, %v; want a bad-sandbox-id error", in, got, err)
			continue
		}
		wantReason(t, err, ReasonBadSandboxID)
		if !strings.Contains(err.Error(), detail) || !strings.Contains(err.Error(), fmt.Sprintf("sandbox ID %q", in)) {
			t.Errorf("CanonicalSandboxID(%q): %v; want it to name the ID as given and say %q", in, err, detail)
		}
		if ReasonOf(CheckSandboxID(in)) != string(ReasonBadSandboxID) {
			t.Errorf("CheckSandboxID(%q) accepted it", in)
		}
	}
	// CheckSandboxID takes only the canonical form, and says which it is.
	err := CheckSandboxID("SBX-R2")
	wantReason(t, err, ReasonBadSandboxID)
	if !strings.Contains(err.Error(), `has uppercase letters: sandbox IDs are case-insensitive and travel lowercase ("sbx-r2")`) {
		t.Errorf("CheckSandboxID(SBX-R2): %v; want it to name the lowercase form", err)
	}
}

// A frame carries the canonical sandbox ID only: the signer refuses to
// write another and the verifier refuses to read one, whoever signed it.
func TestSandboxIDCanonicalOnTheWire(t *testing.T) {
	k := newKey(t)
	s := mustSigner(t, "gw", k, nil)
	for _, id := range []string{"SBX-1", "Sbx-1", ".", "..", ".a", "-a"} {
		c := sampleClaims()
		c.SandboxID = id
		_, err := s.Sign(c)
		wantReason(t, err, ReasonBadSandboxID)
	}
	keys := map[string]ed25519.PublicKey{"gw": k.Public().(ed25519.PublicKey)}
	v := mustVerifier(t, VerifierConfig{Keys: keys, Now: func() time.Time { return exampleNow }})
	frame := func(id string) []byte {
		f := exampleFrame()
		f.keyID, f.signer, f.sandboxID = "gw", k, id
		return buildFrame(f)
	}
	for _, id := range []string{"SBX-1", "sbx-A", "..", ".a"} {
		_, err := v.Verify(frame(id), nil)
		wantReason(t, err, ReasonBadSandboxID)
		if _, spec := specVerdict(frame(id), keys, exampleNow.Unix(), 30, 120, nil, false); spec != string(ReasonBadSandboxID) {
			t.Errorf("the spec-only verifier says %q of sandbox ID %q, want bad-sandbox-id", spec, id)
		}
	}
	c, err := v.Verify(frame("sbx-1"), nil)
	if err != nil || c.SandboxID != "sbx-1" {
		t.Fatalf("the canonical frame: %+v, %v", c, err)
	}
}
