package ktls

import (
	"bytes"
	"runtime"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// Adopt parses a peer certificate once while a Conn holds it: the same
// DER gives the same certificate, another DER another, a bad one an error
// and no entry; once nothing holds a certificate, its entry goes.
func TestParseAdoptedCert(t *testing.T) {
	ca := testpki.NewCA(t, "cache CA")
	derA, derB := ca.Client(t, "gateway-a").TLS.Certificate[0], ca.Client(t, "gateway-b").TLS.Certificate[0]
	a1, err := parseAdoptedCert(derA)
	if err != nil {
		t.Fatal(err)
	}
	a2, err := parseAdoptedCert(bytes.Clone(derA))
	if err != nil {
		t.Fatal(err)
	}
	b, err := parseAdoptedCert(derB)
	if err != nil {
		t.Fatal(err)
	}
	if a1 != a2 || a1 == b || a1.Subject.CommonName != "gateway-a" || b.Subject.CommonName != "gateway-b" {
		t.Fatalf("parsed %p %p %p (%s, %s, %s): want the first two one certificate, the third another", a1, a2, b, a1.Subject, a2.Subject, b.Subject)
	}
	bad := append(bytes.Clone(derA[:len(derA)-1]), derA[len(derA)-1]^0xff, 0)
	if c, err := parseAdoptedCert(bad); c != nil || err == nil {
		t.Fatalf("parseAdoptedCert(bad DER) = %v, %v; want an error", c, err)
	}
	if _, ok := adoptedCerts.Load(string(bad)); ok {
		t.Fatal("a certificate that did not parse has an entry")
	}
	runtime.KeepAlive(a1)
	runtime.KeepAlive(b)
	a1, a2, b = nil, nil, nil
	for range 100 {
		runtime.GC()
		_, okA := adoptedCerts.Load(string(derA))
		_, okB := adoptedCerts.Load(string(derB))
		if !okA && !okB {
			return
		}
		runtime.Gosched()
	}
	t.Fatal("the entries of certificates nothing holds were not removed after 100 collections")
}
