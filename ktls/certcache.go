package ktls

import (
	"crypto/x509"
	"runtime"
	"sync"
	"weak"
)

// adoptedCerts holds the peer certificates Adopt parsed, by their DER, for
// as long as some Conn holds them: the tunnels of one gateway, moved in an
// upgrade, share its chain, which is parsed once instead of once per
// tunnel. An entry goes when its certificate is collected. crypto/tls
// keeps its clients' server certificates the same way.
var adoptedCerts sync.Map // string (DER) → weak.Pointer[x509.Certificate]

// parseAdoptedCert returns the certificate der encodes, the one already
// parsed while it lives. Callers must not modify it.
func parseAdoptedCert(der []byte) (*x509.Certificate, error) {
	if v, ok := adoptedCerts.Load(string(der)); ok {
		if c := v.(weak.Pointer[x509.Certificate]).Value(); c != nil {
			return c, nil
		}
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	// This replaces a collected entry, or one another Adopt stored
	// meanwhile; a cleanup deletes its own entry only.
	key, wp := string(der), weak.Make(c)
	adoptedCerts.Store(key, wp)
	runtime.AddCleanup(c, func(key string) { adoptedCerts.CompareAndDelete(key, wp) }, key)
	return c, nil
}
