package offload

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"strings"

	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/gateway"
)

// reasonUnknownServerName is the handshake failure reason of a client
// that asked for a server name no certificate of this server carries.
const reasonUnknownServerName = "unknown-server-name"

// unknownServerName reports whether err, a server's handshake error, says
// that no certificate carries the name the client asked for (Caddy's
// certificate cache: "no certificate available for ...").
func unknownServerName(err error) bool {
	return strings.Contains(err.Error(), "no certificate available")
}

// handshakeFailureDetail is what the log line of a failed handshake (the
// server's error err, counted as reason) says beyond the error: the
// client's certificate (subject and issuer) when one was refused, and
// what to do.
func handshakeFailureDetail(reason string, err error) []zap.Field {
	var fields []zap.Field
	var cve *tls.CertificateVerificationError
	if errors.As(err, &cve) && len(cve.UnverifiedCertificates) > 0 {
		leaf := cve.UnverifiedCertificates[0]
		fields = append(fields, zap.String("client_certificate", leaf.Subject.String()), zap.String("issuer", leaf.Issuer.String()))
		var inv x509.CertificateInvalidError
		var ua x509.UnknownAuthorityError
		switch {
		case errors.As(err, &inv) && inv.Reason == x509.IncompatibleUsage || !gateway.HasClientAuth(leaf):
			return append(fields, zap.String("fix", "the client certificate lacks the clientAuth extended key usage: issue it with extKeyUsage clientAuth"))
		case errors.As(err, &ua):
			return append(fields, zap.String("fix", "the client certificate's issuer is not in this client_auth trust_pool: add the gateway's CA there, or give the gateway a certificate a CA in it issued"))
		case errors.As(err, &inv) && inv.Reason == x509.Expired:
			return append(fields, zap.String("fix", "the client certificate has expired or is not yet valid: renew it, and check both hosts' clocks"))
		}
		return fields
	}
	switch reason {
	case "no-client-certificate":
		fields = append(fields, zap.String("fix", "the client sent no certificate: give it one whose issuer is in this client_auth trust_pool "+
			"(a client may withhold one whose issuer is not among the CAs the handshake names; a caddy-ktls gateway sends it)"))
	case reasonUnknownServerName:
		fields = append(fields, zap.String("fix", "no certificate of this server carries the server name the client asked for: "+
			"load one with that name (a site, or the tls app's load_files), or make the gateway ask for a name one carries (tls_server_name)"))
	}
	return fields
}
