package preamble

import (
	"bytes"
	"crypto/ecdh"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"strings"
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

// MarshalSigningKey encodes key like MarshalPrivateKey, preceded by a line
// "Key-Id: <keyID>" that names it: the key ID its preambles carry, kept
// with the key so that signing needs no separate flag. The line is
// explanatory text outside the PEM block (RFC 7468 section 5.2), which
// openssl and every PEM reader skip, so the file stays a plain PKCS#8 key
// for them. ParseSigningKey reads both back.
func MarshalSigningKey(keyID string, key ed25519.PrivateKey) ([]byte, error) {
	if !validKeyID(keyID) {
		return nil, fmt.Errorf("preamble: key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", keyID, MaxKeyIDLen)
	}
	pemKey, err := MarshalPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return append([]byte(KeyIDHeader+": "+keyID+"\n"), pemKey...), nil
}

// ParsePrivateKey decodes the first PEM "PRIVATE KEY" block (PKCS#8) of data
// and requires it to hold an Ed25519 key. A keyring (PUBLIC KEY blocks
// only) is an error that says so.
func ParsePrivateKey(data []byte) (ed25519.PrivateKey, error) {
	key, _, err := ParseSigningKey(data)
	return key, err
}

// ParseSigningKey is ParsePrivateKey that also returns the key ID kept with
// the key: a "Key-Id:" line in the text before the PEM block (what
// MarshalSigningKey writes) or a Key-Id header inside it. keyID is "" when
// the file names none (a key from openssl genpkey, or from an older
// keygen); the caller then derives it with KeyIDFor or takes it from
// elsewhere.
func ParseSigningKey(data []byte) (key ed25519.PrivateKey, keyID string, err error) {
	var seen []string // the PEM block types before a PRIVATE KEY
	for {
		before := data
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return nil, "", noSigningKey(seen)
		}
		if block.Type != "PRIVATE KEY" {
			seen = append(seen, block.Type)
			continue
		}
		k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
		if err != nil {
			return nil, "", fmt.Errorf("preamble: private key: %w", err)
		}
		ek, ok := k.(ed25519.PrivateKey)
		if !ok {
			return nil, "", fmt.Errorf("preamble: this is %s private key (%T), not Ed25519: the preamble signing key is an Ed25519 key of its own; %s",
				keyAlgorithm(k), k, makeSigningKey)
		}
		// The text between the previous block (or the start) and this one.
		text := before
		if i := bytes.Index(before, []byte("-----BEGIN PRIVATE KEY-----")); i >= 0 {
			text = before[:i]
		}
		ids := make(map[string]bool)
		if id, ok := block.Headers[KeyIDHeader]; ok {
			ids[strings.TrimSpace(id)] = true
		}
		for _, line := range strings.Split(string(text), "\n") {
			if name, value, ok := strings.Cut(strings.TrimSpace(line), ":"); ok && strings.EqualFold(strings.TrimSpace(name), KeyIDHeader) {
				ids[strings.TrimSpace(value)] = true
			}
		}
		switch len(ids) {
		case 0:
		case 1:
			for id := range ids {
				keyID = id
			}
			if !validKeyID(keyID) {
				return nil, "", fmt.Errorf("preamble: private key file: key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", keyID, MaxKeyIDLen)
			}
		default:
			return nil, "", errors.New("preamble: private key file names more than one key ID")
		}
		return ek, keyID, nil
	}
}

// makeSigningKey says how to make a signing key, for the errors of a file
// that holds none.
const makeSigningKey = "make one with `caddy sandbox keygen --key-out <file>` (or `openssl genpkey -algorithm ed25519`)"

// noSigningKey is the error for a file without a PEM PRIVATE KEY block,
// whose blocks had the types seen: it says what the file is instead.
func noSigningKey(seen []string) error {
	for _, t := range seen {
		switch t {
		case "PUBLIC KEY":
			return errors.New("preamble: this is a keyring or public key (PEM PUBLIC KEY), not a private key: " +
				"give the private key file (the one caddy sandbox keygen --key-out wrote)")
		case "CERTIFICATE":
			return errors.New("preamble: this is an X.509 certificate (PEM CERTIFICATE), not a private key: the preamble signing key " +
				"is an Ed25519 key of its own, not the TLS certificate or its key; " + makeSigningKey)
		case "EC PRIVATE KEY", "RSA PRIVATE KEY", "OPENSSH PRIVATE KEY", "ENCRYPTED PRIVATE KEY":
			return fmt.Errorf("preamble: this is a PEM %s, not an Ed25519 PRIVATE KEY (PKCS#8): the preamble signing key is an Ed25519 key of its own; %s",
				t, makeSigningKey)
		}
	}
	if len(seen) > 0 {
		return fmt.Errorf("preamble: no PEM PRIVATE KEY block (the file holds %s): %s", strings.Join(seen, ", "), makeSigningKey)
	}
	return errors.New("preamble: no PEM PRIVATE KEY block: give the private key file caddy sandbox keygen --key-out wrote, or " + makeSigningKey)
}

// keyAlgorithm names the algorithm of a PKCS#8 private key other than
// Ed25519.
func keyAlgorithm(k any) string {
	switch k.(type) {
	case *ecdsa.PrivateKey:
		return "an ECDSA"
	case *rsa.PrivateKey:
		return "an RSA"
	case *ecdh.PrivateKey:
		return "an X25519 (ECDH)"
	}
	return "a non-Ed25519"
}

func validKeyID(id string) bool {
	return len(id) > 0 && len(id) <= MaxKeyIDLen && validID([]byte(id))
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
	sawPrivate := false
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			break
		}
		if block.Type == "PRIVATE KEY" {
			sawPrivate = true
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
	if len(keys) == 0 && sawPrivate {
		return nil, errors.New("preamble: this is a private key (PEM PRIVATE KEY), not a keyring: " +
			"give the public keys (what caddy sandbox keygen --pub-out writes), and keep the private key on the gateway")
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
