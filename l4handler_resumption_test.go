package caddyktls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddytls"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// A ticket resumes only under the policy configuration that issued it:
// another policy of the same handler cannot open it, whatever the client
// offers, and the tls app's `session_tickets { disabled }` turns tickets
// off. Here b trusts the same CA but has a leaf allowlist (Caddy's `leaf`
// verifier, a VerifyPeerCertificate) without the client: crypto/tls checks
// a resumed session's chain against the current pool, but runs no
// VerifyPeerCertificate, so only the scope keeps a's ticket out of b.
func TestSessionTicketsScopedToPolicy(t *testing.T) {
	ca := testpki.NewCA(t, "gateway CA")
	server, client := ca.Server(t), ca.Client(t, "gateway-1")
	policy := func(clientCAs *testpki.CA) *tls.Config {
		// As Caddy builds a policy with client authentication.
		return &tls.Config{Certificates: []tls.Certificate{server.TLS}, ClientAuth: tls.RequireAndVerifyClientCert,
			ClientCAs: clientCAs.Pool, SessionTicketsDisabled: true, MinVersion: tls.VersionTLS13}
	}
	a, b := policy(ca), policy(ca)
	b.VerifyPeerCertificate = func([][]byte, [][]*x509.Certificate) error {
		return errors.New("client certificate not on b's allowlist")
	}
	var keys sessionKeys
	// One cache for every handshake: the client offers a's ticket to b.
	cache := tls.NewLRUClientSessionCache(4)
	// handshake runs one handshake under chosen over loopback TCP and
	// reports whether it resumed and the server's error, if any.
	handshake := func(chosen *tls.Config, tickets *caddytls.SessionTicketService) (resumed bool, serverErr error) {
		t.Helper()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		type outcome struct {
			resumed bool
			err     error
		}
		done := make(chan outcome, 1)
		go func() {
			sc, err := ln.Accept()
			if err != nil {
				done <- outcome{err: err}
				return
			}
			defer sc.Close()
			srv := tls.Server(sc, &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
				return keys.resumable(chosen, tickets), nil
			}})
			err = srv.Handshake()
			if err == nil {
				// The client reads the tickets with the byte after them.
				_, err = srv.Write([]byte{1})
			}
			done <- outcome{srv.ConnectionState().DidResume, err}
		}()
		cc, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		cli := tls.Client(cc, &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", Certificates: []tls.Certificate{client.TLS},
			ClientSessionCache: cache, MinVersion: tls.VersionTLS13})
		cli.SetDeadline(time.Now().Add(10 * time.Second))
		_, cliErr := cli.Read(make([]byte, 1))
		o := <-done
		if o.err == nil && cliErr != nil {
			t.Fatalf("client: %v", cliErr)
		}
		return o.resumed, o.err
	}
	for i, step := range []struct {
		name    string
		policy  *tls.Config
		tickets *caddytls.SessionTicketService
		resumed bool
		// refused: b's allowlist refuses the client, so only a resumed
		// ticket of a's could have let it in.
		refused bool
	}{
		{"first handshake with a", a, nil, false, false},
		{"a again", a, nil, true, false},
		{"a's ticket offered to b", b, nil, false, true},
		{"a after b", a, nil, true, false},
		{"tickets disabled in the tls app", a, &caddytls.SessionTicketService{Disabled: true}, false, false},
	} {
		resumed, err := handshake(step.policy, step.tickets)
		if resumed != step.resumed || (err != nil) != step.refused {
			t.Errorf("%d %s: resumed %v, server error %v; want resumed %v, refused %v", i, step.name, resumed, err, step.resumed, step.refused)
		}
	}
}
