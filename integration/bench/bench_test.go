package main

import (
	"bytes"
	"crypto/sha256"
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
// counts, and only socket read/write-family returns count as userspace bytes.
func TestParseStrace(t *testing.T) {
	dir := t.TempDir()
	prefix := filepath.Join(dir, "strace")
	thread1 := `read(7<TCP:[127.0.0.1:19443->127.0.0.1:40000]>, ""..., 32768) = 16406
write(8<TCP:[127.0.0.1:50000->127.0.0.1:19000]>, ""..., 16384) = 16384
read(3</etc/hosts>, ""..., 4096) = 100
recvfrom(9<TCPv6:[[::1]:1->[::1]:2]>, ""..., 16384, 0, NULL, NULL) = -1 EAGAIN (Resource temporarily unavailable)
splice(7<TCP:[127.0.0.1:19443->127.0.0.1:40000]>, NULL, 10<pipe:[123]>, NULL, 1048576, SPLICE_F_NONBLOCK) = 65536
connect(9<TCP:[1234]>, {sa_family=AF_INET, sin_port=htons(19000), sin_addr=inet_addr("127.0.0.1")}, 16) = -1 EINPROGRESS (Operation now in progress)
+++ exited with 0 +++
`
	thread2 := `sendmsg(11<socket:[99]>, {msg_name=NULL, msg_iov=[{iov_base=""..., iov_len=5}], msg_controllen=0, msg_flags=0}, 0) = 5
epoll_pwait(4<anon_inode:[eventpoll]>,  <detached ...>
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
	if s.Syscalls != 8 {
		t.Errorf("syscalls = %d, want 8 (%+v)", s.Syscalls, s.Top)
	}
	// The TCP read, write and recvfrom (its EAGAIN was entered too), the
	// socket sendmsg and the splice; not the file read, connect or epoll.
	if s.DataSyscalls != 5 {
		t.Errorf("data syscalls = %d, want 5", s.DataSyscalls)
	}
	if want := int64(16406 + 16384 + 5); s.UserspaceBytes != want {
		t.Errorf("userspace bytes = %d, want %d", s.UserspaceBytes, want)
	}
	if s.Top[0] != (count{"read", 2}) {
		t.Errorf("top syscall = %+v, want read ×2", s.Top[0])
	}
}

// Read and WriteTo give the same stream, and payloadSum is its SHA-256,
// across a block boundary.
func TestPayload(t *testing.T) {
	n := int64(blockLen + 12345)
	var viaRead bytes.Buffer
	if _, err := io.CopyBuffer(&viaRead, struct{ io.Reader }{newPayload(n)}, make([]byte, 7000)); err != nil {
		t.Fatal(err)
	}
	var viaWriteTo bytes.Buffer
	if _, err := newPayload(n).WriteTo(&viaWriteTo); err != nil {
		t.Fatal(err)
	}
	if int64(viaRead.Len()) != n || !bytes.Equal(viaRead.Bytes(), viaWriteTo.Bytes()) {
		t.Fatalf("Read gave %d bytes, WriteTo %d, want %d identical", viaRead.Len(), viaWriteTo.Len(), n)
	}
	if sum := sha256.Sum256(viaRead.Bytes()); sum != payloadSum(n) {
		t.Fatal("payloadSum differs from the SHA-256 of the stream")
	}
	if !bytes.Equal(viaRead.Bytes()[blockLen:blockLen+100], block[:100]) {
		t.Fatal("the stream does not repeat the block")
	}
}

func TestHeaderRoundTrip(t *testing.T) {
	h := header{op: opSmall, req: 1024, resp: 4096, n: 1 << 40}
	got, err := readHeader(bytes.NewReader(h.marshal()))
	if err != nil || got != h {
		t.Fatalf("readHeader = %+v, %v; want %+v", got, err, h)
	}
	if _, err := readHeader(bytes.NewReader(header{op: opSmall, req: blockLen + 1}.marshal())); err == nil {
		t.Fatal("readHeader accepted a request larger than the payload block")
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
	defer tunnels.Wait()
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
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
	for shape, want := range map[string]transfer{
		"upload":         {bytes: p.BulkBytes},
		"download":       {bytes: p.BulkBytes},
		"small-reuse":    {bytes: 20 * 6000, calls: 20},
		"small-per-call": {bytes: 7 * 6000, calls: 7},
	} {
		got, err := shapeFunc(g, shape, p)(ctx, false)
		if err != nil {
			t.Fatalf("%s: %v", shape, err)
		}
		if got.bytes != want.bytes || got.calls != want.calls || len(got.latencies) != want.calls {
			t.Errorf("%s: %d bytes, %d calls, %d latencies; want %d bytes, %d calls", shape, got.bytes, got.calls, len(got.latencies), want.bytes, want.calls)
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
	c.Write(header{op: opSmall, req: 4, resp: 8, n: 1}.marshal())
	c.Write([]byte("nope"))
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
		r := &result{TLSStat: kerneltest.Stat{"TlsTxSw": tc.tx, "TlsRxSw": tc.rx}, GatewayTX: tc.gatewayTX}
		got := offloadOf(r, tc.c)
		if (len(r.Errors) > 0) != tc.wantErr {
			t.Errorf("%s: offload %q, errors %v; want an error: %v", tc.name, got, r.Errors, tc.wantErr)
		}
	}
}
