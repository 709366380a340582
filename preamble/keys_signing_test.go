package preamble

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"strings"
	"testing"
)

// A signing key keeps its key ID in a "Key-Id:" line before the PEM block;
// a file without one (openssl genpkey, an older keygen) still loads, with
// no ID; a keyring given as a private key, and a private key given as a
// keyring, are errors that say so.
func TestSigningKeyFile(t *testing.T) {
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	data, err := MarshalSigningKey("gw-1", key)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(data, []byte("Key-Id: gw-1\n-----BEGIN PRIVATE KEY-----\n")) {
		t.Fatalf("MarshalSigningKey wrote\n%s", data)
	}
	got, id, err := ParseSigningKey(data)
	if err != nil || id != "gw-1" || !got.Equal(key) {
		t.Fatalf("ParseSigningKey: id %q, err %v", id, err)
	}
	if k, err := ParsePrivateKey(data); err != nil || !k.Equal(key) {
		t.Fatalf("ParsePrivateKey of a file with a key ID: %v", err)
	}
	old, _ := MarshalPrivateKey(key)
	if _, id, err := ParseSigningKey(old); err != nil || id != "" {
		t.Fatalf("old file: id %q, err %v", id, err)
	}
	if _, err := MarshalSigningKey("bad id", key); err == nil {
		t.Error("MarshalSigningKey took a bad key ID")
	}
	if _, _, err := ParseSigningKey(append([]byte("Key-Id: gw-2\n"), data...)); err == nil || !strings.Contains(err.Error(), "more than one key ID") {
		t.Errorf("two key IDs: %v", err)
	}

	ring, _ := MarshalPublicKey("gw-1", pub)
	if _, err := ParsePrivateKey(ring); err == nil || !strings.Contains(err.Error(), "this is a keyring or public key (PEM PUBLIC KEY), not a private key") {
		t.Errorf("keyring as a private key: %v", err)
	}
	if _, err := ParseKeyring(data); err == nil || !strings.Contains(err.Error(), "this is a private key (PEM PRIVATE KEY), not a keyring") {
		t.Errorf("private key as a keyring: %v", err)
	}
	if _, err := ParseKeyring([]byte("nothing")); err == nil || !strings.Contains(err.Error(), "holds no PEM PUBLIC KEY block") {
		t.Errorf("empty keyring: %v", err)
	}
}
