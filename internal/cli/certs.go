package cli

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// certsCommand is "caddy sandbox certs": the certificates of the mutual
// TLS between gateways and forwarders.
func certsCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "certs ca|forwarder|gateway [flags]",
		Short: "Make the CA, forwarder and gateway certificates of the mutual TLS",
		Long: `
Makes the certificates that gateways and forwarders authenticate each other
with:

  ca         a CA: <name>.pem and <name>-key.pem (default name "ca")
  forwarder  a forwarder's server certificate (serverAuth), issued by the
             CA, with a SAN for each --san (the name or IP the gateways
             dial): forwarder.pem and forwarder-key.pem
  gateway    a gateway's client certificate (clientAuth), issued by the CA,
             Common Name --cn: gateway.pem and gateway-key.pem

Files go to --dir (default the current directory). Keys are written with
mode 0600, certificates 0644. No file is ever overwritten: when one that a
command would write exists, it writes nothing and names it (give another
--name or --dir, or remove the file). forwarder and gateway read the CA
from --ca-cert and --ca-key (default <dir>/ca.pem and <dir>/ca-key.pem).
Keys are ECDSA P-256 (--key-type p256, the default) or Ed25519.

Each command prints the files it wrote and the Caddyfile lines that use
them. One CA may issue both the forwarders' and the gateways' certificates,
or two CAs (ca --name forwarders-ca, ca --name gateways-ca) keep them apart.

Rotation: issue a new certificate from the same CA (another --name, or
after moving the old files away), point the configuration at it and reload
(caddy reload): open tunnels keep their session. A new CA: make it, trust
both CAs during the overlap (a PEM file with both certificates as
trust_pool / tls_trust_pool), reissue every certificate from the new one,
reload everywhere, then drop the old CA from the trust files.

Where each file goes: ` + certsDocURL + `
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return errors.New("give what to make: caddy sandbox certs ca|forwarder|gateway (--help for the flags)")
		},
	}
	cmd.AddCommand(certsCACommand(), certsLeafCommand(certForwarder), certsLeafCommand(certGateway))
	return cmd
}

// certsDocURL is README's section on the certificates, which "caddy
// sandbox certs --help" points to.
const certsDocURL = "https://github.com/ktlsingress/caddy-ktls#certificates"

// certKind is what a leaf certificate is for.
type certKind string

const (
	certForwarder certKind = "forwarder"
	certGateway   certKind = "gateway"
)

// certFlags are the flags every certs subcommand shares.
type certFlags struct {
	dir, name, keyType, cn string
	days                   int
}

func (f *certFlags) register(cmd *cobra.Command, name string, days int) {
	cmd.Flags().StringVar(&f.dir, "dir", ".", "directory the files are written to (made, mode 0700, when missing)")
	cmd.Flags().StringVar(&f.name, "name", name, "file name: <name>.pem and <name>-key.pem")
	cmd.Flags().StringVar(&f.keyType, "key-type", "p256", "key type: p256 (ECDSA P-256) or ed25519")
	cmd.Flags().IntVar(&f.days, "days", days, "validity in days")
}

// paths returns the certificate and key files f names, refusing a name
// with a path separator and any file that exists already.
func (f *certFlags) paths() (certFile, keyFile string, err error) {
	if f.name == "" || strings.ContainsRune(f.name, '/') || f.name == "." || f.name == ".." {
		return "", "", fmt.Errorf("--name %q: give a file name without a directory (the directory is --dir)", f.name)
	}
	if f.days < 1 {
		return "", "", fmt.Errorf("--days %d: give at least 1", f.days)
	}
	certFile = filepath.Join(f.dir, f.name+".pem")
	keyFile = filepath.Join(f.dir, f.name+"-key.pem")
	for _, p := range []string{certFile, keyFile} {
		if _, err := os.Lstat(p); err == nil {
			return "", "", fmt.Errorf("%s exists: certs never overwrites a file and wrote nothing; "+
				"give another --name or --dir, or move the old files away first", p)
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", "", err
		}
	}
	return certFile, keyFile, nil
}

// newKey makes a key of the type --key-type names.
func newKey(keyType string) (crypto.Signer, error) {
	switch keyType {
	case "p256", "ecdsa", "ecdsa-p256":
		return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	case "ed25519":
		_, key, err := ed25519.GenerateKey(rand.Reader)
		return key, err
	}
	return nil, fmt.Errorf("--key-type %q: give p256 (ECDSA P-256) or ed25519", keyType)
}

// randomSerial is a 128-bit certificate serial number.
func randomSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}

// writeCertAndKey writes the key (0600) and then the certificate (0644),
// making dir (0700) when missing; a failure removes what it wrote.
func writeCertAndKey(dir, certFile, keyFile string, der []byte, key crypto.Signer) error {
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := writeNewFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return err
	}
	if err := writeNewFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		os.Remove(keyFile)
		return err
	}
	return nil
}

func certsCACommand() *cobra.Command {
	var f certFlags
	cmd := &cobra.Command{
		Use:   "ca [--dir <dir>] [--name ca] [--cn <common name>] [--days 3650] [--key-type p256|ed25519]",
		Short: "Make a CA for the gateways' and forwarders' certificates",
		Long: `
