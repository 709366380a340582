package forward

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// BenchmarkSmallCallsBesideBulk: small calls (1 KiB up, 4 KiB down) on
// tunnels of their own sandboxes, one after the other, while bulk tunnels
// of another sandbox stream both ways at full speed through the same
// forwarder (plain TCP: splice on both sides, as with kTLS on both). The
// bulk tunnels' gateway and sandbox run in a peer process (bulkPeerEnv),
// so that their CPU is not the forwarder's scheduler's to share. It
// reports the small calls' latency percentiles, so that the arms with and
// without bulk, side by side in one run, say whether a bulk splice holds
// up small calls (issue 34's fairness goal: p99 at most 2x).
func BenchmarkSmallCallsBesideBulk(b *testing.B) {
	const req, resp = 1 << 10, 4 << 10
	calls := forwardtest.ServeTCP(b, func(c net.Conn) {
		defer c.Close()
		in, out := make([]byte, req), make([]byte, resp)
		for {
			if _, err := io.ReadFull(c, in); err != nil {
				return
			}
			if _, err := c.Write(out); err != nil {
				return
			}
		}
	})
	for _, nBulk := range []int{0, 2} {
		b.Run(fmt.Sprintf("bulk=%d", nBulk), func(b *testing.B) {
			f := newFixture(b, nil)
			if nBulk > 0 {
				startBulkPeer(b, f, nBulk)
			}
			const tunnels = 8
			conns := make([]*net.TCPConn, tunnels)
			for i := range conns {
				conns[i] = f.dial(b)
				if _, err := conns[i].Write(f.gw.Frame(b, fmt.Sprintf("sbx-small-%d", i), netip.MustParseAddrPort(calls))); err != nil {
					b.Fatal(err)
				}
			}
			in, out := make([]byte, resp), make([]byte, req)
			var lat []time.Duration
			for i := 0; b.Loop(); i++ {
				c := conns[i%tunnels]
				start := time.Now()
				if _, err := c.Write(out); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, in); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
			}
			for _, c := range conns {
				c.Close()
			}
			slices.Sort(lat)
			at := func(q float64) float64 { return float64(lat[int(q*float64(len(lat)-1))].Microseconds()) }
			b.ReportMetric(at(0.5), "p50-µs")
			b.ReportMetric(at(0.99), "p99-µs")
			b.ReportMetric(at(0.999), "p99.9-µs")
		})
	}
}

// bulkPeerEnv makes this test binary the bulk peer of
// BenchmarkSmallCallsBesideBulk: a sandbox service that streams zeros
// both ways on every connection, and gateways that open a tunnel to it
// for each line "<forwarder> <frame hex>" read from stdin and stream zeros
// both ways through it, until the peer is killed.
const bulkPeerEnv = "KTLS_BULK_PEER"

func runBulkPeer(in io.Reader, out io.Writer) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	stream := func(c net.Conn) {
		go io.Copy(io.Discard, c)
		buf := make([]byte, 256<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go stream(c)
		}
	}()
	fmt.Fprintln(out, ln.Addr())
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		var addr, frameHex string
		if _, err := fmt.Sscan(sc.Text(), &addr, &frameHex); err != nil {
			return err
		}
		frame, err := hex.DecodeString(frameHex)
		if err != nil {
			return err
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return err
		}
		if _, err := c.Write(frame); err != nil {
			return err
		}
		go stream(c)
	}
	return sc.Err()
}

// startBulkPeer starts the bulk peer with n tunnels through f, streaming
// until the benchmark ends.
func startBulkPeer(b *testing.B, f *fixture, n int) {
	peer := exec.Command(os.Args[0])
	peer.Env = append(os.Environ(), bulkPeerEnv+"=1")
	peer.Stderr = os.Stderr
	stdin, err := peer.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := peer.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := peer.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { peer.Process.Kill(); peer.Wait() })
	var up string
	if _, err := fmt.Fscanln(stdout, &up); err != nil {
		b.Fatal(err)
	}
	for range n {
		frame := f.gw.Frame(b, "sbx-bulk", netip.MustParseAddrPort(up))
		if _, err := fmt.Fprintf(stdin, "%s %x\n", f.ln.Addr(), frame); err != nil {
			b.Fatal(err)
		}
	}
	// The bulk tunnels are open once the forwarder has registered them.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if open, _ := f.reg.Counts(); open >= n {
			return
		} else if time.Now().After(deadline) {
			b.Fatalf("%d bulk tunnels open, want %d", open, n)
		}
	}
}
