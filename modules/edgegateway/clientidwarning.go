package edgegateway

import (
	"regexp"
	"slices"
	"strings"

	"go.uber.org/zap"
)

// This file holds the load-time warnings for what a configuration lets an
// unauthenticated peer claim while the module vouches for it: a client_id
// taken from the request, and a PROXY line that sets the peer's address.

// placeholderRe finds the {placeholders} of a configured value.
var placeholderRe = regexp.MustCompile(`\{([^{}]+)\}`)

// clientControlled are the placeholder prefixes whose values the client
// chooses as it pleases: its request's headers, cookies, URI and Host, and
// the server name it sent. A client_id made of them is whatever the user
// says.
var clientControlled = []string{
	"http.request.header.", "http.request.cookie.", "http.request.uri", "http.request.orig_uri",
	"http.request.host", "http.request.body", "l4.tls.server_name",
}

// ClientIDWarning is the WARN of a client_id that comes from what the
// client sent.
const ClientIDWarning = "client_id comes from what the client sent: any user can claim any identity, and the gateway signs it into the preamble as vouched for"

// warnUntrustedClientID warns, once per load of a gateway module, when its
// client_id (fix names the authenticated placeholders of that module) holds
// a placeholder the client chooses. A header that an authentication handler
// in front sets (forward_auth with copy_headers, which drops the client's
// own) is trustworthy, and then the warning is expected: it cannot see that
// handler.
func warnUntrustedClientID(logger *zap.Logger, clientID, fix string) {
	var from []string
	for _, m := range placeholderRe.FindAllStringSubmatch(clientID, -1) {
		key := strings.ToLower(m[1])
		if slices.ContainsFunc(clientControlled, func(p string) bool { return strings.HasPrefix(key, p) }) {
			from = append(from, m[0])
		}
	}
	if len(from) == 0 {
		return
	}
	logger.Warn(ClientIDWarning, zap.String("option", "client_id"), zap.String("client_id", clientID),
		zap.Strings("client_controlled", from), zap.String("fix", fix))
}

// The fixes warnUntrustedClientID names.
const (
	ClientIDFixHTTP = "take the identity from an authenticated source: {http.request.tls.client.subject} (a client certificate the handshake verified: " +
		"client_auth verify_if_given or require_and_verify) or {http.auth.user.id} (an authentication handler before reverse_proxy, e.g. basic_auth); " +
		"a header is one only when a handler in front sets it and drops the client's own (forward_auth with copy_headers), and then this warning is expected"
	ClientIDFixL4 = "take the identity from an authenticated source: {l4.tls.client.subject} (a client certificate the ktls or tls handler verified: " +
		"client_auth verify_if_given or require_and_verify)"
)