Makes a self-signed CA: <dir>/<name>.pem (the certificate the other side
trusts: the forwarder's trust_pool, the gateway's tls_trust_pool) and
<dir>/<name>-key.pem (mode 0600; it signs the certificates: keep it off the
forwarders and gateways). Refuses to overwrite either file.
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			certFile, keyFile, err := f.paths()
			if err != nil {
				return err
			}
			key, err := newKey(f.keyType)
			if err != nil {
				return err
			}
			serial, err := randomSerial()
			if err != nil {
				return err
			}
			cn := f.cn
			if cn == "" {
				cn = "caddy-ktls " + f.name
			}
			now := time.Now()
			tmpl := &x509.Certificate{
				SerialNumber:          serial,
				Subject:               pkix.Name{CommonName: cn},
				NotBefore:             now.Add(-time.Hour),
				NotAfter:              now.AddDate(0, 0, f.days),
				IsCA:                  true,
				BasicConstraintsValid: true,
				MaxPathLenZero:        true,
				KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
			}
			der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
			if err != nil {
				return err
			}
			if err := writeCertAndKey(f.dir, certFile, keyFile, der, key); err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "wrote %s (CA certificate %q, valid until %s)\n", certFile, cn, tmpl.NotAfter.UTC().Format(time.DateOnly))
			certFile = absPath(certFile)
			fmt.Fprintf(w, "wrote %s (its key, mode 0600: keep it where you issue certificates, not on the forwarders or gateways)\n", keyFile)
			fmt.Fprintf(w, "\nAt the forwarder, trusting the gateways it issued (ktls connection_policy):\n\tclient_auth {\n\t\tmode require_and_verify\n\t\ttrust_pool file %s\n\t}\n", certFile)
			fmt.Fprintf(w, "At the gateway, trusting the forwarders it issued (transport sandbox, sandbox_proxy):\n\ttls_trust_pool file %s\n", certFile)
			return nil
		},
	}
	f.register(cmd, "ca", 3650)
	cmd.Flags().StringVar(&f.cn, "cn", "", `Common Name (default "caddy-ktls <name>")`)
	return cmd
}

