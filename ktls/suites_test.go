package ktls

import (
	"bytes"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"encoding/binary"
	"hash"
	"slices"
	"strings"
	"testing"
)

// kernelCiphers are the facts of each kernel cipher_type that a row must
// agree with: the name fragment of the suites that use it, the key and salt
// field sizes and sizeof the crypto_info struct (include/uapi/linux/tls.h).
var kernelCiphers = map[uint16]struct {
	name            string
	keyLen, saltLen int
	structSize      int
}{
	kernelAESGCM128:    {"_AES_128_GCM_", 16, 4, 40},       // tls12_crypto_info_aes_gcm_128
	kernelAESGCM256:    {"_AES_256_GCM_", 32, 4, 56},       // tls12_crypto_info_aes_gcm_256
	kernelChaCha20P130: {"_CHACHA20_POLY1305_", 32, 0, 56}, // tls12_crypto_info_chacha20_poly1305
}

// hashBySuffix maps the hash suffix of a suite name to the hash.
var hashBySuffix = map[string]func() hash.Hash{
	"_SHA256": sha256.New,
	"_SHA384": sha512.New384,
}

// TestCipherSuiteTable walks the table: every row must be a suite crypto/tls
// knows for that version, unique, with a hash, key, IV and salt size, AEAD
// and crypto_info that agree with its name and its kernel cipher.
func TestCipherSuiteTable(t *testing.T) {
	known := make(map[uint16]*tls.CipherSuite)
	for _, s := range tls.CipherSuites() {
		known[s.ID] = s
	}
	type key struct{ version, id uint16 }
	seen := make(map[key]bool)
	for i := range cipherSuites {
		cs := &cipherSuites[i]
		name := tls.CipherSuiteName(cs.id)
		t.Run(tls.VersionName(cs.version)+"/"+name, func(t *testing.T) {
			if seen[key{cs.version, cs.id}] {
				t.Fatalf("row %d repeats version %#04x suite %#04x", i, cs.version, cs.id)
			}
			seen[key{cs.version, cs.id}] = true

			if strings.HasPrefix(name, "0x") {
				t.Fatalf("crypto/tls has no name for suite %#04x", cs.id)
			}
			if ts := known[cs.id]; ts == nil || !slices.Contains(ts.SupportedVersions, cs.version) {
				t.Errorf("not a suite tls.CipherSuites() lists for %s: %+v", tls.VersionName(cs.version), ts)
			}

			if got, err := suiteFor(cs.version, cs.id); got != cs || err != nil {
				t.Errorf("suiteFor = %p, %v; want row %d (%p)", got, err, i, cs)
			}

			var wantHash func() hash.Hash
			for suffix, h := range hashBySuffix {
				if strings.HasSuffix(name, suffix) {
					wantHash = h
				}
			}
			if wantHash == nil {
				t.Errorf("no known hash suffix in %s", name)
			} else if got, want := cs.hash().Sum([]byte(name)), wantHash().Sum([]byte(name)); !bytes.Equal(got, want) {
				t.Errorf("hash is not the one the name ends in")
			}

			k, ok := kernelCiphers[cs.kernelCipher]
			if !ok {
				t.Fatalf("kernel cipher %d is not in kernelCiphers", cs.kernelCipher)
			}
			if !strings.Contains(name, k.name) || cs.keyLen != k.keyLen || cs.saltLen != k.saltLen {
				t.Errorf("kernel cipher %d wants %s, key %d, salt %d; row has key %d, salt %d",
					cs.kernelCipher, k.name, k.keyLen, k.saltLen, cs.keyLen, cs.saltLen)
			}

			aead, err := cs.aead(make([]byte, cs.keyLen))
			if err != nil {
				t.Fatalf("AEAD with a %d-byte key: %v", cs.keyLen, err)
			}
			if aead.NonceSize() != aeadNonceLen {
				t.Errorf("AEAD nonce is %d bytes, want %d", aead.NonceSize(), aeadNonceLen)
			}
			if _, err := cs.aead(make([]byte, cs.keyLen-1)); err == nil {
				t.Errorf("AEAD accepted a %d-byte key", cs.keyLen-1)
			}

			// The static IV is the whole nonce, or (TLS 1.2 only) the salt
			// in front of an 8-byte explicit nonce.
			switch {
			case cs.ivLen == aeadNonceLen:
			case cs.version == tls.VersionTLS12 && cs.ivLen == cs.saltLen && aeadNonceLen-cs.saltLen == tls12ExplicitNonceLen:
			default:
				t.Errorf("iv %d bytes, salt %d: neither an implicit nonce nor salt plus explicit nonce", cs.ivLen, cs.saltLen)
			}

			keyBytes := bytes.Repeat([]byte{0xaa}, cs.keyLen)
			info, err := cryptoInfo(cs.version, cs.id, keyBytes, bytes.Repeat([]byte{0x55}, cs.ivLen), 1)
			if err != nil {
				t.Fatal(err)
			}
			if len(info) != k.structSize {
				t.Errorf("crypto_info is %d bytes, want sizeof %d", len(info), k.structSize)
			}
			if binary.NativeEndian.Uint16(info[0:2]) != cs.version || binary.NativeEndian.Uint16(info[2:4]) != cs.kernelCipher {
				t.Errorf("crypto_info header %x, want version %#04x cipher_type %d", info[:4], cs.version, cs.kernelCipher)
			}
			if off := 4 + aeadNonceLen - cs.saltLen; !bytes.Equal(info[off:off+cs.keyLen], keyBytes) {
				t.Errorf("key not at offset %d: %x", off, info)
			}
			if !bytes.Equal(info[len(info)-8:], []byte{0, 0, 0, 0, 0, 0, 0, 1}) {
				t.Errorf("rec_seq is not the last 8 bytes: %x", info)
			}
		})
	}
}

// TestProbeSuites: the probe tries one suite per version and kernel cipher,
// the TLS 1.2 RSA ones, in the order the probe tests expect.
func TestProbeSuites(t *testing.T) {
	var got []struct{ version, suite uint16 }
	for _, cs := range probeSuites() {
		got = append(got, struct{ version, suite uint16 }{cs.version, cs.id})
	}
	if !slices.Equal(got, wantProbeSuites) {
		t.Errorf("probeSuites() = %v, want %v", got, wantProbeSuites)
	}
}

func TestSuiteForRejects(t *testing.T) {
	for _, c := range []struct {
		version, id uint16
		want        string
	}{
		{tls.VersionTLS11, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, "ktls: unsupported TLS version 0x0302"},
		{tls.VersionTLS13, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, "ktls: TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 (0xc02f) is not a supported TLS 1.3 cipher suite"},
		{tls.VersionTLS12, tls.TLS_AES_128_GCM_SHA256, "ktls: TLS_AES_128_GCM_SHA256 (0x1301) is not a supported TLS 1.2 cipher suite"},
		{tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA, "ktls: TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA (0xc013) is not a supported TLS 1.2 cipher suite"},
	} {
		if cs, err := suiteFor(c.version, c.id); cs != nil || err == nil || err.Error() != c.want {
			t.Errorf("suiteFor(%#04x, %#04x) = %v, %v; want %q", c.version, c.id, cs, err, c.want)
		}
	}
}
