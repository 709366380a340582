package caddyktls

import (
	"crypto/sha256"
	"io"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// A gateway that sends as fast as it can into a tunnel of a sandbox capped
// at max_bandwidth to_sandbox reaches the sandbox at the cap (within ±10 %
// over the measured span, after the burst), every byte exact; the waits
// are counted in caddy_ktls_sandbox_throttled_seconds_total.
func TestSandboxBandwidthCap(t *testing.T) { sandboxBandwidthCap(t, 3*time.Second) }

// TestKernelSandboxBandwidthCap is TestSandboxBandwidthCap on kTLS (the
// spliced path) over 10 s.
func TestKernelSandboxBandwidthCap(t *testing.T) {
	kerneltest.Require(t)
	sandboxBandwidthCap(t, 10*time.Second)
}

func sandboxBandwidthCap(t *testing.T, span time.Duration) {
	const rate = 1 << 20 // bytes per second
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxEnv(t, map[string]any{"max_bandwidth": map[string]any{"to_sandbox": rate}})
	m0 := e.metrics(t)
	c := e.dial(t, uniqueSandbox("sbx-capped"), up.Addr())
	defer c.Close()
	src, h := forwardtest.NewPattern(31), sha256.New()
	var sent int64
	done := make(chan error, 1)
	stop := make(chan struct{})
	go func() {
		buf := make([]byte, 64<<10)
		for {
			select {
			case <-stop:
				done <- c.CloseWrite()
				return
			default:
			}
			src.Read(buf)
			n, err := c.Write(buf)
			h.Write(buf[:n])
			sent += int64(n)
			if err != nil {
				done <- err
				return
			}
		}
	}()
	// The burst and the socket buffers fill in the first second; the cap
	// holds after.
	time.Sleep(time.Second)
	start, at := time.Now(), up.Received()
	time.Sleep(span)
	got := float64(up.Received()-at) / time.Since(start).Seconds()
	close(stop)
	if err := <-done; err != nil {
		t.Fatalf("gateway: %v", err)
	}
	c.SetReadDeadline(time.Now().Add(time.Minute))
	io.Copy(io.Discard, c)
	if got < 0.9*rate || got > 1.1*rate {
		t.Errorf("the sandbox received %.0f B/s over %v, want %d ±10%%", got, span, rate)
	}
	waitIdle(t)
	up.Close()
	if r := up.Results()[0]; r.Received != sent || r.RecvSum != [32]byte(h.Sum(nil)) {
		t.Errorf("the sandbox received %d bytes, the gateway sent %d (or another hash)", r.Received, sent)
	}
	if d := e.metrics(t)[`caddy_ktls_sandbox_throttled_seconds_total{direction="to_sandbox"}`] - m0[`caddy_ktls_sandbox_throttled_seconds_total{direction="to_sandbox"}`]; d < 1 {
		t.Errorf("throttled seconds moved by %d, want the tunnel's waits (most of %v)", d, span)
	}
}