func certsLeafCommand(kind certKind) *cobra.Command {
	var f certFlags
	var caCert, caKey string
	var sans []string
	cmd := &cobra.Command{Args: cobra.NoArgs}
	switch kind {
	case certForwarder:
		cmd.Use = "forwarder --san <name or IP>... [--dir <dir>] [--name forwarder] [--ca-cert <dir>/ca.pem --ca-key <dir>/ca-key.pem] [--days 365] [--key-type p256|ed25519]"
		cmd.Short = "Issue a forwarder's server certificate"
		cmd.Long = `
Issues a server certificate (extended key usage serverAuth) for a forwarder
from the CA: <dir>/<name>.pem and <dir>/<name>-key.pem (mode 0600). Each
--san (repeat it, or separate with commas) is a DNS name or an IP address
the gateways may dial the forwarder by: a gateway checks the certificate
against its tls_server_name, else the host of the forwarder's address.
Refuses to overwrite either file.
`
	case certGateway:
		cmd.Use = "gateway --cn <name> [--san <dns name>...] [--dir <dir>] [--name gateway] [--ca-cert <dir>/ca.pem --ca-key <dir>/ca-key.pem] [--days 365] [--key-type p256|ed25519]"
		cmd.Short = "Issue a gateway's client certificate"
		cmd.Long = `
Issues a client certificate (extended key usage clientAuth: the forwarder
refuses a certificate without it) for a gateway from the CA:
<dir>/<name>.pem and <dir>/<name>-key.pem (mode 0600). --cn is its Common
Name, the name the forwarder's key_clients binds signing keys to (each
--san adds a DNS name that key_clients matches too). Refuses to overwrite
either file.
`
	}
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		certFile, keyFile, err := f.paths()
		if err != nil {
			return err
		}
		if caCert == "" {
			caCert = filepath.Join(f.dir, "ca.pem")
		}
		if caKey == "" {
			caKey = filepath.Join(f.dir, "ca-key.pem")
		}
		ca, signer, err := loadCA(caCert, caKey)
		if err != nil {
			return err
		}
		serial, err := randomSerial()
		if err != nil {
			return err
		}
		now := time.Now()
		tmpl := &x509.Certificate{
			SerialNumber:          serial,
			NotBefore:             now.Add(-time.Hour),
			NotAfter:              now.AddDate(0, 0, f.days),
			BasicConstraintsValid: true,
			KeyUsage:              x509.KeyUsageDigitalSignature,
		}
		if tmpl.NotAfter.After(ca.NotAfter) {
			return fmt.Errorf("--days %d would outlive the CA %s (valid until %s): give fewer --days, or make a new CA",
				f.days, caCert, ca.NotAfter.UTC().Format(time.DateOnly))
		}
		for _, s := range sans {
			s = strings.TrimSpace(s)
			switch ip := net.ParseIP(s); {
			case s == "":
			case ip != nil:
				if kind == certGateway {
					return fmt.Errorf("--san %s: a gateway's certificate takes DNS names (key_clients matches its Common Name and DNS names), not IP addresses", s)
				}
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			default:
				tmpl.DNSNames = append(tmpl.DNSNames, s)
			}
		}
		switch kind {
		case certForwarder:
			if len(tmpl.DNSNames)+len(tmpl.IPAddresses) == 0 {
				return errors.New("--san is required: give each DNS name and IP address the gateways dial this forwarder by (their tls_server_name, else the host of its address)")
			}
			tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
			tmpl.Subject.CommonName = firstSAN(tmpl)
		case certGateway:
			if f.cn == "" {
				return errors.New("--cn is required: the gateway's name (the forwarder's key_clients binds signing keys to it), e.g. --cn gateway-1")
			}
			tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
			tmpl.Subject.CommonName = f.cn
		}
		key, err := newKey(f.keyType)
		if err != nil {
			return err
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), signer)
		if err != nil {
			return err
		}
		if err := writeCertAndKey(f.dir, certFile, keyFile, der, key); err != nil {
			return err
		}
		printLeaf(cmd.OutOrStdout(), kind, tmpl, certFile, keyFile, caCert)
		return nil
	}
	f.register(cmd, string(kind), 365)
	cmd.Flags().StringVar(&caCert, "ca-cert", "", "the issuing CA's certificate (default <dir>/ca.pem)")
	cmd.Flags().StringVar(&caKey, "ca-key", "", "the issuing CA's key (default <dir>/ca-key.pem)")
	switch kind {
	case certForwarder:
		cmd.Flags().StringSliceVar(&sans, "san", nil, "DNS name or IP address the gateways dial (repeatable, or comma-separated)")
	case certGateway:
		cmd.Flags().StringVar(&f.cn, "cn", "", "the gateway's Common Name, e.g. gateway-1")
		cmd.Flags().StringSliceVar(&sans, "san", nil, "DNS name (repeatable, or comma-separated)")
	}
	return cmd
}

// firstSAN is the first DNS name of tmpl, else its first IP address.
func firstSAN(tmpl *x509.Certificate) string {
	if len(tmpl.DNSNames) > 0 {
		return tmpl.DNSNames[0]
	}
	return tmpl.IPAddresses[0].String()
}

