package gateway

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// certificateAlerts are the fatal alerts with which a TLS server refuses
// its client's certificate (RFC 8446 section 6.2), by description, with
// what each says to the gateway's operator. access_denied is not one of
// them: a forwarder sends it for a refused preamble, after it accepted the
// certificate.
var certificateAlerts = map[uint8]struct{ name, fix string }{
	42: {"bad_certificate", "the forwarder could not accept it: a certificate without the clientAuth extended key usage " +
		"(issue it with extKeyUsage clientAuth), one its client_auth verifier (such as `verifier leaf`) does not allow, or a bad signature"},
	43:  {"unsupported_certificate", "the forwarder does not accept its type or key: issue an ECDSA, RSA or Ed25519 certificate with the clientAuth extended key usage"},
	44:  {"certificate_revoked", "the forwarder holds it revoked: issue a new one"},
	45:  {"certificate_expired", "it has expired or is not yet valid at the forwarder: renew it, and check both hosts' clocks"},
	46:  {"certificate_unknown", "the forwarder could not accept it: check its key usage (digitalSignature) and extended key usage (clientAuth)"},
	48:  {"unknown_ca", "its issuer is not in the forwarder's client_auth trust_pool: add the gateway's CA there, or use a certificate that CA issued"},
	116: {"certificate_required", "the forwarder received no client certificate: give the gateway one (tls_client_auth) whose issuer is in the forwarder's client_auth trust_pool"},
}

// alertInternalError is the TLS alert description internal_error.
const alertInternalError = 80

// CertificateAlert reports whether err is a fatal alert with which a TLS
// server refuses its client's certificate (bad_certificate,
// unsupported_certificate, certificate_revoked, certificate_expired,
// certificate_unknown, unknown_ca, certificate_required), as a kernel-TLS
// connection (ktls.AlertError) or crypto/tls (a "remote error") reports
// it, and returns the alert's name.
func CertificateAlert(err error) (name string, ok bool) {
	d, ok := remoteAlert(err)
	if !ok {
		return "", false
	}
	a, ok := certificateAlerts[d]
	return a.name, ok
}

// remoteAlert returns the description of the fatal alert the peer sent,
// when err is one.
func remoteAlert(err error) (uint8, bool) {
	if err == nil {
		return 0, false
	}
	var alert ktls.AlertError
	if errors.As(err, &alert) {
		return uint8(alert), true
	}
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "remote error" || op.Err == nil {
		return 0, false
	}
	// crypto/tls's alert type is unexported; its text is tls.AlertError's.
	text := op.Err.Error()
	for d := range 256 {
		if tls.AlertError(uint8(d)).Error() == text {
			return uint8(d), true
		}
	}
	return 0, false
}

// CertificateRefusedError is a forwarder's refusal of the gateway's TLS
// client certificate. With TLS 1.3 a client's handshake is complete before
// the server has judged the client's certificate, so the refusal, a fatal
// alert, may be read only after Dial returned: from the tunnel, before the
// forwarder's first byte. Nothing reached the sandbox (a forwarder reads
// no preamble before it accepted the certificate): whatever asked for the
// tunnel may be tried again, as after any DialError, which carries it
// (StepHandshake).
type CertificateRefusedError struct {
	// Alert is the alert's name, such as bad_certificate or unknown_ca.
	Alert string
	// Certificate is the gateway's client certificate when the Dialer
	// knows it (nil when the TLS configuration's GetClientCertificate
	// gives it).
	Certificate *x509.Certificate
	// Err is the alert as it was read.
	Err error
}

func (e *CertificateRefusedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "the forwarder refused the gateway's client certificate (%s)", e.Alert)
	if c := e.Certificate; c != nil {
		fmt.Fprintf(&b, " %q issued by %q", c.Subject.String(), c.Issuer.String())
	}
	b.WriteString(": ")
	switch {
	case e.Certificate != nil && !HasClientAuth(e.Certificate):
		b.WriteString("it lacks the clientAuth extended key usage, which a forwarder requires of a client certificate: issue it with extKeyUsage clientAuth")
	case e.Alert == "unknown_ca" && e.Certificate != nil:
		fmt.Fprintf(&b, "its issuer %q is not in the forwarder's client_auth trust_pool: add that CA there, or use a certificate a CA in it issued", e.Certificate.Issuer.String())
	default:
		for _, a := range certificateAlerts {
			if a.name == e.Alert {
				b.WriteString(a.fix)
			}
		}
	}
	b.WriteString("; nothing reached the sandbox, and the forwarder logs why at DEBUG (\"TLS handshake failed\") and counts it in caddy_ktls_handshake_failures_total")
	return b.String()
}

func (e *CertificateRefusedError) Unwrap() error { return e.Err }

// leafOf returns c's leaf certificate, nil when it has none or it does
// not parse.
func leafOf(c *tls.Certificate) *x509.Certificate {
	if c == nil || len(c.Certificate) == 0 {
		return nil
	}
	if c.Leaf != nil {
		return c.Leaf
	}
	leaf, err := x509.ParseCertificate(c.Certificate[0])
	if err != nil {
		return nil
	}
	return leaf
}

// HasClientAuth reports whether leaf may authenticate a TLS client as a Go
// server verifies it: no extended key usage at all, clientAuth or any.
func HasClientAuth(leaf *x509.Certificate) bool {
	if len(leaf.ExtKeyUsage) == 0 && len(leaf.UnknownExtKeyUsage) == 0 {
		return true
	}
	for _, u := range leaf.ExtKeyUsage {
		if u == x509.ExtKeyUsageClientAuth || u == x509.ExtKeyUsageAny {
			return true
		}
	}
	return false
}
