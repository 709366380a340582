package gateway

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// CertificateAlert matches the alerts with which a server refuses a
// client certificate, read from a kernel-TLS connection or from
// crypto/tls, wrapped or not, and nothing else: access_denied is the
// forwarder's refusal of a tunnel it accepted the certificate of.
func TestCertificateAlert(t *testing.T) {
	remote := func(d uint8) error { return &net.OpError{Op: "remote error", Err: tls.AlertError(d)} }
	for _, tc := range []struct {
		err  error
		want string
	}{
		{ktls.AlertError(42), "bad_certificate"},
		{remote(42), "bad_certificate"},
		{fmt.Errorf("net/http: %w", remote(48)), "unknown_ca"},
		{remote(116), "certificate_required"},
		{ktls.AlertError(45), "certificate_expired"},
		{remote(44), "certificate_revoked"},
		{remote(43), "unsupported_certificate"},
		{remote(46), "certificate_unknown"},
		{ktls.AlertError(ktls.AlertAccessDenied), ""},
		{remote(ktls.AlertAccessDenied), ""},
		{remote(80), ""},
		{&net.OpError{Op: "local error", Err: tls.AlertError(42)}, ""},
		{nil, ""},
	} {
		name, ok := CertificateAlert(tc.err)
		if name != tc.want || ok != (tc.want != "") {
			t.Errorf("CertificateAlert(%v) = %q, %v; want %q", tc.err, name, ok, tc.want)
		}
	}
}

// A certificate refusal's error names the alert and the certificate and
// says the fix that fits what the gateway knows of its certificate.
func TestCertificateRefusedErrorSaysWhatToDo(t *testing.T) {
	ca := testpki.NewCA(t, "Gateway CA")
	noEKU := leafOf(&ca.Leaf(t, "gateway-1", x509.ExtKeyUsageServerAuth).TLS)
	good := leafOf(&ca.Client(t, "gateway-1").TLS)
	for _, tc := range []struct {
		e    CertificateRefusedError
		want string
	}{
		{CertificateRefusedError{Alert: "bad_certificate", Certificate: noEKU},
			`the forwarder refused the gateway's client certificate (bad_certificate) "CN=gateway-1" issued by "CN=Gateway CA": ` +
				"it lacks the clientAuth extended key usage, which a forwarder requires of a client certificate: issue it with extKeyUsage clientAuth; nothing reached the sandbox"},
		{CertificateRefusedError{Alert: "unknown_ca", Certificate: good},
			`(unknown_ca) "CN=gateway-1" issued by "CN=Gateway CA": its issuer "CN=Gateway CA" is not in the forwarder's client_auth trust_pool: add that CA there, or use a certificate a CA in it issued`},
		{CertificateRefusedError{Alert: "bad_certificate", Certificate: good},
			"(bad_certificate) \"CN=gateway-1\" issued by \"CN=Gateway CA\": the forwarder could not accept it: a certificate without the clientAuth extended key usage"},
		{CertificateRefusedError{Alert: "certificate_expired"},
			"(certificate_expired): it has expired or is not yet valid at the forwarder: renew it, and check both hosts' clocks"},
	} {
		if got := tc.e.Error(); !strings.Contains(got, tc.want) || !strings.Contains(got, "caddy_ktls_handshake_failures_total") {
			t.Errorf("%s: %q\nwant it to contain %q", tc.e.Alert, got, tc.want)
		}
	}
}
