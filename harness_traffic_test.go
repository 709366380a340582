package caddyktls

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// Traffic through a tunnel: gateways (Go and OpenSSL), upstreams that
// stream, trickle or reset, transfers checked by SHA-256, and how each side
// must read the tunnel's end.

// openTunnel is dial with a deadline and an error instead of a test failure.
func (e *sandboxEnv) openTunnel(sandbox string, target netip.AddrPort, timeout time.Duration) (*ktls.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return gatewayDial(ctx, e.addr, e.tlsConfig(e.client), e.gw.Signer, sandbox, target)
}

// tricklingUpstream is a sandbox service that writes chunk pattern bytes
// every pace on each connection until the connection fails, and discards
// what it receives. It stops at test cleanup.
func tricklingUpstream(t *testing.T, chunk int, pace time.Duration) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(2)
			go func() {
				defer wg.Done()
				io.Copy(io.Discard, c)
			}()
			go func() {
				defer wg.Done()
				defer c.Close()
				buf := make([]byte, chunk)
				src := forwardtest.NewPattern(1)
				for {
					src.Read(buf)
					if _, err := c.Write(buf); err != nil {
						return
					}
					time.Sleep(pace)
				}
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// streamOutcome is what a pacedStream client sent and received.
type streamOutcome struct {
	sent, recv       int64
	sentSum, recvSum [32]byte
	err              error
}

// pacedStream writes chunk pattern bytes (seed) on c every pace until stop
// is closed, then half-closes; meanwhile it reads to EOF. It closes c and
// reports both directions' counts and hashes.
func pacedStream(c halfCloser, seed uint64, chunk int, pace time.Duration, stop <-chan struct{}) <-chan streamOutcome {
	return pacedStreamWatched(c, seed, chunk, pace, stop, nil)
}

// streamProgress is a pacedStream's upload as it goes: what a stream that
// does not end had sent, and whether its writer waits in Write.
type streamProgress struct {
	sent    atomic.Int64
	writing atomic.Int64 // when its Write began (UnixNano); 0 outside Write
	ended   atomic.Value // how its writer ended: "half-closed" or the error
}

func (p *streamProgress) String() string {
	s := fmt.Sprintf("sent %d", p.sent.Load())
	if w := p.writing.Load(); w != 0 {
		s += fmt.Sprintf(", in Write for %v", time.Since(time.Unix(0, w)).Round(time.Second))
	}
	if e := p.ended.Load(); e != nil {
		s += fmt.Sprintf(", writer ended: %v", e)
	}
	return s
}

// pacedStreamWatched is pacedStream, its upload's progress kept in p
// (nil: not kept).
func pacedStreamWatched(c halfCloser, seed uint64, chunk int, pace time.Duration, stop <-chan struct{}, p *streamProgress) <-chan streamOutcome {
	if p == nil {
		p = new(streamProgress)
	}
	out := make(chan streamOutcome, 1)
	go func() {
		defer c.Close()
		var o streamOutcome
		werr := make(chan error, 1)
		go func() {
			h := sha256.New()
			src := forwardtest.NewPattern(seed)
			buf := make([]byte, chunk)
			for {
				src.Read(buf)
				p.writing.Store(time.Now().UnixNano())
				_, err := c.Write(buf)
				p.writing.Store(0)
				if err != nil {
					p.ended.Store(err.Error())
					werr <- err
					return
				}
				h.Write(buf)
				o.sent += int64(chunk)
				p.sent.Store(o.sent)
				select {
				case <-stop:
					copy(o.sentSum[:], h.Sum(nil))
					err := c.CloseWrite()
					p.ended.Store(fmt.Sprint("half-closed: ", err))
					werr <- err
					return
				case <-time.After(pace):
				}
			}
		}()
		h := sha256.New()
		o.recv, o.err = io.Copy(h, c)
		copy(o.recvSum[:], h.Sum(nil))
		if err := <-werr; o.err == nil {
			o.err = err
		}
		out <- o
	}()
	return out
}

// gatewayResult is what ossl_gateway.py reports.
type gatewayResult struct {
	Version        string `json:"version"`
	Cipher         string `json:"cipher"`
	StepsDone      int    `json:"steps_done"`
	Error          string `json:"error"`
	Sent           int64  `json:"sent"`
	SentSHA256     string `json:"sent_sha256"`
	Received       int64  `json:"received"`
	ReceivedSHA256 string `json:"received_sha256"`
	KeyUpdates     int    `json:"key_updates"`
	End            string `json:"end"`
}

// opensslGateway runs ossl_gateway.py for one tunnel to target with the
// env's client certificate and an unbound preamble for sandbox, and
// returns its report. Without python3 the test is skipped loudly (failed
// under KTLS_REQUIRE=1, where every kernel test must run).
func (e *sandboxEnv) opensslGateway(t *testing.T, sandbox string, target netip.AddrPort, steps ...string) gatewayResult {
	t.Helper()
	python, err := exec.LookPath("python3")
	if err != nil {
		if kerneltest.Required() {
			t.Fatalf("python3 (the OpenSSL gateway's interpreter) not found: %v", err)
		}
		fmt.Fprintf(os.Stderr, "SKIP: %s: python3 not found: %v\n", t.Name(), err)
		t.Skipf("SKIP: python3 not found: %v", err)
	}
	dir := t.TempDir()
	caFile := e.ca.WriteFile(t, dir, "ca")
	certFile, keyFile := e.client.WriteFiles(t, dir, "gateway")
	preambleFile := filepath.Join(dir, "preamble")
	if err := os.WriteFile(preambleFile, e.gw.Frame(t, sandbox, target), 0o600); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"testdata/ossl_gateway.py", e.addr, caFile, certFile, keyFile, preambleFile}, steps...)
	cmd := exec.CommandContext(t.Context(), python, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("ossl_gateway.py: %v\n%s", err, stderr.String())
	}
	var res gatewayResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("ossl_gateway.py printed %q: %v", out, err)
	}
	t.Logf("OpenSSL gateway: %+v", res)
	return res
}

