package splice

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestRelayPipeShortage: a spliced tunnel whose process runs out of file
// descriptors mid-stream (pipe2 fails with EMFILE) keeps moving exact
// bytes, copying those bursts through userspace and counting them, and
// splices again once descriptors are back.
func TestRelayPipeShortage(t *testing.T) {
	checkLeaks(t)
	tp := newTopology(t)
	pool := newTestPool(t, 0)
	tun := New(tp.relayA, tp.relayB, Options{Pipes: pool})
	res := relayThroughShortage(t, tun, pool, tp.client, tp.client.CloseWrite, tp.upstream)
	checkShortageResult(t, res)
}

// TestKernelRelayPipeShortage is TestRelayPipeShortage through a kTLS
// connection with both directions in the kernel: during the shortage its
// bytes are read and written through the connection's kernel TLS (Read,
// Write), and spliced again afterwards.
func TestKernelRelayPipeShortage(t *testing.T) {
	kerneltest.Require(t)
	ktls.Probe()
	checkLeaks(t)
	var res Stats
	delta := kerneltest.StatDelta(t, func() {
		tp := newKTLSTopology(t, tls.VersionTLS13, ktls.Options{RequireOffload: true})
		pool := newTestPool(t, 0)
		tun := New(tp.server, tp.relayB, Options{Pipes: pool})
		res = relayThroughShortage(t, tun, pool, tp.gateway, tp.gateway.CloseWrite, tp.upstream)
	})
	checkShortageResult(t, res)
	if delta["TlsTxSw"] != 1 || delta["TlsRxSw"] != 1 || delta["TlsDecryptError"] != 0 {
		t.Errorf("tls_stat delta %v, want one TX and one RX offload and no decrypt error", delta)
	}
}

// shortageBurst is what relayThroughShortage echoes in each phase.
const shortageBurst = 1 * MiB

// relayThroughShortage runs tun, whose pipes come from pool (keeping none
// idle), between client and an echo upstream: shortageBurst bytes echo
// while the process can open no descriptor, as many again once it can, then
// the client half-closes. Every byte must come back unchanged; it returns
// the tunnel's outcome.
func relayThroughShortage(t *testing.T, tun *Relay, pool *PipePool, client io.ReadWriter, closeWrite func() error, upstream *net.TCPConn) Stats {
	t.Helper()
	wait := runRelay(t.Context(), tun)
	// Each direction takes a pipe at its start and closes it on finding
	// the source empty. Closed after the descriptors are taken, they would
	// leave two numbers free for the next pipe.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if st := pool.Stats(); st.Created >= 2 && st.Destroyed == st.Created {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the directions' first pipes were not closed: %+v", st)
		}
	}
	upErr := make(chan error, 1)
	go func() { upErr <- echoUpstream(upstream) }()
	echo := func(seed uint64) {
		sent := goSend(client, shortageBurst, seed)
		got := readExact(t, client, shortageBurst)
		if !bytes.Equal(got, sent(t)) {
			t.Fatalf("burst %d came back changed", seed)
		}
	}
	withoutFDs(t, func() {
		echo(1)
		for _, d := range []Direction{AToB, BToA} {
			// A step is counted once its write returned, which may be
			// after the client read its bytes.
			ds := tun.Stats().Dir(d)
			for deadline := time.Now().Add(5 * time.Second); ds.Bytes < shortageBurst && time.Now().Before(deadline); ds = tun.Stats().Dir(d) {
				time.Sleep(time.Millisecond)
			}
			if ds.SpliceBytes != 0 || ds.CopyBytes != shortageBurst || ds.PipeShortages == 0 {
				t.Errorf("%s while out of descriptors: %+v, want all %d bytes copied for want of a pipe", d, ds, shortageBurst)
			}
		}
	})
	echo(2)
	if err := closeWrite(); err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, client); n != 0 || err != nil {
		t.Fatalf("after the echo: %d more bytes, %v; want a clean end", n, err)
	}
	res, err := wait()
	if err := errors.Join(err, <-upErr); err != nil {
		t.Fatal(err)
	}
	return res
}

// checkShortageResult checks the outcome of relayThroughShortage: both
// bursts moved each way, the first copied, the second spliced, except for
// the one Read that a copied burst may have been parked in when
// descriptors came back.
func checkShortageResult(t *testing.T, res Stats) {
	t.Helper()
	for _, d := range []Direction{AToB, BToA} {
		ds := res.Dir(d)
		if !ds.Spliced || ds.End != EndEOF || ds.Bytes != 2*shortageBurst || ds.SpliceBytes+ds.CopyBytes != ds.Bytes ||
			ds.CopyBytes < shortageBurst || ds.CopyBytes > shortageBurst+copyBufferSize || ds.PipeShortages == 0 {
			t.Errorf("%s: %+v, want %d bytes, %d to %d of them copied for want of a pipe, the rest spliced, ended by EOF",
				d, ds, 2*shortageBurst, shortageBurst, shortageBurst+copyBufferSize)
		}
	}
	t.Logf("a->b %+v; b->a %+v", res.AToB, res.BToA)
}

// withoutFDs runs f while this process can open no file descriptor: every
// number up to the highest one open is taken (the gaps by duplicates of
// /dev/null) and RLIMIT_NOFILE's soft limit is lowered to just above it.
// Both are undone before it returns. f must not need a descriptor itself
// (kerneltest.OpenFDs does).
func withoutFDs(t *testing.T, f func()) {
	t.Helper()
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	highest := 0
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil {
			highest = max(highest, fd)
		}
	}
	var fillers []int
	defer func() {
		for _, fd := range fillers {
			unix.Close(fd)
		}
	}()
	for {
		// dup(2) takes the lowest free number: once it returns one above
		// highest, there are no gaps below.
		fd, err := unix.Dup(int(null.Fd()))
		if err != nil {
			t.Fatal(err)
		}
		if fd > highest {
			unix.Close(fd)
			break
		}
		fillers = append(fillers, fd)
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	low := lim
	low.Cur = uint64(highest + 1)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			t.Errorf("restore RLIMIT_NOFILE: %v", err)
		}
	}()
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); !errors.Is(err, unix.EMFILE) {
		if err == nil {
			unix.Close(p[0])
			unix.Close(p[1])
		}
		t.Fatalf("pipe2 with every descriptor taken: %v, want EMFILE", err)
	}
	f()
}
