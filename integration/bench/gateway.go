package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// gateway is the client side of every shape: it stands for the edge gateway
// (and its user) and checks every byte that comes back.
type gateway struct {
	// dial opens one tunnel to the forwarder, ready for the header protocol
	// (nil for the HTTP contender).
	dial func(ctx context.Context) (net.Conn, error)
	// base is the HTTPS origin of the HTTP contender ("" for L4 contenders).
	base string
	tls  *tls.Config
	// kernelTX: the gateway seals its records in its own kernel (kTLS TX,
	// RX in userspace), as an edge gateway built on this project's ktls
	// package would. Its writes then hand the kernel many records at once,
	// where crypto/tls writes each record on its own, and that decides how
	// many records the forwarder finds per wake-up. sealed counts the
	// connections it offloaded: their keys show in tls_stat too.
	kernelTX bool
	sealed   atomic.Int64
	// tunnels counts the tunnels dial opened; preambleBytes the preamble
	// frames' bytes written on them.
	tunnels       atomic.Int64
	preambleBytes atomic.Int64
	// resumed counts the TLS connections whose handshake resumed a session
	// (a gateway with a session cache: small-per-call-resumed); certAsked
	// the handshakes in which the server asked for the client certificate.
	resumed, certAsked atomic.Int64
}

// counted makes dial count the tunnels it opens, each bounded by the
// deadline of the context it was opened for: a contender that never ends a
// stream fails the run instead of holding it.
func (g *gateway) counted(dial func(context.Context) (net.Conn, error)) func(context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		c, err := dial(ctx)
		if err != nil {
			return nil, err
		}
		g.tunnels.Add(1)
		if d, ok := ctx.Deadline(); ok {
			c.SetDeadline(d)
		}
		return c, nil
	}
}

// countingConn counts the bytes written through it.
type countingConn struct {
	preamble.Conn
	wrote int64
}

func (c *countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.wrote += int64(n)
	return n, err
}

// pinnedSuite is the one cipher suite of every TLS contender: equal crypto
// work, and the suite the kTLS floor installs. A handshake that picks another
// fails the run instead of skewing it.
const pinnedSuite = tls.TLS_AES_128_GCM_SHA256

// checkConn checks a connection's suite and counts its resumption.
func (g *gateway) checkConn(cs tls.ConnectionState) error {
	if cs.DidResume {
		g.resumed.Add(1)
	}
	return checkSuite(cs)
}

func checkSuite(cs tls.ConnectionState) error {
	if cs.Version != tls.VersionTLS13 || cs.CipherSuite != pinnedSuite {
		return fmt.Errorf("negotiated %s with %s, want TLS 1.3 with %s",
			tls.VersionName(cs.Version), tls.CipherSuiteName(cs.CipherSuite), tls.CipherSuiteName(pinnedSuite))
	}
	return nil
}

// gatewayTLS is the gateway's client config: full handshakes only (no session
// cache; contender.gateway adds one for the resumed shape), X25519 only (HAProxy and nginx on OpenSSL 3.0 lack Go's default
// post-quantum X25519MLKEM768, so every contender does the same key exchange).
// Its client certificate goes only to a server that asks for one: the
// forwarder, which verifies it.
func gatewayTLS(roots *pki) *tls.Config {
	return &tls.Config{
		Certificates:     []tls.Certificate{roots.client},
		RootCAs:          roots.pool,
		ServerName:       "localhost",
		MinVersion:       tls.VersionTLS13,
		CurvePreferences: []tls.CurveID{tls.X25519},
	}
}

// dialTLS opens the gateway's TLS connection to addr, its records sealed by
// crypto/tls or, with kernelTX, by its kernel.
func (g *gateway) dialTLS(ctx context.Context, addr string) (preamble.Conn, error) {
	if !g.kernelTX {
		d := tls.Dialer{Config: g.tls}
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return c.(*tls.Conn), nil
	}
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c := ktls.Client(raw, g.tls, ktls.Options{DisableRX: true, RequireOffload: true})
	if err := c.HandshakeContext(ctx); err != nil {
		c.Close()
		return nil, fmt.Errorf("gateway kTLS: %w", err)
	}
	g.sealed.Add(1)
	return c, nil
}