// rawTunnel opens the mTLS session and writes payload as the "preamble",
// then half-closes when asked.
func (e *sandboxEnv) rawTunnel(t *testing.T, payload []byte, halfClose bool) *tls.Conn {
	t.Helper()
	c, err := tls.Dial("tcp", e.addr, e.tlsConfig(e.client))
	if err != nil {
		t.Fatal(err)
	}
	c.Write(payload)
	if halfClose {
		c.CloseWrite()
	}
	return c
}

// transfer sends `send` pattern bytes (seed) then close_notify, reads to
// EOF, and returns the received count and hash. c is a gateway's TLS
// session, or a raw TCP connection (insecure_plaintext).
// halfCloser is a connection that can end its sending side alone.
type halfCloser interface {
	net.Conn
	CloseWrite() error
}

func transfer(c halfCloser, send int64, seed uint64) (recvN int64, recvSum [32]byte, err error) {
	defer c.Close()
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, io.LimitReader(forwardtest.NewPattern(seed), send))
		// crypto/tls gives the close_notify's write 5 s: queued behind a
		// full send buffer that a loaded VM's forwarder drains slowly, it
		// could time out on the gateway's side.
		if tc, ok := c.(interface{ NetConn() net.Conn }); ok && err == nil {
			if sock, ok := tc.NetConn().(*net.TCPConn); ok {
				err = awaitSendQueueEmpty(sock, 2*time.Minute)
			}
		}
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	h := sha256.New()
	recvN, err = io.Copy(h, c)
	err = sockerr.ReadError(c, err)
	copy(recvSum[:], h.Sum(nil))
	// A write woken by the same reset can take the socket's pending error
	// before the read does: the read then meets the end of the stream,
	// "not pollable", or, in the middle of a record, an unexpected EOF,
	// and the write's error names the end.
	if e := <-werr; err == nil || ((sockerr.NotPollable(err) || errors.Is(err, io.ErrUnexpectedEOF)) && e != nil) {
		err = e
	}
	return recvN, recvSum, err
}

