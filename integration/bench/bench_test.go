package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// The structural figures come from this parser: every entered syscall
// counts, only socket read/write-family returns count as userspace bytes,
// and of those, the bytes on a connection before a successful kernel key
// install (in any thread's file, by entry time) are pre-offload bytes.
func TestParseStrace(t *testing.T) {
	dir := t.TempDir()
	prefix := filepath.Join(dir, "strace")
	const gw, up = "TCP:[127.0.0.1:19443->127.0.0.1:40000]", "TCP:[127.0.0.1:50000->127.0.0.1:19000]"
	thread1 := `1700000000.000000100 read(7<` + gw + `>, ""..., 5) = 300
1700000000.000000300 write(7<` + gw + `>, ""..., 16384) = 700
1700000000.000000500 read(7<` + gw + `>, ""..., 8) = 160
1700000000.000000600 write(8<` + up + `>, ""..., 16384) = 16384
1700000000.000000700 read(3</etc/hosts>, ""..., 4096) = 100
1700000000.000000710 recvfrom(9<TCPv6:[[::1]:1->[::1]:2]>, ""..., 16384, 0, NULL, NULL) = -1 EAGAIN (Resource temporarily unavailable)
1700000000.000000720 splice(7<` + gw + `>, NULL, 10<pipe:[123]>, NULL, 1048576, SPLICE_F_NONBLOCK) = 65536
1700000000.000000730 connect(9<TCP:[1234]>, {sa_family=AF_INET, sin_port=htons(19000), sin_addr=inet_addr("127.0.0.1")}, 16) = -1 EINPROGRESS (Operation now in progress)
1700000000.000000900 close(7<` + gw + `>) = 0
1700000000.000001000 read(9<` + gw + `>, ""..., 5) = 50
1700000000.000001100 +++ exited with 0 +++
`
	thread2 := `1700000000.000000400 setsockopt(7<` + gw + `>, SOL_TLS, TLS_TX, ""..., 40) = 0
1700000000.000000450 setsockopt(7<` + gw + `>, SOL_TLS, TLS_RX, ""..., 40) = 0
1700000000.000000460 setsockopt(11<socket:[99]>, SOL_TLS, TLS_TX, ""..., 40) = -1 ENOENT (No such file or directory)
1700000000.000000470 sendmsg(11<socket:[99]>, {msg_name=NULL, msg_iov=[{iov_base=""..., iov_len=5}], msg_controllen=0, msg_flags=0}, 0) = 5
1700000000.000000480 epoll_pwait(4<anon_inode:[eventpoll]>,  <detached ...>
1700000000.000000490 recvmsg(7<` + gw + `>, {msg_name=NULL, msg_namelen=0, msg_iov=[{iov_base=""..., iov_len=16384}], msg_iovlen=1, msg_control=[{cmsg_len=17, cmsg_level=SOL_TLS, cmsg_type=0x2}], msg_controllen=24, msg_flags=0}, 0) = 1100
`
	for name, data := range map[string]string{prefix + ".101": thread1, prefix + ".102": thread2} {
		if err := os.WriteFile(name, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	s, err := parseStrace(prefix)
	if err != nil {
		t.Fatal(err)
	}
	if s.Syscalls != 16 {
		t.Errorf("syscalls = %d, want 16 (%+v)", s.Syscalls, s.Top)
	}
	// The TCP reads and writes, the recvfrom (its EAGAIN was entered too),
	// the socket sendmsg and recvmsg, and the splice; not the file read,
	// connect, setsockopt, close or epoll.
	if s.DataSyscalls != 9 {
		t.Errorf("data syscalls = %d, want 9", s.DataSyscalls)
	}
	if want := int64(300 + 700 + 160 + 16384 + 50 + 5 + 1100); s.UserspaceBytes != want {
		t.Errorf("userspace bytes = %d, want %d", s.UserspaceBytes, want)
	}
	// The handshake before TLS_TX; not the preamble after it, the upstream
	// socket's copy, the reused address's bytes with no key after them, or
	// the socket whose install failed.
	if s.PreOffloadBytes != 300+700 {
		t.Errorf("pre-offload bytes = %d, want %d", s.PreOffloadBytes, 300+700)
	}
	// The recvmsg after the key install: a control record.
	if s.ControlRecordBytes != 1100 {
		t.Errorf("control record bytes = %d, want 1100", s.ControlRecordBytes)
	}
	if s.Top[0] != (count{"read", 4}) {
		t.Errorf("top syscall = %+v, want read ×4", s.Top[0])
	}
	for _, c := range []struct {
		sec, frac string
		want      int64
	}{{"1700000000", "000000400", 1700000000_000000400}, {"1700000000", "000001", 1700000000_000001000}, {"", "", 0}} {
		if got := entryTime(c.sec, c.frac); got != c.want {
			t.Errorf("entryTime(%q, %q) = %d, want %d", c.sec, c.frac, got, c.want)
		}
	}
}

// Read and WriteTo give the same stream, and payloadSum is its SHA-256,
// across a block boundary; fillStream from any offset is that stream's
// slice.
func TestPayload(t *testing.T) {
	const pipeLen = writeChunk
	n := int64(pipeLen + 12345)
	var viaRead bytes.Buffer
	if _, err := io.CopyBuffer(&viaRead, struct{ io.Reader }{newPayload(bulkSeed, n)}, make([]byte, 7001)); err != nil {
		t.Fatal(err)
	}
	var viaWriteTo bytes.Buffer
	if _, err := newPayload(bulkSeed, n).WriteTo(&viaWriteTo); err != nil {
		t.Fatal(err)
	}
	if int64(viaRead.Len()) != n || !bytes.Equal(viaRead.Bytes(), viaWriteTo.Bytes()) {
		t.Fatalf("Read gave %d bytes, WriteTo %d, want %d identical", viaRead.Len(), viaWriteTo.Len(), n)
	}
	if sum := sha256.Sum256(viaRead.Bytes()); sum != payloadSum(n) {
		t.Fatal("payloadSum differs from the SHA-256 of the stream")
	}
	for _, off := range []int64{0, 1, 7, 8, 9, pipeLen - 3, pipeLen + 5} {
		for _, l := range []int64{0, 1, 5, 8, 13, 100} {
			b := make([]byte, l)
			fillStream(b, bulkSeed, off)
			if want := viaRead.Bytes()[off : off+l]; !bytes.Equal(b, want) {
				t.Errorf("fillStream(%d bytes at %d) = %x, want %x", l, off, b, want)
			}
		}
	}
}

// No stretch of the stream recurs where a relay's mistake could put it: a
// block later (the pipe's size), a record or a word later, or under another
// tunnel's seed.
func TestPayloadHasNoPeriod(t *testing.T) {
	const pipeLen = 1 << 20
	at := func(seed uint32, off int64) []byte {
		b := make([]byte, 64)
		fillStream(b, seed, off)
		return b
	}
	for _, c := range []struct {
		name         string
		seedA, seedB uint32
		offA, offB   int64
	}{
		{"a block later", bulkSeed, bulkSeed, 4096, pipeLen + 4096},
		{"a record later", bulkSeed, bulkSeed, 0, 16 << 10},
		{"a word later", bulkSeed, bulkSeed, 64, 72},
		{"another seed", 1, 2, 4096, 4096},
		{"the next seed, a word later", 1, 2, 4096, 4104},
	} {
		a, b := at(c.seedA, c.offA), at(c.seedB, c.offB)
		for i := 0; i < len(a); i += 4 {
			if bytes.Equal(a[i:i+4], b[i:i+4]) {
				t.Errorf("%s: bytes %d-%d of seed %d at %d and of seed %d at %d are equal: %x", c.name, i, i+3, c.seedA, c.offA, c.seedB, c.offB, a[i:i+4])
			}
		}
	}
}

func TestHeaderRoundTrip(t *testing.T) {
	h := header{op: opSmall, req: 1024, resp: 4096, seed: 0xdeadbeef, n: 1 << 40}
	got, err := readHeader(bytes.NewReader(h.marshal()))
	if err != nil || got != h {
		t.Fatalf("readHeader = %+v, %v; want %+v", got, err, h)
	}
	if _, err := readHeader(bytes.NewReader(header{op: opSmall, req: maxCallLen + 1}.marshal())); err == nil {
		t.Fatal("readHeader accepted a request above maxCallLen")
	}
}

func TestSpreadAndPercentile(t *testing.T) {
	s := spreadOf([]float64{12, 10, 11})
	if s != (spread{Min: 10, Median: 11, Max: 12, SpreadPct: 18.18}) {
		t.Errorf("spreadOf = %+v", s)
	}
	lat := make([]time.Duration, 100)
	for i := range lat {
		lat[i] = time.Duration(i+1) * time.Microsecond
	}
	if p50, p99 := percentile(lat, 50), percentile(lat, 99); p50 != 50 || p99 != 99 {
		t.Errorf("p50, p99 = %v, %v; want 50, 99", p50, p99)
	}
}

// Every shape end to end through floor-plain's tunnel (floorTunnel, the
// splice relay over plain TCP, runs on any kernel): the gateway's checks
// pass on exact bytes and the byte counts are what the shape promises.
func TestShapesThroughFloorPlain(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up, err := startUpstream()
	if err != nil {
		t.Fatal(err)
	}
	defer up.close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var tunnels sync.WaitGroup
	var accepted atomic.Int64
	defer tunnels.Wait()
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			tunnels.Go(func() {
				if err := floorTunnel(c, nil, up.rawAddr()); err != nil {
					t.Errorf("tunnel: %v", err)
				}
			})
		}
	}()
	g := &gateway{dial: plainDialer(ln.Addr().String())}
	p := params{BulkBytes: 3<<20 + 17, SmallConns: 3, SmallCalls: 20, SmallPerCallCalls: 7, SmallReq: 1000, SmallResp: 5000}
	ctx := t.Context()
	for shape, want := range map[string]struct {
		transfer
		// readyAt: tunnels accepted when the measured part began (-1:
		// ready is not called).
		readyAt int64
	}{
		"upload":         {transfer{bytes: p.BulkBytes}, -1},
		"download":       {transfer{bytes: p.BulkBytes}, -1},
		"small-reuse":    {transfer{bytes: 20 * 6000, calls: 20}, 3},
		"small-per-call": {transfer{bytes: 7 * 6000, calls: 7}, 0},
		// Its first run fills the session cache with one uncounted call.
		"small-per-call-resumed": {transfer{bytes: 7 * 6000, calls: 7}, 1},
	} {
		before, readyAt, readies := accepted.Load(), int64(-1), 0
		got, err := shapeFunc(g, shape, p)(ctx, false, func() { readies++; readyAt = accepted.Load() - before })
		if err != nil {
			t.Fatalf("%s: %v", shape, err)
		}
		if got.bytes != want.bytes || got.calls != want.calls || len(got.latencies) != want.calls {
			t.Errorf("%s: %d bytes, %d calls, %d latencies; want %d bytes, %d calls", shape, got.bytes, got.calls, len(got.latencies), want.bytes, want.calls)
		}
		// small-reuse measures from when every connection is open (and
		// has made its uncounted call), small-per-call-resumed from when
		// its warm-up call is done; the others from the start.
		if readyAt != want.readyAt || (want.readyAt >= 0) != (readies == 1) {
			t.Errorf("%s: ready called %d times, with %d tunnels accepted; want it once at %d (-1: never)", shape, readies, readyAt, want.readyAt)
		}
	}
}

