package caddyktls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"io"
	"math/big"
	"net"
	"net/url"
	"reflect"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// sanClient issues a client certificate with every kind of SAN and every
// subject attribute caddy-l4 has a placeholder for, some with two values.
func sanClient(t *testing.T, ca *testpki.CA) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	uri, _ := url.Parse("spiffe://example.org/gateway/1")
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(4242),
		Subject: pkix.Name{CommonName: "gateway-1", SerialNumber: "gw-serial-7",
			Organization: []string{"Example Org", "Second Org"}, OrganizationalUnit: []string{"Edge"},
			Country: []string{"DE"}, Locality: []string{"Berlin"}, Province: []string{"BE"},
			StreetAddress: []string{"Main St 1"}, PostalCode: []string{"10115"}},
		NotBefore:      time.Now().Add(-time.Hour),
		NotAfter:       time.Now().Add(time.Hour),
		KeyUsage:       x509.KeyUsageDigitalSignature,
		ExtKeyUsage:    []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		DNSNames:       []string{"gw1.example.org", "gw.example.org"},
		IPAddresses:    []net.IP{net.IPv4(192, 0, 2, 7), net.ParseIP("2001:db8::7")},
		EmailAddresses: []string{"edge@example.org"},
		URIs:           []*url.URL{uri},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// TestTLSPlaceholdersMatchCaddyL4 terminates TLS once with caddy-l4's own
// `tls` handler and once with `ktls` (same policies, same client), with
// and without a client certificate, and compares every {l4.tls.*} key both
// handlers resolve: the same known/unknown answer, the same value and the
// same text in a string. No kTLS needed: the handler sets the same
// variables on the userspace fallback.
func TestTLSPlaceholdersMatchCaddyL4(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	ca := testpki.NewCA(t, "placeholder CA")
	server := ca.Server(t)
	addrs := map[string]string{"tls": loopbackAddr(t), "ktls": loopbackAddr(t)}
	servers := map[string]any{}
	for handler, addr := range addrs {
		servers[handler] = map[string]any{
			"listen": []string{addr},
			"routes": []any{map[string]any{"handle": []any{
				map[string]any{"handler": handler, "connection_policies": []any{map[string]any{
					"default_sni": "localhost",
					"client_authentication": map[string]any{
						"mode":             "verify_if_given",
						"trusted_ca_certs": []string{base64.StdEncoding.EncodeToString(ca.Cert.Raw)},
					},
				}}},
				map[string]any{"handler": "test_tls_placeholders", "server": handler},
			}}},
		}
	}
	cfg, err := json.Marshal(map[string]any{
		"admin": map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
		"apps": map[string]any{
			"tls": map[string]any{
				"certificates":          map[string]any{"load_pem": []any{map[string]any{"certificate": string(server.CertPEM), "key": string(server.KeyPEM)}}},
				"disable_storage_clean": true,
			},
			"layer4": map[string]any{"servers": servers},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("caddy.Load: %v", err)
	}
	t.Cleanup(func() {
		if err := caddy.Load([]byte(unloadConfig), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})

	client := sanClient(t, ca)
	for _, tc := range []struct {
		name  string
		certs []tls.Certificate
	}{{"client certificate", []tls.Certificate{client}}, {"no client certificate", nil}} {
		t.Run(tc.name, func(t *testing.T) {
			seen := map[string]map[string]placeholderValue{}
			for handler, addr := range addrs {
				seen[handler] = placeholdersVia(t, handler, addr, &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", Certificates: tc.certs})
			}
			want, got := seen["tls"], seen["ktls"]
			known := 0
			for _, k := range tlsPlaceholderKeys() {
				w, g := want[k], got[k]
				if w.known != g.known || w.text != g.text || !reflect.DeepEqual(w.value, g.value) {
					t.Errorf("%s: caddy-l4 tls: %v %T %q; ktls: %v %T %q", k, w.known, w.value, w.text, g.known, g.value, g.text)
				}
				if w.known {
					known++
				}
			}
			// Not a comparison of two empty sets: spot checks of values
			// caddy-l4 gives this client.
			p := tlsPlaceholderPrefix
			checks := map[string]string{p + "server_name": "localhost", p + "version": "tls1.3", p + "client.san.dns_names.1": "<unknown>"}
			if tc.certs != nil {
				checks = map[string]string{
					p + "client.san.dns_names.1": "gw.example.org", p + "client.san.ips.1": "2001:db8::7",
					p + "client.san.emails.0": "edge@example.org", p + "client.san.uris.0": "spiffe://example.org/gateway/1",
					p + "client.subject.locality.0": "Berlin", p + "client.subject.postal_code": "[10115]",
					p + "client.subject.organizational_unit": "[Edge]", p + "client.subject.serial": "gw-serial-7",
					p + "client.serial": "4242", p + "client.issuer.common_name": "placeholder CA",
					p + "CLIENT.Subject.Common_Name": "gateway-1",
				}
			}
			for k, v := range checks {
				if got[k].text != v {
					t.Errorf("ktls: {%s} = %q, want %q", k, got[k].text, v)
				}
			}
			// Past the end of a list: known, but empty.
			if past := got[p+"client.san.emails.1"]; past.known != (tc.certs != nil) || past.value != nil {
				t.Errorf("ktls: %s: %+v, want known (with a certificate) and nil", p+"client.san.emails.1", past)
			}
			t.Logf("%d keys compared, %d known to both handlers", len(tlsPlaceholderKeys()), known)
		})
	}
}

// placeholdersVia opens one TLS connection to the server of handler at
// addr and returns the placeholders the recorder saw for it.
func placeholdersVia(t *testing.T, handler, addr string, cfg *tls.Config) map[string]placeholderValue {
	t.Helper()
	c, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	// The recorder returns as soon as it has resolved the keys, and the
	// server closes: EOF here means the set is waiting.
	io.Copy(io.Discard, c)
	c.Close()
	select {
	case s := <-placeholdersSeen:
		if s.server != handler {
			t.Fatalf("placeholders recorded by the %s server, want %s", s.server, handler)
		}
		return s.values
	case <-time.After(10 * time.Second):
		t.Fatalf("no placeholders recorded by the %s server", handler)
		return nil
	}
}
