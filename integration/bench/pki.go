package main

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/ktlsingress/caddy-ktls/preamble"
)

// pki is the run's key material, as files for the contenders' configs: one
// self-signed ECDSA P-256 server certificate that every TLS contender
// presents (same certificate type, same signature cost) and the gateway
// trusts directly, the gateway's client certificate that it signed (the
// forwarder verifies it, as it must: mutual TLS), and the gateway's Ed25519
// preamble signing key; and the same client certificate, trust anchor and
// signing key as files, for the edge-gateway contenders, whose gateway is a
// Caddy that dials the forwarder itself.
// (internal/testpki needs a testing.TB, which a main package cannot make.)
type pki struct {
	certFile, keyFile, bundleFile string
	pool                          *x509.CertPool
	signer                        *preamble.Signer
	signingPub                    string // base64 raw Ed25519 public key, for the sandbox handler
	caDER                         string // base64 DER of the server certificate, the client certificate's CA
	client                        tls.Certificate
	// clientCertFile, clientKeyFile: client as PEM files; signingKeyFile:
	// the signer's key as `caddy sandbox keygen` writes it (Key-Id header).
	clientCertFile, clientKeyFile, signingKeyFile string
}

func newPKI(dir string) (*pki, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: "localhost"},
		DNSNames:              []string{"localhost"},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(7 * 24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		// ClientAuth too: it also issues the gateway's client certificate.
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	p := &pki{
		certFile:   filepath.Join(dir, "server.pem"),
		keyFile:    filepath.Join(dir, "server-key.pem"),
		bundleFile: filepath.Join(dir, "server-bundle.pem"), // HAProxy wants both in one file
		pool:       x509.NewCertPool(),
	}
	p.pool.AddCert(cert)
	for name, data := range map[string][]byte{p.certFile: certPEM, p.keyFile: keyPEM, p.bundleFile: append(certPEM, keyPEM...)} {
		if err := os.WriteFile(name, data, 0o600); err != nil {
			return nil, err
		}
	}
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	if p.signer, err = preamble.NewSigner("bench-gw", priv); err != nil {
		return nil, err
	}
	p.signingPub = base64.StdEncoding.EncodeToString(pub)
	p.caDER = base64.StdEncoding.EncodeToString(der)
	if p.client, err = clientCertificate(cert, key); err != nil {
		return nil, err
	}
	if err := p.writeGatewayFiles(dir, priv); err != nil {
		return nil, err
	}
	return p, nil
}

// clientCertificate makes the gateway's ECDSA P-256 client certificate,
// signed by ca.
func clientCertificate(ca *x509.Certificate, caKey *ecdsa.PrivateKey) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano() + 1),
		Subject:      pkix.Name{CommonName: "bench-gateway"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// writeGatewayFiles writes what a Caddy gateway reads: its client
// certificate and key, and its preamble signing key.
func (p *pki) writeGatewayFiles(dir string, signing ed25519.PrivateKey) error {
	keyDER, err := x509.MarshalPKCS8PrivateKey(p.client.PrivateKey)
	if err != nil {
		return err
	}
	signingPEM, err := preamble.MarshalSigningKey(p.signer.KeyID(), signing)
	if err != nil {
		return err
	}
	p.clientCertFile = filepath.Join(dir, "gateway.pem")
	p.clientKeyFile = filepath.Join(dir, "gateway-key.pem")
	p.signingKeyFile = filepath.Join(dir, "preamble.key")
	for name, data := range map[string][]byte{
		p.clientCertFile: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.client.Certificate[0]}),
		p.clientKeyFile:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
		p.signingKeyFile: signingPEM,
	} {
		if err := os.WriteFile(name, data, 0o600); err != nil {
			return err
		}
	}
	return nil
}
