package caddyktls

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// readCert parses the one PEM certificate in file.
func readCert(t *testing.T, file string) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	block, rest := pem.Decode(data)
	if block == nil || block.Type != "CERTIFICATE" || len(strings.TrimSpace(string(rest))) != 0 {
		t.Fatalf("%s: want exactly one PEM CERTIFICATE block", file)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

// checkMode fails t unless file has exactly mode's permission bits.
func checkMode(t *testing.T, file string, mode os.FileMode) {
	t.Helper()
	info, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	if got := info.Mode().Perm(); got != mode {
		t.Errorf("%s has mode %o, want %o", file, got, mode)
	}
}

// TestSandboxCerts: "caddy sandbox certs" makes a CA, a forwarder's server
// certificate (serverAuth, the SANs given) and a gateway's client
// certificate (clientAuth, the CN given) that chain to it, for each key
// type; keys 0600, certificates 0644, each key the pair of its certificate;
// each certificate verifies for its own use only; the output names the
// files and the Caddyfile lines that use them.
func TestSandboxCerts(t *testing.T) {
	for _, keyType := range []string{"p256", "ed25519"} {
		t.Run(keyType, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pki") // made by the first command
			out, err := runSandbox(t, nil, "certs", "ca", "--dir", dir, "--key-type", keyType, "--cn", "test CA")
			if err != nil {
				t.Fatalf("certs ca: %v", err)
			}
			caFile, caKey := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
			for _, want := range []string{"wrote " + caFile, "wrote " + caKey, "trust_pool file " + caFile, "tls_trust_pool file " + caFile} {
				if !strings.Contains(out, want) {
					t.Errorf("certs ca printed %q, which lacks %q", out, want)
				}
			}
			checkMode(t, dir, 0o700)
			checkMode(t, caFile, 0o644)
			checkMode(t, caKey, 0o600)
			ca := readCert(t, caFile)
			if !ca.IsCA || ca.Subject.CommonName != "test CA" || ca.KeyUsage&x509.KeyUsageCertSign == 0 {
				t.Errorf("CA certificate: IsCA %v, CN %q, key usage %b", ca.IsCA, ca.Subject.CommonName, ca.KeyUsage)
			}
			if d := time.Until(ca.NotAfter); d < 3649*24*time.Hour || d > 3651*24*time.Hour {
				t.Errorf("CA valid for %v, want 3650 days", d)
			}

			out, err = runSandbox(t, nil, "certs", "forwarder", "--dir", dir, "--key-type", keyType,
				"--san", "forwarder.internal,10.0.0.5", "--san", "fd00::5", "--san", "fwd-2.internal")
			if err != nil {
				t.Fatalf("certs forwarder: %v", err)
			}
			fwdFile, fwdKey := filepath.Join(dir, "forwarder.pem"), filepath.Join(dir, "forwarder-key.pem")
			for _, want := range []string{"wrote " + fwdFile, "wrote " + fwdKey, "tls " + fwdFile + " " + fwdKey, "tls_server_name forwarder.internal"} {
				if !strings.Contains(out, want) {
					t.Errorf("certs forwarder printed %q, which lacks %q", out, want)
				}
			}
			out, err = runSandbox(t, nil, "certs", "gateway", "--dir", dir, "--key-type", keyType, "--cn", "gateway-1", "--name", "gateway-1")
			if err != nil {
				t.Fatalf("certs gateway: %v", err)
			}
			gwFile, gwKey := filepath.Join(dir, "gateway-1.pem"), filepath.Join(dir, "gateway-1-key.pem")
			for _, want := range []string{"wrote " + gwFile, "wrote " + gwKey, "tls_client_auth " + gwFile + " " + gwKey, "verifier leaf file " + gwFile, "trust_pool file " + caFile} {
				if !strings.Contains(out, want) {
					t.Errorf("certs gateway printed %q, which lacks %q", out, want)
				}
			}
			for _, f := range []string{fwdFile, gwFile} {
				checkMode(t, f, 0o644)
			}
			for _, f := range []string{fwdKey, gwKey} {
				checkMode(t, f, 0o600)
			}

			fwd, gw := readCert(t, fwdFile), readCert(t, gwFile)
			if !slices.Equal(fwd.DNSNames, []string{"forwarder.internal", "fwd-2.internal"}) {
				t.Errorf("forwarder DNS SANs %q", fwd.DNSNames)
			}
			if len(fwd.IPAddresses) != 2 || !fwd.IPAddresses[0].Equal(net.ParseIP("10.0.0.5")) || !fwd.IPAddresses[1].Equal(net.ParseIP("fd00::5")) {
				t.Errorf("forwarder IP SANs %v, want [10.0.0.5 fd00::5]", fwd.IPAddresses)
			}
			if !slices.Equal(fwd.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}) || fwd.IsCA {
				t.Errorf("forwarder certificate: EKU %v, IsCA %v; want serverAuth only", fwd.ExtKeyUsage, fwd.IsCA)
			}
			if !slices.Equal(gw.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}) || gw.IsCA || gw.Subject.CommonName != "gateway-1" {
				t.Errorf("gateway certificate: EKU %v, IsCA %v, CN %q; want clientAuth only, gateway-1", gw.ExtKeyUsage, gw.IsCA, gw.Subject.CommonName)
			}
			for _, c := range []*x509.Certificate{ca, fwd, gw} {
				var ok bool
				switch keyType {
				case "p256":
					_, ok = c.PublicKey.(*ecdsa.PublicKey)
				case "ed25519":
					_, ok = c.PublicKey.(ed25519.PublicKey)
				}
				if !ok {
					t.Errorf("%s has a %T key, want %s", c.Subject.CommonName, c.PublicKey, keyType)
				}
			}
			for _, pair := range [][2]string{{fwdFile, fwdKey}, {gwFile, gwKey}} {
				if _, err := tls.LoadX509KeyPair(pair[0], pair[1]); err != nil {
					t.Errorf("%s and %s are no key pair: %v", pair[0], pair[1], err)
				}
			}

			roots := x509.NewCertPool()
			roots.AddCert(ca)
			verify := func(c *x509.Certificate, name string, usage x509.ExtKeyUsage) error {
				_, err := c.Verify(x509.VerifyOptions{Roots: roots, DNSName: name, KeyUsages: []x509.ExtKeyUsage{usage}})
				return err
			}
			for _, name := range []string{"forwarder.internal", "fwd-2.internal", "10.0.0.5", "fd00::5"} {
				if err := verify(fwd, name, x509.ExtKeyUsageServerAuth); err != nil {
					t.Errorf("forwarder certificate for %s: %v", name, err)
				}
			}
			if verify(fwd, "other.internal", x509.ExtKeyUsageServerAuth) == nil {
				t.Error("the forwarder certificate verifies for a name it was not issued for")
			}
			if verify(fwd, "", x509.ExtKeyUsageClientAuth) == nil {
				t.Error("the forwarder certificate verifies as a client certificate")
			}
			if err := verify(gw, "", x509.ExtKeyUsageClientAuth); err != nil {
				t.Errorf("gateway certificate as a client: %v", err)
			}
			if verify(gw, "", x509.ExtKeyUsageServerAuth) == nil {
				t.Error("the gateway certificate verifies as a server certificate")
			}
		})
	}
}

