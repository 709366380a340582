package ktls

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// TestCloseAfterFailedWriteUserspace: with TX in crypto/tls, a Write that
// fails on its deadline before a byte left has still sealed its record and
// spent its sequence number, so a close_notify after it would carry the
// next number and fail authentication at the peer (bad record MAC; a kTLS
// peer's TlsDecryptError: TestKernelGoClientCloseAfterFailedWrite). Close
// then ends the connection without close_notify, and CloseWrite refuses:
// the peer reads the end of the stream, for a Server and for a Client.
func TestCloseAfterFailedWriteUserspace(t *testing.T) {
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13, tickets: true})
	for _, c := range []struct {
		name       string
		client     bool // the ktls end is a Client
		closeWrite bool // CloseWrite before Close
	}{
		{"server", false, false},
		{"client", true, false},
		{"server, CloseWrite", false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := loopbackPair(t)
			ours, peer := userspacePair(t, a, b, scfg, ccfg, c.client)
			defer peer.Close()
			defer ours.Close()
			ours.SetWriteDeadline(time.Now().Add(-time.Second))
			if n, err := ours.Write([]byte("call")); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("Write past the deadline: %d, %v; want 0, a deadline error", n, err)
			}
			if c.closeWrite {
				if err := ours.CloseWrite(); !errors.Is(err, errCloseNotifyAfterFailedWrite) {
					t.Errorf("CloseWrite after the failed Write: %v, want %v", err, errCloseNotifyAfterFailedWrite)
				}
			}
			if err := ours.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			got, err := io.ReadAll(peer)
			if len(got) != 0 || err != nil {
				t.Errorf("the peer read %d bytes, then %v; want the end of the stream", len(got), err)
			}
		})
	}
}

// userspacePair completes a handshake between a Conn with kernel TLS off
// (a Client on a when client, else a Server on b) and a crypto/tls peer on
// the other end, whose deadline is 10 s away.
func userspacePair(t *testing.T, a, b net.Conn, scfg, ccfg *tls.Config, client bool) (*Conn, *tls.Conn) {
	t.Helper()
	var ours *Conn
	var peer *tls.Conn
	if client {
		ours, peer = Client(a, ccfg, Options{Disable: true}), tls.Server(b, scfg)
	} else {
		ours, peer = Server(b, scfg, Options{Disable: true}), tls.Client(a, ccfg)
	}
	peer.SetDeadline(time.Now().Add(10 * time.Second))
	errc := make(chan error, 1)
	go func() { errc <- peer.Handshake() }()
	if err := ours.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if ours.Offload().TX != ModeUserspace {
		t.Fatalf("TX %v, want userspace", ours.Offload().TX)
	}
	return ours, peer
}
