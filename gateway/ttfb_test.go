package gateway

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// delayLine is a TCP proxy in front of addr that holds every byte, each
// way, for half of rtt: a forwarder rtt away. It opens its connection to
// addr 1.5 rtt after it accepted one, so that a client's first bytes (its
// ClientHello) reach addr when they would across the network: after the
// SYN, the SYN-ACK and half a round trip.
func delayLine(b *testing.B, addr string, rtt time.Duration) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	b.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			upc := make(chan net.Conn, 1)
			wg.Go(func() {
				time.Sleep(3 * rtt / 2)
				up, err := net.Dial("tcp", addr)
				if err != nil {
					c.Close()
					close(upc)
					return
				}
				upc <- up
				delayCopy(func() net.Conn { return c }, up, rtt/2)
			})
			wg.Go(func() {
				delayCopy(sync.OnceValue(func() net.Conn { return <-upc }), c, rtt/2)
			})
		}
	})
	return ln.Addr().String()
}

// delayCopy copies src to dst(), each chunk d after it was read, then
// half-closes dst() (nil: drops what it read).
func delayCopy(dst func() net.Conn, src net.Conn, d time.Duration) {
	type chunk struct {
		b  []byte
		at time.Time
	}
	q := make(chan chunk, 1024)
	go func() {
		defer close(q)
		for {
			b := make([]byte, 32<<10)
			n, err := src.Read(b)
			if n > 0 {
				q <- chunk{b[:n], time.Now().Add(d)}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range q {
		time.Sleep(time.Until(c.at))
		w := dst()
		if w == nil {
			break
		}
		if _, err := w.Write(c.b); err != nil {
			break
		}
	}
	if tc, ok := dst().(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	for range q {
	}
}

// BenchmarkTimeToFirstByte is a new user connection's time to its first
// byte back from the sandbox, with the forwarder rtt away: through a tunnel
// of its own (connect, TLS handshake resumed, preamble: the layer4
// sandbox_proxy), through a standby connection (preamble only), and, for
// comparison, through a tunnel an HTTP Pool keeps (an L7 gateway's
// request on a pooled tunnel). ns/op is the time to first byte.
func BenchmarkTimeToFirstByte(b *testing.B) {
	p := newPKI(b)
	gw := forwardtest.NewGateway(b, "gw-1")
	echo := forwardtest.ServeTCP(b, func(c net.Conn) {
		defer c.Close()
		buf := make([]byte, 1)
		if _, err := io.ReadFull(c, buf); err == nil {
			c.Write(buf)
		}
	})
	web := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("x")) })}
	webLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go web.Serve(webLn)
	b.Cleanup(func() { web.Close() })
	for _, rtt := range []time.Duration{time.Millisecond, 20 * time.Millisecond} {
		f := startForwarderWith(b, p, gw, "127.0.0.0/8", func(c *forward.Config) { c.StandbyTimeout = time.Minute })
		addr := delayLine(b, f.addr(), rtt)
		for _, mode := range []string{"own", "standby", "pool"} {
			b.Run(fmt.Sprintf("rtt=%v/%s", rtt, mode), func(b *testing.B) {
				standby := 0
				if mode == "standby" {
					standby = 1
				}
				d, err := New(Config{TLS: p.client, Signer: gw.Signer, Standby: standby})
				if err != nil {
					b.Fatal(err)
				}
				defer d.Close()
				if mode == "pool" {
					benchPool(b, d, addr, webLn.Addr().String())
					return
				}
				route := Route{Forwarder: addr, Sandbox: "sbx-ttfb", Target: netip.MustParseAddrPort(echo)}
				one := func() {
					c, err := d.Dial(context.Background(), route)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := c.Write([]byte{1}); err != nil {
						b.Fatal(err)
					}
					if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
						b.Fatal(err)
					}
					c.Close()
				}
				one() // the session to resume, and the first standby connection
				for b.Loop() {
					b.StopTimer()
					if standby > 0 {
						for d.standbyReady(addr) == 0 {
							time.Sleep(time.Millisecond)
						}
					}
					b.StartTimer()
					one()
				}
			})
		}
	}
}

// benchPool times an HTTP request through a Pool's pooled tunnel to web:
// what an L7 gateway's request costs once its pool holds a tunnel.
func benchPool(b *testing.B, d *Dialer, forwarder, web string) {
	pool, err := NewPool(PoolConfig{Dialer: d})
	if err != nil {
		b.Fatal(err)
	}
	defer pool.CloseIdleConnections()
	route := Route{Forwarder: forwarder, Sandbox: "sbx-ttfb", Target: netip.MustParseAddrPort(web)}
	one := func() {
		req, err := http.NewRequest(http.MethodGet, "http://sbx-ttfb/", nil)
		if err != nil {
			b.Fatal(err)
		}
		resp, err := pool.RoundTrip(req, route)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(resp.Body, make([]byte, 1)); err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	one() // the pooled tunnel
	for b.Loop() {
		one()
	}
}
