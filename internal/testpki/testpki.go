// Package testpki makes throwaway certificate authorities and leaf
// certificates for tests: a server certificate for 127.0.0.1/localhost and
// client certificates for mutual TLS, as Go values and as PEM files.
package testpki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// CA is a certificate authority that signs leaves for one test run.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
	Pool *x509.CertPool
	PEM  []byte
}

// Leaf is a signed certificate with its key.
type Leaf struct {
	TLS     tls.Certificate
	CertPEM []byte
	KeyPEM  []byte
}

var serial atomic.Int64

func nextSerial() *big.Int { return big.NewInt(time.Now().UnixNano() + serial.Add(1)) }

// newTemplate makes an ECDSA P-256 key and a certificate template for cn,
// valid from an hour ago for a day.
func newTemplate(t testing.TB, cn string) (*ecdsa.PrivateKey, *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key, &x509.Certificate{
		SerialNumber: nextSerial(),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
	}
}

// NewCA makes a self-signed ECDSA P-256 CA.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key, tmpl := newTemplate(t, name)
	tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{Cert: cert, Key: key, Pool: pool, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// Server issues a server certificate for localhost, 127.0.0.1 and ::1 (plus
// any extra DNS names).
func (ca *CA) Server(t testing.TB, dnsNames ...string) *Leaf {
	t.Helper()
	return ca.issue(t, "server", append([]string{"localhost"}, dnsNames...), x509.ExtKeyUsageServerAuth)
}

// Client issues a client-authentication certificate with the given common name.
func (ca *CA) Client(t testing.TB, commonName string) *Leaf {
	t.Helper()
	return ca.issue(t, commonName, nil, x509.ExtKeyUsageClientAuth)
}

// Leaf issues a certificate with the given common name whose only extended
// key usage is usage: e.g. a serverAuth certificate a gateway must not be
// able to use as its client certificate.
func (ca *CA) Leaf(t testing.TB, commonName string, usage x509.ExtKeyUsage) *Leaf {
	t.Helper()
	return ca.issue(t, commonName, nil, usage)
}

func (ca *CA) issue(t testing.TB, cn string, dnsNames []string, usage x509.ExtKeyUsage) *Leaf {
	t.Helper()
	key, tmpl := newTemplate(t, cn)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{usage}
	tmpl.DNSNames = dnsNames
	if usage == x509.ExtKeyUsageServerAuth {
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return &Leaf{TLS: pair, CertPEM: certPEM, KeyPEM: keyPEM}
}

// WriteFiles writes the leaf as <dir>/<name>-cert.pem and <dir>/<name>-key.pem
// (".pem" names: caddytest rewrites "/x.crt" and "/x.key" paths) and returns
// both paths.
func (l *Leaf) WriteFiles(t testing.TB, dir, name string) (certFile, keyFile string) {
	t.Helper()
	certFile = filepath.Join(dir, name+"-cert.pem")
	keyFile = filepath.Join(dir, name+"-key.pem")
	if err := os.WriteFile(certFile, l.CertPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, l.KeyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

// WriteFile writes the CA certificate as <dir>/<name>.pem and returns the path.
func (ca *CA) WriteFile(t testing.TB, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name+".pem")
	if err := os.WriteFile(p, ca.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