// TestSandboxCertsReuseCA: a CA made earlier (another directory, a key in
// SEC 1 form as openssl writes it) issues more certificates through
// --ca-cert and --ca-key.
func TestSandboxCertsReuseCA(t *testing.T) {
	caDir, dir := t.TempDir(), t.TempDir()
	if _, err := runSandbox(t, nil, "certs", "ca", "--dir", caDir, "--name", "gateways-ca"); err != nil {
		t.Fatal(err)
	}
	// Rewrite the CA key as "EC PRIVATE KEY" (openssl's default form).
	keyFile := filepath.Join(caDir, "gateways-ca-key.pem")
	pair, err := tls.LoadX509KeyPair(filepath.Join(caDir, "gateways-ca.pem"), keyFile)
	if err != nil {
		t.Fatal(err)
	}
	sec1, err := x509.MarshalECPrivateKey(pair.PrivateKey.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: sec1}), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, cn := range []string{"gateway-1", "gateway-2"} {
		if _, err := runSandbox(t, nil, "certs", "gateway", "--dir", dir, "--name", cn, "--cn", cn,
			"--ca-cert", filepath.Join(caDir, "gateways-ca.pem"), "--ca-key", keyFile, "--days", "30"); err != nil {
			t.Fatalf("certs gateway --cn %s from the earlier CA: %v", cn, err)
		}
	}
	ca := readCert(t, filepath.Join(caDir, "gateways-ca.pem"))
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	for _, cn := range []string{"gateway-1", "gateway-2"} {
		c := readCert(t, filepath.Join(dir, cn+".pem"))
		if _, err := c.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
			t.Errorf("%s: %v", cn, err)
		}
		if d := c.NotAfter.Sub(c.NotBefore); d != 30*24*time.Hour+time.Hour {
			t.Errorf("%s valid for %v, want 30 days from an hour ago", cn, d)
		}
	}
}