func plainDialer(addr string) func(context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	}
}

func (g *gateway) tlsDialer(addr string) func(context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		c, err := g.dialTLS(ctx, addr)
		if err != nil {
			return nil, err
		}
		if err := g.checkConn(c.ConnectionState()); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}
}

// preambleDialer is the real gateway: mutual TLS (its certificate goes to
// the forwarder, which asks for one), the preamble bound to the session and
// signed.
func (g *gateway) preambleDialer(addr string, signer *preamble.Signer, target netip.AddrPort) func(context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		c, err := g.dialTLS(ctx, addr)
		if err != nil {
			return nil, err
		}
		err = g.checkConn(c.ConnectionState())
		if err == nil {
			cc := &countingConn{Conn: c}
			err = preamble.Send(ctx, cc, signer, preamble.Claims{SandboxID: "bench", Target: target})
			g.preambleBytes.Add(cc.wrote)
		}
		if err != nil {
			abandon(c)
			return nil, err
		}
		return c, nil
	}
}

// transfer is what one run of a shape did.
type transfer struct {
	bytes     int64           // payload bytes moved, both directions
	calls     int             // small calls completed
	latencies []time.Duration // one per small call
}

// upload sends n bytes and ends its side; the upstream answers the count
// and SHA-256 of all it received up to that end, which must be the n bytes.
func (g *gateway) upload(ctx context.Context, n int64) (transfer, error) {
	want := uploadReply{n: uint64(n), sum: payloadSum(n)}
	if g.dial == nil {
		req, err := g.request(ctx, http.MethodPost, g.base+"/upload", newPayload(bulkSeed, n))
		if err != nil {
			return transfer{}, err
		}
		req.ContentLength = n
		body, err := g.httpDo(g.transport(1, true), req, 128)
		if err != nil {
			return transfer{}, err
		}
		if w := fmt.Sprintf("%d %x", want.n, want.sum); string(body) != w {
			return transfer{}, fmt.Errorf("upload: upstream received %q (bytes, SHA-256), sent %q", body, w)
		}
		return transfer{bytes: n}, nil
	}
	c, err := g.dial(ctx)
	if err != nil {
		return transfer{}, err
	}
	defer c.Close()
	if _, err := c.Write(header{op: opUpload, seed: bulkSeed, n: uint64(n)}.marshal()); err != nil {
		return transfer{}, err
	}
	if _, err := newPayload(bulkSeed, n).WriteTo(c); err != nil {
		return transfer{}, fmt.Errorf("upload: %w", err)
	}
	if err := closeWrite(c); err != nil {
		return transfer{}, fmt.Errorf("upload: ending the upload: %w", err)
	}
	b := make([]byte, uploadReplyLen)
	if _, err := io.ReadFull(c, b); err != nil {
		return transfer{}, fmt.Errorf("upload: reading the upstream's count and SHA-256: %w", err)
	}
	if got := parseUploadReply(b); got != want {
		return transfer{}, fmt.Errorf("upload: upstream received %d bytes with SHA-256 %x, sent %d with %x", got.n, got.sum, want.n, want.sum)
	}
	if err := expectEOF(c); err != nil {
		return transfer{}, fmt.Errorf("upload: after the upstream's answer: %w", err)
	}
	return transfer{bytes: n}, nil
}

func (g *gateway) download(ctx context.Context, n int64) (transfer, error) {
	var body io.ReadCloser
	if g.dial == nil {
		req, err := g.request(ctx, http.MethodGet, g.base+"/download?n="+strconv.FormatInt(n, 10), nil)
		if err != nil {
			return transfer{}, err
		}
		resp, err := g.transport(1, true).RoundTrip(req)
		if err != nil {
			return transfer{}, err
		}
		if err := g.checkResponse(resp); err != nil {
			return transfer{}, err
		}
		body = resp.Body
	} else {
		c, err := g.dial(ctx)
		if err != nil {
			return transfer{}, err
		}
		if _, err := c.Write(header{op: opDownload, seed: bulkSeed, n: uint64(n)}.marshal()); err != nil {
			c.Close()
			return transfer{}, err
		}
		body = c
	}
	defer body.Close()
	sum := sha256.New()
	got, err := io.CopyBuffer(sum, body, make([]byte, 256<<10))
	if err != nil {
		return transfer{}, fmt.Errorf("download: %w after %d bytes", err, got)
	}
	if want := payloadSum(n); got != n || !bytes.Equal(sum.Sum(nil), want[:]) {
		return transfer{}, fmt.Errorf("download: received %d bytes with SHA-256 %x, want %d bytes with %x", got, sum.Sum(nil), n, want)
	}
	return transfer{bytes: n}, nil
}

