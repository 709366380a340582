package ktls

import (
	"crypto/tls"
	"errors"
	"io"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
)

// TestRefuseUserspace: with TX in crypto/tls (kernel TLS off, as when the
// ULP could not be installed), Refuse still sends access_denied, sealed by
// the package, when nothing was written since the handshake, for a Server
// that sent tickets and for a Client; the peer's bytes in flight are
// drained, so no reset overtakes the alert. Once application data was
// written, or under TLS 1.2, the sequence number is crypto/tls's secret and
// the end is a reset. Runs on every kernel: Disable keeps TX in userspace.
func TestRefuseUserspace(t *testing.T) {
	p := newTestPKI(t)
	for _, c := range []struct {
		name      string
		version   uint16
		client    bool // the ktls end is a Client
		write     int  // bytes it writes before Refuse
		inFlight  int  // bytes the peer sends, unread, before Refuse
		wantAlert bool
	}{
		{"server", tls.VersionTLS13, false, 0, 0, true},
		{"server, peer's bytes in flight", tls.VersionTLS13, false, 0, 256 << 10, true},
		{"client, peer's bytes in flight", tls.VersionTLS13, true, 0, 256 << 10, true},
		{"server after writing", tls.VersionTLS13, false, 10, 0, false},
		{"server, TLS 1.2", tls.VersionTLS12, false, 0, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			scfg, ccfg := p.configs(connCase{version: c.version, tickets: true})
			a, b := loopbackPair(t)
			ours, peer := userspacePair(t, a, b, scfg, ccfg, c.client)
			defer peer.Close()
			defer ours.Close()
			if c.write > 0 {
				if _, err := ours.Write(make([]byte, c.write)); err != nil {
					t.Fatal(err)
				}
			}
			sent := make(chan error, 1)
			go func() {
				_, err := peer.Write(make([]byte, c.inFlight))
				sent <- err
			}()
			if c.inFlight > 0 {
				// Let the bytes reach our receive queue.
				time.Sleep(50 * time.Millisecond)
			}
			if err := ours.Refuse(); err != nil {
				t.Fatalf("Refuse: %v", err)
			}
			_, err := io.Copy(io.Discard, peer)
			err = sockerr.ReadError(peer, err)
			switch {
			case c.wantAlert && (err == nil || !strings.Contains(err.Error(), "access denied")):
				t.Errorf("the peer's read ended with %v, want access denied", err)
			case !c.wantAlert && !errors.Is(err, syscall.ECONNRESET):
				t.Errorf("the peer's read ended with %v, want a reset", err)
			}
			<-sent
		})
	}
}