// emptyTunnel carries one tunnel for frame that moves no byte: the
// upstream accepts, the gateway half-closes at once and reads to the end.
func (e *sandboxEnv) emptyTunnel(t *testing.T, frame []byte) {
	t.Helper()
	c := e.rawTunnel(t, frame, true)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Fatalf("tunnel for the frame's first use: read %d bytes, err %v; want a clean empty tunnel", n, err)
	}
}

// checkTunnelTransfer waits for the tunnel to end, closes up and checks
// both directions of a transfer: the upstream received the client's size
// pattern bytes (seed), and the client received the upstream's size+3
// bytes (n, recvSum) unchanged.
// exactTunnel carries size bytes of seed's pattern through a tunnel of
// sandbox to up, and checks every byte both ways (checkTunnelTransfer).
func (e *sandboxEnv) exactTunnel(t testing.TB, sandbox string, up *forwardtest.Upstream, size int64, seed uint64) {
	t.Helper()
	n, sum, err := transfer(e.dial(t, sandbox, up.Addr()), size, seed)
	if err != nil {
		t.Fatalf("tunnel of %s: %v", sandbox, err)
	}
	checkTunnelTransfer(t, up, size, seed, n, sum)
}

func checkTunnelTransfer(t testing.TB, up *forwardtest.Upstream, size int64, seed uint64, n int64, recvSum [32]byte) {
	t.Helper()
	waitIdle(t)
	up.Close()
	r := up.Results()[0]
	if r.Received != size || r.RecvSum != forwardtest.PatternSum(seed, size) {
		t.Errorf("upstream received %d bytes, want %d with the client's hash", r.Received, size)
	}
	if n != size+3 || recvSum != r.SentSum {
		t.Errorf("client received %d bytes, want %d with the upstream's hash", n, size+3)
	}
}

// checkGatewayEnd fails t unless err, how a gateway's read of a TLS 1.3
// tunnel ended, says what the forwarder meant: refused (the access_denied
// alert, gateway.Refused, with TX in the kernel or not) or failed (the
// internal_error alert where TX is in the kernel (kernel); in userspace
// TLS, where crypto/tls sends no alert of the forwarder's choosing after
// data, a reset).
func checkGatewayEnd(t testing.TB, err error, kernel, refused bool) {
	t.Helper()
	var ok bool
	var want string
	switch {
	case refused:
		ok, want = gateway.Refused(err), "the access_denied alert (gateway.Refused)"
	case !kernel:
		ok, want = errors.Is(err, syscall.ECONNRESET), "a reset"
	default:
		ok, want = err != nil && strings.Contains(err.Error(), "remote error: tls: internal error"), "the internal_error alert"
	}
	if !ok {
		t.Errorf("the gateway's read ended with %v, want %s", err, want)
	}
}

// resetUpstream accepts one connection, sends send pattern bytes, reads
// until it has received at least atLeast bytes, waits until the forwarder
// has acknowledged all it sent (a reset drops what is still queued on the
// sender's side, so the bytes would never reach the forwarder), then resets
// the connection (SO_LINGER 0: RST, not FIN). It reports how many bytes it
// received.
func resetUpstream(t *testing.T, send, atLeast int64) (netip.AddrPort, <-chan int64) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	received := make(chan int64, 1)
	go func() {
		c, err := ln.AcceptTCP()
		ln.Close()
		if err != nil {
			received <- -1
			return
		}
		_, werr := io.Copy(c, io.LimitReader(forwardtest.NewPattern(3), send))
		n, rerr := io.CopyN(io.Discard, c, atLeast)
		if werr != nil || rerr != nil {
			t.Errorf("reset upstream: write %v, read %d bytes: %v", werr, n, rerr)
		}
		waitSendQueueEmpty(t, c)
		c.SetLinger(0)
		c.Close()
		received <- n
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort(), received
}