// A payload that differs from what the upstream expects fails the run.
func TestSmallCallRejectsWrongBytes(t *testing.T) {
	up, err := startUpstream()
	if err != nil {
		t.Fatal(err)
	}
	defer up.close()
	c, err := net.Dial("tcp", up.rawAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(header{op: opSmall, req: 4, resp: 8, seed: 3, n: 1}.marshal())
	req, resp := make([]byte, 4), make([]byte, 8)
	callBytes(req, resp, 4, 0) // another tunnel's request
	c.Write(req)
	if n, err := io.ReadFull(c, make([]byte, 8)); err == nil {
		t.Fatalf("upstream answered %d bytes to a wrong request", n)
	}
}

// The untraced count sees every syscall of the process, on the threads it
// had and on threads started meanwhile: 20,000 getpid calls on the test's
// thread, then as many spread over more locked threads than the process had,
// all held at once, so that some of them are new. The breakdown counts them
// as getpid, within the total.
func TestUntracedSyscalls(t *testing.T) {
	const calls = 20000
	before, err := threads(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	workers := len(before) + 2
	var newThreads atomic.Int32
	n, top, err := untracedSyscalls(os.Getpid(), func() error {
		for range calls {
			syscall.Getpid()
		}
		var held, done sync.WaitGroup
		held.Add(workers)
		done.Add(workers)
		for range workers {
			go func() {
				defer done.Done()
				runtime.LockOSThread() // the thread exits with the goroutine
				if !slices.Contains(before, syscall.Gettid()) {
					newThreads.Add(1)
				}
				for range calls / workers {
					syscall.Getpid()
				}
				held.Done()
				held.Wait() // every worker on its own thread at once
			}()
		}
		done.Wait()
		return nil
	})
	if errors.Is(err, errCounter) {
		t.Skipf("SKIP: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if newThreads.Load() == 0 {
		t.Fatalf("no worker ran on a thread started during the count")
	}
	// The runtime adds its own (clone, futex, nanosleep, gettid): a few hundred.
	want := int64(calls + calls/workers*workers)
	if n < want || n > want+3000 {
		t.Errorf("counted %d syscalls, want %d plus the runtime's few", n, want)
	}
	t.Logf("counted %d syscalls, breakdown %+v", n, top)
	var inTop, getpid int64
	for _, c := range top {
		inTop += c.Count
		if c.Name == "getpid" {
			getpid = c.Count
		}
	}
	if getpid < want || getpid > want+100 || inTop > n || top[0].Name != "getpid" {
		t.Errorf("breakdown %+v: want getpid first with %d (plus the runtime's few), all within the %d counted", top, want, n)
	}
}

// The offload check reads the contender's data path from tls_stat, which
// also counts the TX keys of a gateway that seals in its kernel: those are
// taken off, and a contender whose own keys disagree with its claim fails.
func TestOffloadLeavesOutGatewayKeys(t *testing.T) {
	l4, _ := findContender("l4-proxy")
	forwarder, _ := findContender("ktls")
	for _, tc := range []struct {
		name      string
		c         contender
		tx, rx    int64
		gatewayTX int64
		wantErr   bool
	}{
		{"userspace contender, gateway keys only", l4, 5, 0, 5, false},
		{"userspace contender with keys of its own", l4, 6, 0, 5, true},
		{"the same keys without a sealing gateway", l4, 5, 0, 0, true},
		{"kernel contender beside a sealing gateway", forwarder, 10, 5, 5, false},
		{"kernel contender whose TX stayed in userspace", forwarder, 5, 5, 5, true},
	} {
		r := &result{TLSStat: kerneltest.Stat{"TlsTxSw": tc.tx, "TlsRxSw": tc.rx}, GatewayTX: tc.gatewayTX, Tunnels: 5}
		got := offloadOf(r, tc.c)
		if (len(r.Errors) > 0) != tc.wantErr {
			t.Errorf("%s: offload %q, errors %v; want an error: %v", tc.name, got, r.Errors, tc.wantErr)
		}
	}
}

// A kernel direction needs a key install for every tunnel of the cell: one
// install does not vouch for hundreds of tunnels. A userspace direction
// needs none.
func TestKeyInstallsPerTunnel(t *testing.T) {
	forwarder, _ := findContender("ktls")
	rxOff, _ := findContender("ktls-rx-off")
	l4l4, _ := findContender("l4-l4")
	l7l4, _ := findContender("l7-l4")
	l7l7, _ := findContender("l7-l7")
	for _, tc := range []struct {
		name            string
		c               contender
		tx, rx, tunnels int64
		wantErrs        int
	}{
		{"one install each way per tunnel", forwarder, 24, 24, 24, 0},
		{"one install for a cell of 24 tunnels", forwarder, 1, 1, 24, 2},
		{"RX keys on 23 of 24 tunnels", forwarder, 24, 23, 24, 1},
		{"no tunnel, no install", forwarder, 0, 0, 0, 2},
		{"rx off: TX per tunnel, no RX", rxOff, 24, 0, 24, 0},
		{"rx off with RX keys", rxOff, 24, 1, 24, 1},
		// Chains: tunnels are the forwarder's (the upstream's connections).
		{"l4-l4: user, gateway and forwarder sockets", l4l4, 3 * 24, 3 * 24, 24, 0},
		{"l4-l4: the gateway's forwarder socket in userspace", l4l4, 2 * 24, 2 * 24, 24, 2},
		{"l7-l4: gateway and forwarder sockets", l7l4, 2 * 24, 2 * 24, 24, 0},
		{"l7-l4: only the forwarder in the kernel", l7l4, 24, 24, 24, 2},
		{"l7-l4: a cell on pooled tunnels only", l7l4, 0, 0, 0, 0},
		{"l7-l7: no kernel key anywhere", l7l7, 0, 0, 24, 0},
		{"l7-l7 with a kernel key", l7l7, 1, 0, 24, 1},
	} {
		errs := keyInstallErrors(tc.c, tc.tx, tc.rx, tc.tunnels)
		if len(errs) != tc.wantErrs {
			t.Errorf("%s: errors %q, want %d", tc.name, errs, tc.wantErrs)
		}
	}
}

// A zero-copy contender may move through userspace, after its key
// installs, its preambles, a close_notify each way per TLS tunnel and the
// control records recvmsg reads (a record per socket at most); one payload
// byte more fails, whatever the handshakes took before.
func TestZeroCopyAllowance(t *testing.T) {
	const tunnels, frame = 8, 161
	ok := structural{Bytes: 40960, Tunnels: tunnels, PreambleBytes: tunnels * frame, PreOffloadBytes: tunnels * 1067}
	ok.UserspaceBytes = ok.PreOffloadBytes + ok.PreambleBytes + tunnels*alertBytesPerTunnel
	if e := zeroCopyError(&ok, true, 1); e != "" {
		t.Errorf("preambles and alerts only: %s", e)
	}
	copied := ok
	copied.UserspaceBytes++
	if e := zeroCopyError(&copied, true, 1); e == "" {
		t.Error("one byte above the preambles and alerts passed")
	}
	relay := ok // every payload byte read and written in userspace
	relay.UserspaceBytes += 2 * relay.Bytes
	if e := zeroCopyError(&relay, true, 1); e == "" {
		t.Error("a copying relay passed")
	} else {
		t.Log(e)
	}
	plain := structural{Bytes: 1 << 20, Tunnels: 3}
	if e := zeroCopyError(&plain, false, 1); e != "" {
		t.Errorf("plain splice without userspace bytes: %s", e)
	}
	plain.UserspaceBytes = 1
	if e := zeroCopyError(&plain, false, 1); e == "" {
		t.Error("plain splice: a byte through userspace passed")
	}
	// An edge gateway has two kTLS sockets per tunnel, the user's and the
	// forwarder's, each with its close_notify each way.
	gw := ok
	gw.UserspaceBytes += tunnels * alertBytesPerTunnel
	if e := zeroCopyError(&gw, true, 2); e != "" {
		t.Errorf("gateway, preambles and both sockets' alerts: %s", e)
	}
	if e := zeroCopyError(&gw, true, 1); e == "" {
		t.Error("one socket's allowance passed a second socket's alerts")
	}
	gw.UserspaceBytes++
	if e := zeroCopyError(&gw, true, 2); e == "" {
		t.Error("gateway: one byte above its allowance passed")
	}
	// A resuming gateway reads each tunnel's session ticket by recvmsg
	// (control records); payload through recvmsg beyond a record per
	// socket fails.
	tickets := ok
	tickets.ControlRecordBytes = tunnels * 1100
	tickets.UserspaceBytes += tickets.ControlRecordBytes
	if e := zeroCopyError(&tickets, true, 1); e != "" {
		t.Errorf("session tickets as control records: %s", e)
	}
	tickets.ControlRecordBytes = tunnels*maxControlBytesPerSocket + 1
	tickets.UserspaceBytes = ok.UserspaceBytes + tickets.ControlRecordBytes
	if e := zeroCopyError(&tickets, true, 1); e == "" {
		t.Error("payload read through recvmsg passed as control records")
	}
}

// relayThrough is a plain-TCP forwarder for the tests whose direction from
// the gateway (toUpstream) or to it runs through pass, the other through
// io.Copy; each source's EOF half-closes the other side.
func relayThrough(t *testing.T, upstream string, toUpstream bool, pass func(dst io.Writer, src io.Reader)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	copyOf := func(mangle bool) func(dst io.Writer, src io.Reader) {
		if mangle {
			return pass
		}
		return func(dst io.Writer, src io.Reader) { io.Copy(dst, src) }
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", upstream)
			if err != nil {
				c.Close()
				continue
			}
			var wg sync.WaitGroup
			for _, d := range []struct {
				dst, src *net.TCPConn
				f        func(io.Writer, io.Reader)
			}{{u.(*net.TCPConn), c.(*net.TCPConn), copyOf(toUpstream)}, {c.(*net.TCPConn), u.(*net.TCPConn), copyOf(!toUpstream)}} {
				wg.Go(func() {
					d.f(d.dst, d.src)
					d.dst.CloseWrite()
				})
			}
			go func() { wg.Wait(); c.Close(); u.Close() }()
		}
	}()
	return ln.Addr().String()
}

// The payload checks fail a forwarder that appends bytes, swaps or replays
// a 1 MiB stretch (the pipe's size) in either direction, and pass one that
// moves the exact bytes.
func TestPayloadChecksCatchMangling(t *testing.T) {
	up, err := startUpstream()
	if err != nil {
		t.Fatal(err)
	}
	defer up.close()
	const n, pipeLen = 3 << 20, 1 << 20
	// twoBlocks rewrites the first two pipefuls of a direction's stream
	// with f and passes the rest on as it is; skip leaves the header of an
	// upload as it is.
	twoBlocks := func(skip int, f func(b []byte)) func(io.Writer, io.Reader) {
		return func(dst io.Writer, src io.Reader) {
			b := make([]byte, skip+2*pipeLen)
			n, _ := io.ReadFull(src, b)
			if n == len(b) {
				f(b[skip:])
			}
			dst.Write(b[:n])
			io.Copy(dst, src)
		}
	}
	swap := func(b []byte) {
		tmp := slices.Clone(b[:pipeLen])
		copy(b, b[pipeLen:2*pipeLen])
		copy(b[pipeLen:], tmp)
	}
	replay := func(b []byte) { copy(b[pipeLen:], b[:pipeLen]) }
	appendJunk := func(dst io.Writer, src io.Reader) {
		io.Copy(dst, src)
		dst.Write([]byte("junk"))
	}
	exact := func(dst io.Writer, src io.Reader) { io.Copy(dst, src) }
	for _, tc := range []struct {
		name       string
		toUpstream bool
		pass       func(io.Writer, io.Reader)
		shape      string
		wantErr    bool
	}{
		{"exact upload", true, exact, "upload", false},
		{"exact download", false, exact, "download", false},
		{"exact small calls", true, exact, "small-reuse", false},
		{"upload with bytes appended", true, appendJunk, "upload", true},
		{"upload with two blocks swapped", true, twoBlocks(headerLen, swap), "upload", true},
		{"upload with a block replayed", true, twoBlocks(headerLen, replay), "upload", true},
		{"download with bytes appended", false, appendJunk, "download", true},
		{"download with two blocks swapped", false, twoBlocks(0, swap), "download", true},
		{"download with a block replayed", false, twoBlocks(0, replay), "download", true},
		{"small calls with bytes appended to the requests", true, appendJunk, "small-reuse", true},
		{"small calls with bytes appended to the responses", false, appendJunk, "small-reuse", true},
	} {
		g := &gateway{dial: plainDialer(relayThrough(t, up.rawAddr(), tc.toUpstream, tc.pass))}
		p := params{BulkBytes: n, SmallConns: 2, SmallCalls: 6, SmallReq: 1000, SmallResp: 5000}
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		_, err := shapeFunc(g, tc.shape, p)(ctx, false, nil)
		cancel()
		if (err != nil) != tc.wantErr {
			t.Errorf("%s: error %v, want an error: %v", tc.name, err, tc.wantErr)
		} else if err != nil {
			t.Logf("%s: %v", tc.name, err)
		}
	}
}

// TestPKIClientCertificateVerifies: the gateway's client certificate
// verifies for client auth against the run's CA, as the forwarder's
// require_and_verify checks it.
func TestPKIClientCertificateVerifies(t *testing.T) {
	p, err := newPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(p.client.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: p.pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("the gateway's client certificate does not verify: %v", err)
	}
}

// Every measured call of the resumed shape resumes a session: its first run
// fills the gateway's empty session cache before its measured part, and its
// concurrent first calls then find a ticket. (Without that warm-up they
// would race to an empty cache and do full handshakes.)
func TestResumedShapeResumesEveryMeasuredCall(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up, err := startUpstream()
	if err != nil {
		t.Fatal(err)
	}
	defer up.close()
	kp, err := newPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.LoadX509KeyPair(kp.certFile, kp.keyFile)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13})
	if err != nil {
		t.Fatal(err)
	}
	var served sync.WaitGroup
	defer served.Wait()
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			served.Go(func() {
				defer c.Close()
				if err := serveRaw(c); err != nil {
					t.Errorf("upstream: %v", err)
				}
			})
		}
	}()
	env := &runEnv{listen: ln.Addr().String(), up: up, pki: kp}
	g := contender{name: "go-tls", dialKind: "tls"}.gateway(env, true)
	p := params{SmallConns: 4, SmallPerCallCalls: 12, SmallReq: 100, SmallResp: 400}
	do := shapeFunc(g, resumedShape, p)
	for run := range 2 {
		tunnels0, resumed0 := g.tunnels.Load(), g.resumed.Load()
		var atReady, resumedAtReady int64 = -1, -1
		got, err := do(t.Context(), false, func() { atReady, resumedAtReady = g.tunnels.Load()-tunnels0, g.resumed.Load()-resumed0 })
		if err != nil {
			t.Fatalf("run %d: %v", run, err)
		}
		// The first run opens one uncounted tunnel (a full handshake)
		// before its measured part; a later one none.
		warm := int64(0)
		if run == 0 {
			warm = 1
		}
		if atReady != warm || resumedAtReady != 0 {
			t.Errorf("run %d: %d tunnels (%d resumed) before the measured part, want %d (0)", run, atReady, resumedAtReady, warm)
		}
		measured, resumed := g.tunnels.Load()-tunnels0-atReady, g.resumed.Load()-resumed0-resumedAtReady
		if got.calls != p.SmallPerCallCalls || measured != int64(got.calls) || resumed != measured {
			t.Errorf("run %d: %d calls over %d measured tunnels, %d of them resumed; want %d calls, each on a resumed tunnel", run, got.calls, measured, resumed, p.SmallPerCallCalls)
		}
	}
}
