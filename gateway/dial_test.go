package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// TestDialPresentsCertificate: the Dialer sends its client certificate to a
// forwarder whose client_auth trust names only another CA, where crypto/tls
// left to itself withholds it (it sends no certificate of an issuer the
// server did not name). The forwarder then refuses the certificate it was
// given (unknown_ca, which says what is wrong), not a missing one
// (certificate_required).
func TestDialPresentsCertificate(t *testing.T) {
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	strict := p.server.Clone()
	strict.ClientCAs = testpki.NewCA(t, "another-ca").Pool
	route := Route{Sandbox: "sbx", Target: netip.MustParseAddrPort("127.0.0.1:9")}

	// crypto/tls alone, with the same configuration, withholds it.
	f := startForwarder(t, pki{server: strict, client: p.client}, gw, "127.0.0.0/8")
	c, err := tls.Dial("tcp", f.addr(), p.client)
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = c.Read(make([]byte, 1))
	c.Close()
	if name, _ := CertificateAlert(err); name != "certificate_required" {
		t.Fatalf("crypto/tls's own client read %v, want certificate_required: the test would not tell a withheld certificate", err)
	}
	if _, errs := f.served(t, 1); errs[0] == nil || !strings.Contains(errs[0].Error(), "didn't provide a certificate") {
		t.Fatalf("the forwarder's handshake with crypto/tls's client: %v, want no certificate", errs[0])
	}

	f = startForwarder(t, pki{server: strict, client: p.client}, gw, "127.0.0.0/8")
	route.Forwarder = f.addr()
	d := newDialer(t, p, gw)
	conn, err := d.Dial(context.Background(), route)
	if err == nil {
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, rerr := conn.Read(make([]byte, 1))
		conn.Close()
		if de := d.CertificateRefusal(route, rerr); de != nil {
			err = de
		} else {
			err = rerr
		}
	}
	var cre *CertificateRefusedError
	if !errors.As(err, &cre) || cre.Alert != "unknown_ca" {
		t.Fatalf("the Dialer's tunnel ended with %v, want the forwarder's refusal of its certificate as unknown_ca", err)
	}
	if want := p.client.Certificates[0].Certificate[0]; cre.Certificate == nil || string(cre.Certificate.Raw) != string(want) {
		t.Errorf("the refusal names certificate %v, want the Dialer's own", cre.Certificate)
	}
	if _, errs := f.served(t, 1); errs[0] == nil || !strings.Contains(errs[0].Error(), "unknown authority") {
		t.Errorf("the forwarder's handshake with the Dialer: %v, want the certificate refused for its unknown authority", errs[0])
	}
}