// waitSendQueueEmpty waits, for up to 20 s, until the peer has acknowledged
// every byte written to c.
func waitSendQueueEmpty(t *testing.T, c *net.TCPConn) {
	if err := awaitSendQueueEmpty(c, 20*time.Second); err != nil {
		t.Error(err)
	}
}

// awaitSendQueueEmpty waits, for up to within, until the peer has
// acknowledged every byte written to c (SIOCOUTQ: sent but unacknowledged
// plus unsent).
func awaitSendQueueEmpty(c *net.TCPConn, within time.Duration) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(within); ; time.Sleep(time.Millisecond) {
		queued, qerr := 0, error(nil)
		if err := rc.Control(func(fd uintptr) { queued, qerr = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ) }); err != nil || qerr != nil {
			return fmt.Errorf("SIOCOUTQ: %v %v", err, qerr)
		}
		if queued == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d bytes still unacknowledged after %v", queued, within)
		}
	}
}

// Sizes of a tunnel to a resetUpstream that answers, then resets.
const resetAnswer, resetRequest = 96 << 10, 4 << 10

// checkAnswerThenFailure sends resetRequest bytes on c, a tunnel to a
// resetUpstream that answers resetAnswer bytes and then resets, and checks
// that the gateway reads the whole answer, then the tunnel's failure
// (checkGatewayEnd), and that the sandbox read the request (upReceived).
func checkAnswerThenFailure(t *testing.T, c halfCloser, kernel bool, upReceived <-chan int64) {
	t.Helper()
	defer c.Close()
	if _, err := io.Copy(c, io.LimitReader(forwardtest.NewPattern(6), resetRequest)); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	h := sha256.New()
	got, err := io.Copy(h, c)
	err = sockerr.ReadError(c, err)
	if intact := [32]byte(h.Sum(nil)) == forwardtest.PatternSum(3, resetAnswer); got != resetAnswer || !intact {
		t.Errorf("the gateway read %d bytes (intact: %v); the sandbox answered %d", got, intact, resetAnswer)
	}
	checkGatewayEnd(t, err, kernel, false)
	if n := <-upReceived; n != resetRequest {
		t.Errorf("the sandbox read %d bytes, want %d", n, resetRequest)
	}
}

// checkBothWays checks every client's tunnel end to end, both ways, from
// up's results (call after up.Close): exactly one upstream connection
// received what the client sent (byte count and SHA-256) and sent exactly
// what the client received. It returns the bytes so verified.
func checkBothWays(t testing.TB, up *forwardtest.Upstream, clients []streamOutcome) (verified int64) {
	t.Helper()
	type stream struct {
		n   int64
		sum [32]byte
	}
	replies := map[stream][]stream{} // what a connection received -> what it sent
	for _, r := range up.Results() {
		k := stream{r.Received, r.RecvSum}
		replies[k] = append(replies[k], stream{r.Sent, r.SentSum})
	}
	for i, c := range clients {
		k := stream{c.sent, c.sentSum}
		got := replies[k]
		if len(got) == 0 {
			t.Errorf("tunnel %d: no upstream connection received the %d bytes its client sent", i, c.sent)
			continue
		}
		replies[k] = got[1:]
		if got[0] != (stream{c.recv, c.recvSum}) {
			t.Errorf("tunnel %d: the client received %d bytes, the upstream sent %d (hashes match: %v)", i, c.recv, got[0].n, got[0].sum == c.recvSum)
			continue
		}
		verified += c.sent + c.recv
	}
	return verified
}

// transferResult is how a transfer ended.
type transferResult struct {
	n   int64
	sum [32]byte
	err error
}

// goTransfer runs transfer on a tunnel of sandbox to target in the
// background (one whose target does not answer yet, say) and delivers its
// result.
func (e *sandboxEnv) goTransfer(t *testing.T, sandbox string, target netip.AddrPort, size int64, seed uint64) <-chan transferResult {
	done := make(chan transferResult, 1)
	go func() {
		n, sum, err := transfer(e.dial(t, sandbox, target), size, seed)
		done <- transferResult{n, sum, err}
	}()
	return done
}