// TestSandboxCertsRefusals: certs never overwrites a file (it names the
// file and writes nothing, not even the half of a pair that is missing),
// and refuses what would make an unusable certificate, saying what to do.
func TestSandboxCertsRefusals(t *testing.T) {
	dir := t.TempDir()
	if _, err := runSandbox(t, nil, "certs", "ca", "--dir", dir); err != nil {
		t.Fatal(err)
	}
	sum := func(f string) [32]byte {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		return sha256.Sum256(data)
	}
	caSum, caKeySum := sum(filepath.Join(dir, "ca.pem")), sum(filepath.Join(dir, "ca-key.pem"))

	// An existing certificate without its key: the key is not written either.
	existing := filepath.Join(dir, "forwarder.pem")
	if err := os.WriteFile(existing, []byte("an older certificate\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	oldSum := sum(existing)
	cases := []struct {
		args []string
		want []string // substrings of the error
	}{
		{[]string{"ca", "--dir", dir}, []string{filepath.Join(dir, "ca.pem") + " exists", "never overwrites", "--name"}},
		{[]string{"forwarder", "--dir", dir, "--san", "forwarder.internal"}, []string{existing + " exists", "wrote nothing"}},
		{[]string{"forwarder", "--dir", dir, "--name", "fwd-b"}, []string{"--san is required", "tls_server_name"}},
		{[]string{"gateway", "--dir", dir}, []string{"--cn is required", "key_clients"}},
		{[]string{"gateway", "--dir", dir, "--cn", "gw", "--san", "10.0.0.1"}, []string{"--san 10.0.0.1", "DNS names"}},
		{[]string{"gateway", "--dir", dir, "--cn", "gw", "--days", "4000"}, []string{"--days 4000 would outlive the CA", "make a new CA"}},
		{[]string{"gateway", "--dir", dir, "--cn", "gw", "--key-type", "rsa"}, []string{`--key-type "rsa"`, "p256", "ed25519"}},
		{[]string{"gateway", "--dir", dir, "--cn", "gw", "--name", "../gw"}, []string{`--name "../gw"`, "--dir"}},
		{[]string{"gateway", "--dir", t.TempDir(), "--cn", "gw"}, []string{"--ca-cert", "caddy sandbox certs ca"}},
		{[]string{"gateway", "--dir", dir, "--cn", "gw", "--ca-key", filepath.Join(dir, "forwarder.pem")}, []string{"--ca-key", "no PEM private key"}},
		{[]string{"gateway", "--dir", dir, "--cn", "gw", "--ca-cert", filepath.Join(dir, "ca-key.pem")}, []string{"no PEM CERTIFICATE"}},
		{[]string{}, []string{"ca|forwarder|gateway"}},
	}
	for _, c := range cases {
		_, err := runSandbox(t, nil, append([]string{"certs"}, c.args...)...)
		if err == nil {
			t.Errorf("certs %q succeeded", c.args)
			continue
		}
		for _, want := range c.want {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("certs %q: %q lacks %q", c.args, err, want)
			}
		}
	}
	// A key that is not the CA's: another CA's.
	other := t.TempDir()
	if _, err := runSandbox(t, nil, "certs", "ca", "--dir", other); err != nil {
		t.Fatal(err)
	}
	_, err := runSandbox(t, nil, "certs", "gateway", "--dir", dir, "--cn", "gw", "--ca-key", filepath.Join(other, "ca-key.pem"))
	if err == nil || !strings.Contains(err.Error(), "is not the key of --ca-cert") {
		t.Errorf("certs gateway with another CA's key: %v", err)
	}
	// A leaf is no CA.
	if _, err := runSandbox(t, nil, "certs", "gateway", "--dir", dir, "--cn", "gw-1", "--name", "gw-1"); err != nil {
		t.Fatal(err)
	}
	_, err = runSandbox(t, nil, "certs", "gateway", "--dir", dir, "--cn", "gw", "--ca-cert", filepath.Join(dir, "gw-1.pem"), "--ca-key", filepath.Join(dir, "gw-1-key.pem"))
	if err == nil || !strings.Contains(err.Error(), "is no CA certificate") {
		t.Errorf("certs gateway issued by a leaf: %v", err)
	}

	if sum(existing) != oldSum || sum(filepath.Join(dir, "ca.pem")) != caSum || sum(filepath.Join(dir, "ca-key.pem")) != caKeySum {
		t.Error("a refused command changed an existing file")
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := []string{"ca-key.pem", "ca.pem", "forwarder.pem", "gw-1-key.pem", "gw-1.pem"}; !slices.Equal(names, want) {
		t.Errorf("after the refusals %s holds %q, want %q", dir, names, want)
	}
}

// TestSandboxCertsAbsolutePaths: run in the directory it writes to (the
// default --dir "."), certs prints the Caddyfile lines with absolute paths:
// Caddy would resolve a relative one against its own working directory.
func TestSandboxCertsAbsolutePaths(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	out, err := runSandbox(t, nil, "certs", "ca")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "wrote ca.pem ") || !strings.Contains(out, "trust_pool file "+filepath.Join(dir, "ca.pem")+"\n") {
		t.Errorf("certs ca in its directory printed %q", out)
	}
	out, err = runSandbox(t, nil, "certs", "gateway", "--cn", "gw-1")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"wrote gateway.pem ", "tls_client_auth " + filepath.Join(dir, "gateway.pem") + " " + filepath.Join(dir, "gateway-key.pem") + "\n",
		"trust_pool file " + filepath.Join(dir, "ca.pem") + "\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("certs gateway in its directory printed %q, which lacks %q", out, want)
		}
	}
}