// absPath is path made absolute, for the Caddyfile lines: Caddy resolves
// a relative path against its own working directory.
func absPath(path string) string {
	if abs, err := filepath.Abs(path); err == nil {
		return abs
	}
	return path
}

// printLeaf says what a leaf command wrote and the Caddyfile lines that use
// it (with absolute paths).
func printLeaf(w io.Writer, kind certKind, tmpl *x509.Certificate, certFile, keyFile, caCert string) {
	until := tmpl.NotAfter.UTC().Format(time.DateOnly)
	wroteCert, wroteKey := certFile, keyFile
	certFile, keyFile, caCert = absPath(certFile), absPath(keyFile), absPath(caCert)
	switch kind {
	case certForwarder:
		var names []string
		names = append(names, tmpl.DNSNames...)
		for _, ip := range tmpl.IPAddresses {
			names = append(names, ip.String())
		}
		fmt.Fprintf(w, "wrote %s (forwarder certificate, serverAuth, SANs %s, valid until %s)\n", wroteCert, strings.Join(names, ", "), until)
		fmt.Fprintf(w, "wrote %s (its key, mode 0600)\n", wroteKey)
		fmt.Fprintf(w, "\nAt the forwarder, in the site that loads its certificate:\n\ttls %s %s\n", certFile, keyFile)
		fmt.Fprintf(w, "At the gateways, which trust %s:\n\ttls_trust_pool file %s\n\ttls_server_name %s\n", caCert, caCert, firstSAN(tmpl))
	case certGateway:
		fmt.Fprintf(w, "wrote %s (gateway client certificate, clientAuth, CN %s, valid until %s)\n", wroteCert, tmpl.Subject.CommonName, until)
		fmt.Fprintf(w, "wrote %s (its key, mode 0600)\n", wroteKey)
		fmt.Fprintf(w, "\nAt the gateway (transport sandbox, sandbox_proxy):\n\ttls_client_auth %s %s\n", certFile, keyFile)
		fmt.Fprintf(w, "At the forwarder (ktls connection_policy), which trusts %s and allows this certificate:\n\tclient_auth {\n\t\tmode require_and_verify\n\t\ttrust_pool file %s\n\t\tverifier leaf file %s\n\t}\n", caCert, caCert, certFile)
	}
}

// loadCA reads a CA certificate and its key, checking that the key is the
// certificate's and that the certificate may issue certificates.
func loadCA(certFile, keyFile string) (*x509.Certificate, crypto.Signer, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, nil, fmt.Errorf("the CA certificate (--ca-cert): %w (make one with: caddy sandbox certs ca)", err)
	}
	block, _ := pem.Decode(certPEM)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, nil, fmt.Errorf("--ca-cert %s holds no PEM CERTIFICATE block", certFile)
	}
	ca, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("--ca-cert %s: %w", certFile, err)
	}
	if !ca.IsCA || ca.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, nil, fmt.Errorf("--ca-cert %s (%s) is no CA certificate: give the CA's (caddy sandbox certs ca makes one)", certFile, ca.Subject.CommonName)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("the CA key (--ca-key): %w", err)
	}
	block, _ = pem.Decode(keyPEM)
	if block == nil || !strings.HasSuffix(block.Type, "PRIVATE KEY") {
		return nil, nil, fmt.Errorf("--ca-key %s holds no PEM private key", keyFile)
	}
	var key any
	switch block.Type {
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(block.Bytes)
	case "RSA PRIVATE KEY":
		key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
	default:
		key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("--ca-key %s: %w", keyFile, err)
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, nil, fmt.Errorf("--ca-key %s: a %T cannot sign", keyFile, key)
	}
	pub, err := x509.MarshalPKIXPublicKey(signer.Public())
	if err != nil {
		return nil, nil, err
	}
	if !bytes.Equal(pub, ca.RawSubjectPublicKeyInfo) {
		return nil, nil, fmt.Errorf("--ca-key %s is not the key of --ca-cert %s: give the key the CA was made with", keyFile, certFile)
	}
	return ca, signer, nil
}
