package preamble

import (
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
)

// KeyIDHeader is the PEM header that names a public key in a keyring file.
const KeyIDHeader = "Key-Id"

// KeyIDFor derives the default key ID of a public key: "ed25519-" followed by
// the hex of the first 8 bytes of SHA-256 over the raw 32-byte key.
func KeyIDFor(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return "ed25519-" + hex.EncodeToString(sum[:8])
}

// MarshalPrivateKey encodes key as a PEM "PRIVATE KEY" block (PKCS#8), the
// form openssl genpkey -algorithm ed25519 writes.
func MarshalPrivateKey(key ed25519.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// ParsePrivateKey decodes the first PEM "PRIVATE KEY" block (PKCS#8) of data
// and requires it to hold an Ed25519 key.
func ParsePrivateKey(data []byte) (ed25519.PrivateKey, error) {
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return nil, errors.New("preamble: no PEM PRIVATE KEY block")
		}
		if block.Type != "PRIVATE KEY" {
			continue
		}
		k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("preamble: private key: %w", err)
		}
		ek, ok := k.(ed25519.PrivateKey)
		if !ok {
			return nil, fmt.Errorf("preamble: private key is %T, want Ed25519", k)
		}
		return ek, nil
	}
}

// MarshalPublicKey encodes pub as a PEM "PUBLIC KEY" block (SPKI) carrying
// keyID in a Key-Id header. Keyring files are concatenations of such blocks.
func MarshalPublicKey(keyID string, pub ed25519.PublicKey) ([]byte, error) {
	if len(keyID) == 0 || len(keyID) > MaxKeyIDLen || !validID([]byte(keyID)) {
		return nil, fmt.Errorf("preamble: key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", keyID, MaxKeyIDLen)
	}
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Headers: map[string]string{KeyIDHeader: keyID}, Bytes: der}), nil
}

// ParseKeyring decodes every PEM "PUBLIC KEY" block in data into a keyring
// for VerifierConfig.Keys. A block without a Key-Id header gets KeyIDFor its
// key. Non-Ed25519 keys, bad key IDs and duplicate IDs are errors.
func ParseKeyring(data []byte) (map[string]ed25519.PublicKey, error) {
	keys := make(map[string]ed25519.PublicKey)
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			break
		}
		if block.Type != "PUBLIC KEY" {
			continue
		}
		k, err := x509.ParsePKIXPublicKey(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("preamble: keyring: %w", err)
		}
		pub, ok := k.(ed25519.PublicKey)
		if !ok {
			return nil, fmt.Errorf("preamble: keyring: key is %T, want Ed25519", k)
		}
		id, ok := block.Headers[KeyIDHeader]
		if !ok {
			id = KeyIDFor(pub)
		}
		if len(id) == 0 || len(id) > MaxKeyIDLen || !validID([]byte(id)) {
			return nil, fmt.Errorf("preamble: keyring: key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", id, MaxKeyIDLen)
		}
		if _, dup := keys[id]; dup {
			return nil, fmt.Errorf("preamble: keyring: key ID %q appears twice", id)
		}
		keys[id] = pub
	}
	if len(keys) == 0 {
		return nil, errors.New("preamble: keyring holds no PEM PUBLIC KEY block")
	}
	return keys, nil
}

// ParsePublicKey accepts a PEM "PUBLIC KEY" block, or standard base64 of
// either the raw 32-byte key or its SPKI DER form (what `openssl pkey
// -pubout -outform DER` writes): one key, as a configuration gives it inline.
func ParsePublicKey(s string) (ed25519.PublicKey, error) {
	if ring, err := ParseKeyring([]byte(s)); err == nil && len(ring) == 1 {
		for _, k := range ring {
			return k, nil
		}
	}
	raw, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("public key is neither one PEM PUBLIC KEY block nor base64: %v", err)
	}
	if len(raw) == ed25519.PublicKeySize {
		return ed25519.PublicKey(raw), nil
	}
	k, err := x509.ParsePKIXPublicKey(raw)
	if err != nil {
		return nil, fmt.Errorf("public key is %d bytes: neither a raw Ed25519 key (%d) nor SPKI DER: %v", len(raw), ed25519.PublicKeySize, err)
	}
	pub, ok := k.(ed25519.PublicKey)
	if !ok {
		return nil, fmt.Errorf("public key is %T, want Ed25519", k)
	}
	return pub, nil
}
