package preamble

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"strings"
	"testing"
	"time"
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

// A file that holds another kind of key, or a certificate, is an error
// that says what the file is and how to make a signing key.
func TestSigningKeyFileOfAnotherKind(t *testing.T) {
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	pkcs8EC, _ := x509.MarshalPKCS8PrivateKey(ec)
	sec1EC, _ := x509.MarshalECPrivateKey(ec)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "gateway"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	certDER, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, ec.Public(), ec)
	if err != nil {
		t.Fatal(err)
	}
	const keygen = "make one with `caddy sandbox keygen --key-out <file>` (or `openssl genpkey -algorithm ed25519`)"
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"ecdsa-pkcs8", pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pkcs8EC}),
			"preamble: this is an ECDSA private key (*ecdsa.PrivateKey), not Ed25519: the preamble signing key is an Ed25519 key of its own; " + keygen},
		{"ec-sec1", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: sec1EC}),
			"preamble: this is a PEM EC PRIVATE KEY, not an Ed25519 PRIVATE KEY (PKCS#8): the preamble signing key is an Ed25519 key of its own; " + keygen},
		{"certificate", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: certDER}),
			"preamble: this is an X.509 certificate (PEM CERTIFICATE), not a private key: the preamble signing key is an Ed25519 key of its own, not the TLS certificate or its key; " + keygen},
		{"no-pem", []byte("not a key"),
			"preamble: no PEM PRIVATE KEY block: give the private key file caddy sandbox keygen --key-out wrote, or " + keygen},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := ParseSigningKey(tc.data); err == nil || err.Error() != tc.want {
				t.Errorf("ParseSigningKey: %v\nwant %s", err, tc.want)
			}
		})
	}
}
