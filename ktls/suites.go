package ktls

// The cipher suites the engine offloads, one row each: the key schedule
// (keys.go), the kernel's crypto_info (kernel.go), the userspace record
// opener (swrecord.go) and the probe (probe.go) read everything they need
// to know about a suite from its row.

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"fmt"
	"hash"

	"golang.org/x/crypto/chacha20poly1305"
)

// aeadNonceLen is the nonce length of every AEAD here (RFC 5116 section 5.1,
// RFC 8439).
const aeadNonceLen = 12

// cipherSuite is one TLS version/cipher suite pair the engine offloads.
type cipherSuite struct {
	version uint16 // tls.VersionTLS13 or tls.VersionTLS12
	id      uint16 // crypto/tls cipher suite ID
	// kernelCipher is the crypto_info cipher_type (TLS_CIPHER_* in
	// include/uapi/linux/tls.h).
	kernelCipher uint16
	keyLen       int // AEAD key length
	// ivLen is the length of the static IV the key schedule derives. It is
	// aeadNonceLen where the nonce is implicit (TLS 1.3; TLS 1.2
	// ChaCha20-Poly1305, RFC 7905): the sequence number is XORed into it.
	// A shorter ivLen is the implicit part of a TLS 1.2 nonce whose other
	// aeadNonceLen-ivLen bytes each record carries explicitly (AES-GCM,
	// RFC 5288: 4-byte salt, 8-byte nonce_explicit); it equals saltLen.
	ivLen int
	// saltLen is the size of the salt field of the kernel struct; 0 where
	// the struct has none (ChaCha20-Poly1305). Its iv field holds the other
	// aeadNonceLen-saltLen nonce bytes.
	saltLen int
	hash    func() hash.Hash // TLS 1.3 HKDF hash, or TLS 1.2 PRF hash
	aead    func(key []byte) (cipher.AEAD, error)
}

// cipherSuites has one row per version/suite pair the engine offloads. The
// TLS 1.2 rows are the AEAD suites with ECDHE key exchange: the only TLS 1.2
// suites crypto/tls enables by default that the kernel can take. The probe
// tries the first row of each version and kernel cipher (probeSuites), so
// the rows the probe should try come first.
var cipherSuites = []cipherSuite{
	// version, id, kernelCipher, keyLen, ivLen, saltLen, hash, aead
	{tls.VersionTLS13, tls.TLS_AES_128_GCM_SHA256, kernelAESGCM128, 16, 12, 4, sha256.New, aesGCM},
	{tls.VersionTLS13, tls.TLS_AES_256_GCM_SHA384, kernelAESGCM256, 32, 12, 4, sha512.New384, aesGCM},
	{tls.VersionTLS13, tls.TLS_CHACHA20_POLY1305_SHA256, kernelChaCha20P130, 32, 12, 0, sha256.New, chacha20poly1305.New},
	{tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, kernelAESGCM128, 16, 4, 4, sha256.New, aesGCM},
	{tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384, kernelAESGCM256, 32, 4, 4, sha512.New384, aesGCM},
	{tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256, kernelChaCha20P130, 32, 12, 0, sha256.New, chacha20poly1305.New},
	{tls.VersionTLS12, tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, kernelAESGCM128, 16, 4, 4, sha256.New, aesGCM},
	{tls.VersionTLS12, tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, kernelAESGCM256, 32, 4, 4, sha512.New384, aesGCM},
	{tls.VersionTLS12, tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256, kernelChaCha20P130, 32, 12, 0, sha256.New, chacha20poly1305.New},
}

// suiteFor returns the row of suite id negotiated in version.
func suiteFor(version, id uint16) (*cipherSuite, error) {
	knownVersion := false
	for i := range cipherSuites {
		cs := &cipherSuites[i]
		if cs.version != version {
			continue
		}
		if cs.id == id {
			return cs, nil
		}
		knownVersion = true
	}
	if !knownVersion {
		return nil, fmt.Errorf("ktls: unsupported TLS version %#04x", version)
	}
	return nil, fmt.Errorf("ktls: %s (%#04x) is not a supported %s cipher suite", tls.CipherSuiteName(id), id, tls.VersionName(version))
}

// explicitNonce reports whether each record carries part of the nonce
// (TLS 1.2 AES-GCM): the static IV is then only the salt.
func (cs *cipherSuite) explicitNonce() bool {
	return cs.ivLen < aeadNonceLen
}

// aesGCM is the AES-GCM AEAD; the key length picks AES-128 or AES-256.
func aesGCM(key []byte) (cipher.AEAD, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(block)
}
