package caddyktls

import (
	"crypto/tls"
	"io"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// BenchmarkSandboxTunnelPerCall is the small-per-call shape of the bench
// harness in one process: per iteration a gateway dials the forwarder with
// mutual TLS, writes a signed preamble and 200 bytes, reads the target's
// 1 KiB answer to the end and closes. On a host without kTLS both TLS
// sessions run in userspace; what it profiles is every per-call cost
// besides the kernel's (handshake, preamble verification, layer4 routing,
// logging, metrics, the tunnel registry, the dial, the relay's setup):
//
//	go test -run '^$' -bench 'SandboxTunnelPerCall/x25519$' -benchtime 3000x -cpuprofile cpu.out -o bench.test .
//	go tool pprof -top -cum -focus 'layer4.\(\*Server\).handle' bench.test cpu.out
//
// The gateway's side runs in the same process and is in the profile too.
func BenchmarkSandboxTunnelPerCall(b *testing.B) {
	up := forwardtest.NewUpstream(b, 1<<10)
	e := newSandboxEnv(b, nil)
	req := make([]byte, 200)
	for _, kex := range []struct {
		name   string
		curves []tls.CurveID
		resume bool
	}{
		// The bench harness's gateway offers X25519 alone, so that every
		// contender does the same key exchange; Go's default offers the
		// hybrid X25519MLKEM768 first, and Caddy takes it.
		{"x25519", []tls.CurveID{tls.X25519}, false},
		{"go-default", nil, false},
		// A gateway with a session cache: every handshake but the first
		// resumes (small-per-call-resumed).
		{"x25519-resumed", []tls.CurveID{tls.X25519}, true},
	} {
		b.Run(kex.name, func(b *testing.B) {
			cfg := e.tlsConfig(e.client)
			cfg.CurvePreferences = kex.curves
			if kex.resume {
				cfg.ClientSessionCache = tls.NewLRUClientSessionCache(1)
			}
			b.ReportAllocs()
			for b.Loop() {
				c := e.dialWith(b, cfg, e.gw.Signer, "sbx-bench", up.Addr())
				if _, err := c.Write(req); err != nil {
					b.Fatal(err)
				}
				if err := c.CloseWrite(); err != nil {
					b.Fatal(err)
				}
				if n, err := io.Copy(io.Discard, c); err != nil || n != 1<<10 {
					b.Fatalf("read %d bytes, %v; want 1024", n, err)
				}
				c.Close()
			}
		})
	}
}
