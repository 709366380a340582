package splice

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/cputest"
)

// BenchmarkRelay moves 1 MiB per iteration client → relay → upstream over
// loopback TCP and reports throughput (MB/s) and the whole process's CPU
// time per GiB relayed (user+system from getrusage: the client writing and
// the upstream discarding are included and are the same for every variant,
// so the differences are the relay's).
//
//   - splice: this package's relay, both sides spliced;
//   - relay-copy: this package's relay on its userspace copy path;
//   - io.Copy-userspace: a plain io.CopyBuffer relay with a 32 KiB buffer,
//     what a relay over userspace TLS connections does;
//   - io.Copy-net: io.Copy between the *net.TCPConns, which Go itself
//     implements with splice(2) (but dies on kTLS control records);
//   - no-relay: the client writes straight into the sink, the cost every
//     variant shares: a variant's cpu-s/GiB minus this one's is the relay's
//     own CPU per GiB.
func BenchmarkRelay(b *testing.B) {
	b.Run("no-relay", func(b *testing.B) { benchRelay(b, nil) })
	b.Run("splice", func(b *testing.B) {
		benchRelay(b, func(a, c *net.TCPConn) { Run(b.Context(), a, c, Options{}) })
	})
	b.Run("relay-copy", func(b *testing.B) {
		benchRelay(b, func(a, c *net.TCPConn) { Run(b.Context(), opaqueConn{a}, c, Options{}) })
	})
	b.Run("io.Copy-userspace", func(b *testing.B) {
		benchRelay(b, func(a, c *net.TCPConn) {
			io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{a}, make([]byte, 32<<10))
			c.CloseWrite()
		})
	})
	b.Run("io.Copy-net", func(b *testing.B) {
		benchRelay(b, func(a, c *net.TCPConn) {
			io.Copy(c, a)
			c.CloseWrite()
		})
	})
}

// benchRelay runs relay between the topology's relay ends; a nil relay
// connects the client to the sink directly.
func benchRelay(b *testing.B, relay func(a, c *net.TCPConn)) {
	const chunk = 1 * MiB
	tp := newTopology(b)
	sink := tp.upstream
	relayDone := make(chan struct{})
	if relay == nil {
		sink = tp.relayA
		close(relayDone)
	} else {
		go func() {
			relay(tp.relayA, tp.relayB)
			close(relayDone)
		}()
	}
	sinkDone := make(chan int64)
	go func() {
		n, _ := io.CopyBuffer(struct{ io.Writer }{io.Discard}, struct{ io.Reader }{sink}, make([]byte, 256<<10))
		sink.CloseWrite() // ends the tunnel's other direction
		sinkDone <- n
	}()
	buf := make([]byte, chunk)
	b.SetBytes(chunk)
	b.ResetTimer()
	cpu0 := cputest.Used(b)
	start := time.Now()
	for range b.N {
		if _, err := tp.client.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	tp.client.CloseWrite()
	got := <-sinkDone
	elapsed := time.Since(start)
	cpu := cputest.Used(b) - cpu0
	b.StopTimer()
	<-relayDone
	if want := int64(b.N) * chunk; got != want {
		b.Fatalf("upstream got %d bytes, want %d", got, want)
	}
	gib := float64(b.N) * chunk / (1 << 30)
	b.ReportMetric(cpu.Seconds()/gib, "cpu-s/GiB")
	b.ReportMetric(float64(b.N)*chunk/1e6/elapsed.Seconds(), "MB/s")
}

// BenchmarkRelaySmallCalls is the small-call shape through the spliced
// relay over loopback TCP: per iteration the client writes a 1 KiB request,
// the upstream answers 4 KiB, and the client reads it. allocs/op counts the
// whole process's allocations per call (the client's and upstream's loops
// allocate none), so it shows what the relay allocates per burst.
func BenchmarkRelaySmallCalls(b *testing.B) {
	tp := newTopology(b)
	done := make(chan struct{})
	go func() {
		Run(b.Context(), tp.relayA, tp.relayB, Options{})
		close(done)
	}()
	go func() {
		req, resp := make([]byte, 1<<10), make([]byte, 4<<10)
		for {
			if _, err := io.ReadFull(tp.upstream, req); err != nil {
				tp.upstream.Close()
				return
			}
			if _, err := tp.upstream.Write(resp); err != nil {
				return
			}
		}
	}()
	req, resp := make([]byte, 1<<10), make([]byte, 4<<10)
	b.ReportAllocs()
	b.SetBytes(5 << 10)
	for b.Loop() {
		if _, err := tp.client.Write(req); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(tp.client, resp); err != nil {
			b.Fatal(err)
		}
	}
	tp.client.CloseWrite()
	io.Copy(io.Discard, tp.client)
	<-done
}