// small runs calls request/response exchanges over conns concurrent
// workers. reuse keeps one connection per worker; otherwise every call opens
// (and handshakes) its own, and its latency includes that.
//
// With reuse, the calls measured are calls on established connections:
// every worker first opens its connection and makes one call that is not
// counted (the handshake, the preamble and the forwarder's dial to the
// upstream are behind it), then all wait for the others; ready is called
// once they have, before the first measured call. (Connection setup is
// what the per-call shapes measure.) Without reuse, ready is called first.
func (g *gateway) small(ctx context.Context, conns, calls, reqLen, respLen int, reuse bool, ready func()) (transfer, error) {
	var (
		mu     sync.Mutex
		out    transfer
		wg     sync.WaitGroup
		warmed sync.WaitGroup
	)
	errs := make([]error, conns)
	var tr *http.Transport
	if g.dial == nil {
		tr = g.transport(conns, !reuse)
		defer tr.CloseIdleConnections()
	}
	start := make(chan struct{})
	for w := range conns {
		share := calls / conns
		if w < calls%conns {
			share++
		}
		wg.Add(1)
		warmed.Add(1)
		go func() {
			defer wg.Done()
			var lat []time.Duration
			var err error
			// warm makes the uncounted first call of a reused
			// connection, then waits for the other workers.
			warm := func() bool {
				warmed.Done()
				if err != nil {
					return false
				}
				<-start
				return true
			}
			switch {
			case tr != nil && reuse:
				seed := nextSeed()
				if _, err = g.httpCalls(ctx, tr, seed, 0, 1, reqLen, respLen); warm() {
					lat, err = g.httpCalls(ctx, tr, seed, 1, share, reqLen, respLen)
				}
			case tr != nil:
				warmed.Done()
				<-start
				lat, err = g.httpCalls(ctx, tr, nextSeed(), 0, share, reqLen, respLen)
			case reuse:
				lat, err = g.rawCalls(ctx, share, reqLen, respLen, warm)
			default:
				warmed.Done()
				<-start
				for range share {
					var one []time.Duration
					if one, err = g.rawCalls(ctx, 1, reqLen, respLen, nil); err != nil {
						break
					}
					lat = append(lat, one...)
				}
			}
			errs[w] = err
			mu.Lock()
			out.latencies = append(out.latencies, lat...)
			mu.Unlock()
		}()
	}
	warmed.Wait()
	if ready != nil {
		ready()
	}
	close(start)
	wg.Wait()
	out.calls = len(out.latencies)
	out.bytes = int64(out.calls) * int64(reqLen+respLen)
	if err := errors.Join(errs...); err != nil {
		return out, err
	}
	return out, nil
}

