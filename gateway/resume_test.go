package gateway

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// A Dialer resumes the TLS session of its earlier connection to the same
// forwarder address, with the preamble bound to the resumed session (the
// forwarder verifies it: the bytes arrive); never another forwarder's
// session, although both forwarders here share ServerName and ticket keys
// and would accept it; and never with DisableResumption. With kTLS the
// ticket reaches the session cache through kernel RX and the resumed
// session is offloaded too.
func dialResumption(t *testing.T, kernel bool) {
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	up := forwardtest.NewUpstream(t, 4<<10)
	fa := startForwarder(t, p, gw, "127.0.0.0/8")
	fb := startForwarder(t, p, gw, "127.0.0.0/8")
	d := newDialer(t, p, gw)
	off, err := New(Config{TLS: p.client, Signer: gw.Signer, DisableResumption: true})
	if err != nil {
		t.Fatal(err)
	}
	kept := ktls.Stats().TicketsKept
	want := forwardtest.PatternSum(2, 4<<10)
	for i, c := range []struct {
		d       *Dialer
		f       *forwarder
		resumed bool
	}{
		{d, fa, false}, {d, fa, true}, {d, fa, true},
		{d, fb, false}, {d, fb, true},
		{off, fa, false}, {off, fa, false},
	} {
		conn, err := c.d.Dial(context.Background(), Route{Forwarder: c.f.addr(), Sandbox: "sbx-1", Target: up.Addr()})
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		if _, err := conn.Write([]byte("request")); err != nil {
			t.Fatal(err)
		}
		conn.CloseWrite()
		var got bytes.Buffer
		_, err = io.Copy(&got, conn)
		conn.Close()
		if err != nil || sha256.Sum256(got.Bytes()) != want {
			t.Fatalf("dial %d: read %d bytes, %v: want the target's 4 KiB", i, got.Len(), err)
		}
		if r := conn.ConnectionState().DidResume; r != c.resumed {
			t.Errorf("dial %d: resumed %v, want %v", i, r, c.resumed)
		}
		if o := conn.Offload(); kernel && (o.Reason != ktls.ReasonNone || o.RX == ktls.ModeUserspace) {
			t.Errorf("dial %d: offload %+v, want TX and RX in the kernel", i, o)
		}
	}
	if got := ktls.Stats().TicketsKept - kept; kernel && got < 5 {
		t.Errorf("%d tickets reached the session caches through kernel RX, want one per resuming dialer's connection (5)", got)
	}
}

func TestDialResumption(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("the kernel has kTLS: TestKernelDialResumption covers it")
	}
	dialResumption(t, false)
}

func TestKernelDialResumption(t *testing.T) {
	kerneltest.Require(t)
	dialResumption(t, true)
}
