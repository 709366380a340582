package caddyktls

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddytls"
	"github.com/mholt/caddy-l4/layer4"
)

// tlsPlaceholderPrefix starts every placeholder of a terminated TLS session.
const tlsPlaceholderPrefix = layer4.AppReplPrefix + "tls."

// addTLSPlaceholders provides the {l4.tls.*} placeholders of cs with the
// same keys and values as caddy-l4's `tls` handler, so configurations,
// matchers and log fields written for that handler work unchanged behind
// `ktls`. It mirrors caddy-l4's unexported addTLSVarsToReplacer
// (modules/l4tls/handler.go, docs/compatibility.md), and
// TestTLSPlaceholdersMatchCaddyL4 compares the two key by key.
func addTLSPlaceholders(repl *caddy.Replacer, cs *tls.ConnectionState) {
	if repl == nil || cs == nil {
		return
	}
	repl.Map(func(key string) (any, bool) {
		field, ok := strings.CutPrefix(key, tlsPlaceholderPrefix)
		if !ok {
			return nil, false
		}
		// Like caddy-l4: the part after the prefix is case-insensitive.
		field = strings.ToLower(field)
		if client, ok := strings.CutPrefix(field, "client."); ok {
			if len(cs.PeerCertificates) == 0 {
				return nil, false
			}
			return clientCertPlaceholder(cs, client)
		}
		if n, ok := strings.CutPrefix(field, "server_name.labels."); ok {
			return serverNameLabel(cs.ServerName, n)
		}
		switch field {
		case "version":
			return caddytls.ProtocolName(cs.Version), true
		case "cipher_suite":
			return tls.CipherSuiteName(cs.CipherSuite), true
		case "resumed":
			return cs.DidResume, true
		case "proto":
			return cs.NegotiatedProtocol, true
		case "proto_mutual":
			// tls.ConnectionState.NegotiatedProtocolIsMutual is deprecated
			// and always true.
			return true, true
		case "server_name":
			return cs.ServerName, true
		case "ech":
			return cs.ECHAccepted, true
		}
		return nil, false
	})
}

// serverNameLabel is l4.tls.server_name.labels.<n>: the n-th label of the
// server name counted from the right, from 0, as Caddy's
// {http.request.host.labels.<n>} counts a request's host (this one is not
// caddy-l4's: sandbox_proxy routes by it).
func serverNameLabel(name, n string) (any, bool) {
	i, err := strconv.Atoi(n)
	if err != nil || i < 0 || name == "" {
		return nil, false
	}
	labels := strings.Split(strings.TrimSuffix(name, "."), ".")
	if i >= len(labels) {
		return nil, false
	}
	return labels[len(labels)-1-i], true
}

// clientCertPlaceholder is l4.tls.client.<field> for the peer's leaf
// certificate.
func clientCertPlaceholder(cs *tls.ConnectionState, field string) (any, bool) {
	cert := cs.PeerCertificates[0]
	if san, ok := strings.CutPrefix(field, "san."); ok {
		// caddy-l4 matches the list names as prefixes, in this order.
		switch {
		case strings.HasPrefix(san, "dns_names"):
			return indexedPlaceholder(cert.DNSNames, san[len("dns_names"):])
		case strings.HasPrefix(san, "emails"):
			return indexedPlaceholder(cert.EmailAddresses, san[len("emails"):])
		case strings.HasPrefix(san, "ips"):
			return indexedPlaceholder(cert.IPAddresses, san[len("ips"):])
		case strings.HasPrefix(san, "uris"):
			return indexedPlaceholder(cert.URIs, san[len("uris"):])
		}
		return nil, false
	}
	for _, group := range []struct {
		prefix string
		name   *pkix.Name
	}{{"subject.", &cert.Subject}, {"issuer.", &cert.Issuer}} {
		if attr, ok := strings.CutPrefix(field, group.prefix); ok {
			return namePlaceholder(group.name, attr)
		}
	}
	switch field {
	case "fingerprint":
		return fmt.Sprintf("%x", sha256.Sum256(cert.Raw)), true
	case "public_key", "public_key_sha256":
		if cert.PublicKey == nil {
			return nil, true
		}
		der, err := publicKeyBytes(cert.PublicKey)
		if err != nil {
			return nil, true
		}
		if field == "public_key_sha256" {
			return fmt.Sprintf("%x", sha256.Sum256(der)), true
		}
		return fmt.Sprintf("%x", der), true
	case "issuer":
		return cert.Issuer, true
	case "serial":
		return cert.SerialNumber, true
	case "subject":
		return cert.Subject, true
	case "certificate_pem":
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}), true
	case "certificate_der_base64":
		return base64.StdEncoding.EncodeToString(cert.Raw), true
	}
	return nil, false
}

// namePlaceholder is one attribute of a subject or issuer name.
func namePlaceholder(name *pkix.Name, attr string) (any, bool) {
	switch attr {
	case "common_name":
		return name.CommonName, true
	case "serial":
		return name.SerialNumber, true
	}
	// Prefixes in caddy-l4's order: organizational_unit before the
	// organization it starts with.
	for _, list := range []struct {
		attr   string
		values []string
	}{
		{"organizational_unit", name.OrganizationalUnit},
		{"organization", name.Organization},
		{"country", name.Country},
		{"locality", name.Locality},
		{"province", name.Province},
		{"street_address", name.StreetAddress},
		{"postal_code", name.PostalCode},
	} {
		if index, ok := strings.CutPrefix(attr, list.attr); ok {
			return indexedPlaceholder(list.values, index)
		}
	}
	return nil, false
}

// indexedPlaceholder resolves what follows a list's name: nothing is the
// whole list, ".<n>" its nth element (known but empty past the end),
// anything else no placeholder.
func indexedPlaceholder[T any](list []T, index string) (any, bool) {
	if index == "" {
		return list, true
	}
	n, ok := strings.CutPrefix(index, ".")
	if !ok || n == "" {
		return nil, false
	}
	i, err := strconv.Atoi(n)
	if err != nil || i < 0 {
		return nil, false
	}
	if i >= len(list) {
		return nil, true
	}
	return list[i], true
}

// publicKeyBytes encodes a certificate's public key as caddy-l4 does for
// l4.tls.client.public_key: PKCS #1 for RSA, the uncompressed point for
// ECDSA, the raw key for Ed25519.
func publicKeyBytes(pub any) ([]byte, error) {
	switch key := pub.(type) {
	case *rsa.PublicKey:
		return asn1.Marshal(key)
	case *ecdsa.PublicKey:
		e, err := key.ECDH()
		if err != nil {
			return nil, err
		}
		return e.Bytes(), nil
	case ed25519.PublicKey:
		return key, nil
	}
	return nil, fmt.Errorf("unrecognized public key type: %T", pub)
}