// rawCalls makes n calls on one new tunnel with a stream of its own, then
// ends its side and waits for the upstream's end. Without warm, the latency
// of the first call includes the dial, the handshake and (ktls) the
// preamble. With warm, the tunnel first makes one more call, not counted,
// then calls warm, and makes the n calls only if it returns true.
func (g *gateway) rawCalls(ctx context.Context, n, reqLen, respLen int, warm func() bool) ([]time.Duration, error) {
	extra := uint64(0)
	if warm != nil {
		extra = 1
	}
	start := time.Now()
	c, err := g.dial(ctx)
	if err != nil {
		if warm != nil {
			warm()
		}
		return nil, err
	}
	defer c.Close()
	seed := nextSeed()
	if _, err := c.Write(header{op: opSmall, req: uint32(reqLen), resp: uint32(respLen), seed: seed, n: uint64(n) + extra}.marshal()); err != nil {
		if warm != nil {
			warm()
		}
		return nil, err
	}
	req, want, got := make([]byte, reqLen), make([]byte, respLen), make([]byte, respLen)
	lat := make([]time.Duration, 0, n)
	for i := range uint64(n) + extra {
		callBytes(req, want, seed, i)
		if _, err := c.Write(req); err != nil {
			if i < extra {
				warm()
			}
			return lat, err
		}
		if _, err := io.ReadFull(c, got); err != nil {
			if i < extra {
				warm()
			}
			return lat, fmt.Errorf("small call %d: %w", i, err)
		}
		if !bytes.Equal(got, want) {
			if i < extra {
				warm()
			}
			return lat, fmt.Errorf("small call %d: response bytes differ from the payload", i)
		}
		if i < extra {
			if !warm() {
				return lat, nil
			}
		} else {
			lat = append(lat, time.Since(start))
		}
		start = time.Now()
	}
	if err := closeWrite(c); err != nil {
		return lat, fmt.Errorf("small calls: ending the tunnel: %w", err)
	}
	if err := expectEOF(c); err != nil {
		return lat, fmt.Errorf("small calls: after the last response: %w", err)
	}
	return lat, nil
}

// httpCalls makes calls first..first+n-1 of the stream seed.
func (g *gateway) httpCalls(ctx context.Context, tr *http.Transport, seed uint32, first, n, reqLen, respLen int) ([]time.Duration, error) {
	body, want := make([]byte, reqLen), make([]byte, respLen)
	lat := make([]time.Duration, 0, n)
	for i := uint64(first); i < uint64(first+n); i++ {
		start := time.Now()
		callBytes(body, want, seed, i)
		url := fmt.Sprintf("%s/call?seed=%d&i=%d&req=%d&resp=%d", g.base, seed, i, reqLen, respLen)
		req, err := g.request(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return lat, err
		}
		got, err := g.httpDo(tr, req, respLen)
		if err != nil {
			return lat, err
		}
		if !bytes.Equal(got, want) {
			return lat, fmt.Errorf("small call %d: %d response bytes that differ from the payload's %d", i, len(got), respLen)
		}
		lat = append(lat, time.Since(start))
	}
	return lat, nil
}

// transport is an HTTP/1.1-only client transport (reverse_proxy's shape:
// HTTPS in, HTTP/1.1 out) without session resumption.
func (g *gateway) transport(conns int, perCall bool) *http.Transport {
	tr := &http.Transport{
		TLSClientConfig:     g.tls,
		MaxIdleConnsPerHost: conns,
		DisableKeepAlives:   perCall,
		DisableCompression:  true,
	}
	if g.kernelTX {
		tr.DialTLSContext = func(ctx context.Context, _, addr string) (net.Conn, error) { return g.tlsDialer(addr)(ctx) }
	}
	return tr
}

// request is an HTTP request to the HTTP contender, whose Host is the
// name the TLS handshake sends (SNI): Caddy answers 421 to a request for
// another host on a connection whose client it authenticated.
func (g *gateway) request(ctx context.Context, method, url string, body io.Reader) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err == nil {
		req.Host = g.tls.ServerName
	}
	return req, err
}

func (g *gateway) httpDo(tr *http.Transport, req *http.Request, limit int) ([]byte, error) {
	resp, err := tr.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if err := g.checkResponse(resp); err != nil {
		return nil, err
	}
	return io.ReadAll(io.LimitReader(resp.Body, int64(limit)+1))
}

func (g *gateway) checkResponse(resp *http.Response) error {
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		resp.Body.Close()
		return fmt.Errorf("HTTP %s: %s", resp.Status, msg)
	}
	switch {
	case resp.TLS != nil:
		return g.checkConn(*resp.TLS)
	case g.kernelTX:
		// net/http keeps no TLS state of a connection it did not make
		// itself; the gateway's dialer checked this one's suite.
		return nil
	}
	return errors.New("HTTP response without TLS")
}
