package ktls

import (
	"crypto/tls"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// TestGone: on the userspace path, a peer that reset, or that ended its
// side without close_notify before anything was read, is gone; one that
// half-closed with close_notify, or sent data, is not, and a Read after
// Gone still gets what it sent. Once the Conn has been read, crypto/tls
// may hold a record: only a reset counts.
func TestGone(t *testing.T) { testGone(t, Options{Disable: true}, false) }

// TestKernelGone: the same with both directions in the kernel, where the
// peek at the socket decrypts the next record: close_notify is a record,
// so a FIN behind it is a half-close; and a Conn already read tells a bare
// FIN too.
func TestKernelGone(t *testing.T) {
	kerneltest.Require(t)
	testGone(t, Options{RequireOffload: true}, true)
}

func testGone(t *testing.T, opts Options, kernel bool) {
	for _, tc := range []struct {
		name     string
		readLast bool // the server read the peer's byte before its end
		peer     func(t *testing.T, client *tls.Conn, raw *net.TCPConn)
		state    uint8 // the server socket's TCP state to wait for
		gone     bool
		read     string // what the server's Read then returns, before EOF
	}{
		{"open", false, func(*testing.T, *tls.Conn, *net.TCPConn) {}, unix.BPF_TCP_ESTABLISHED, false, ""},
		{"fin", false, func(t *testing.T, _ *tls.Conn, raw *net.TCPConn) { must(t, raw.CloseWrite()) }, unix.BPF_TCP_CLOSE_WAIT, true, ""},
		{"close_notify", false, func(t *testing.T, c *tls.Conn, raw *net.TCPConn) {
			must(t, c.CloseWrite())
			must(t, raw.CloseWrite())
		}, unix.BPF_TCP_CLOSE_WAIT, false, ""},
		{"data", false, func(t *testing.T, c *tls.Conn, raw *net.TCPConn) {
			_, err := c.Write([]byte("request"))
			must(t, err)
			must(t, raw.CloseWrite())
		}, unix.BPF_TCP_CLOSE_WAIT, false, "request"},
		{"reset", false, func(t *testing.T, _ *tls.Conn, raw *net.TCPConn) {
			must(t, raw.SetLinger(0))
			must(t, raw.Close())
		}, unix.BPF_TCP_CLOSE, true, ""},
		{"read-then-fin", true, func(t *testing.T, _ *tls.Conn, raw *net.TCPConn) { must(t, raw.CloseWrite()) }, unix.BPF_TCP_CLOSE_WAIT, kernel, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			server, client, raw, srvRaw := gonePair(t, opts)
			if tc.readLast {
				_, err := client.Write([]byte("x"))
				must(t, err)
				var b [1]byte
				if _, err := io.ReadFull(server, b[:]); err != nil {
					t.Fatal(err)
				}
			}
			tc.peer(t, client, raw)
			waitTCPState(t, srvRaw, tc.state)
			if got := server.Gone(); got != tc.gone {
				t.Fatalf("Gone() = %v, want %v", got, tc.gone)
			}
			if tc.gone || tc.state == unix.BPF_TCP_ESTABLISHED {
				return
			}
			server.SetReadDeadline(time.Now().Add(10 * time.Second))
			got, err := io.ReadAll(server)
			if string(got) != tc.read || err != nil {
				t.Errorf("after Gone, Read returned %q, %v; want %q, then EOF", got, err, tc.read)
			}
		})
	}
}

// TestKernelPeekThenSplice: where Gone peeks at a kTLS socket, the kernel
// decrypts the record it peeks at and keeps it for the next read; splice
// (the relay's read) must then return that record's bytes first, in order,
// not the records behind it.
func TestKernelPeekThenSplice(t *testing.T) {
	kerneltest.Require(t)
	server, client, _, _ := gonePair(t, Options{RequireOffload: true})
	for _, r := range []string{"first record", "second record"} {
		_, err := client.Write([]byte(r))
		must(t, err)
	}
	rc, ok := server.SpliceSource()
	if !ok {
		t.Fatal("RX is not in the kernel")
	}
	var peeked [4]byte
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		var n int
		controlFD(rc, func(fd int) error {
			n, _, _, _, _ = unix.Recvmsg(fd, peeked[:], make([]byte, unix.CmsgSpace(1)), unix.MSG_PEEK|unix.MSG_DONTWAIT)
			return nil
		})
		if n == len(peeked) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("nothing to peek at")
		}
	}
	if string(peeked[:]) != "firs" {
		t.Fatalf("peeked %q, want the first record's start", peeked[:])
	}
	var p [2]int
	must(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	var got []byte
	for len(got) < len("first recordsecond record") {
		var n int64
		var serr error
		err := rc.Read(func(fd uintptr) bool {
			n, serr = unix.Splice(int(fd), nil, p[1], nil, 1<<16, unix.SPLICE_F_NONBLOCK)
			return serr != unix.EAGAIN
		})
		if err == nil {
			err = serr
		}
		if err != nil || n == 0 {
			t.Fatalf("splice after %q: %d, %v", got, n, err)
		}
		buf := make([]byte, n)
		if _, err := unix.Read(p[0], buf); err != nil {
			t.Fatal(err)
		}
		got = append(got, buf...)
	}
	if string(got) != "first recordsecond record" {
		t.Errorf("spliced %q after the peek, want the records in order", got)
	}
}

// gonePair is a server Conn (opts) and a crypto/tls client, both
// handshakes done and nothing read or written since.
func gonePair(t *testing.T, opts Options) (server *Conn, client *tls.Conn, raw, srvRaw *net.TCPConn) {
	t.Helper()
	scfg, ccfg := newTestPKI(t).configs(connCase{version: tls.VersionTLS13})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	raw, srvRaw = c.(*net.TCPConn), s.(*net.TCPConn)
	server, client = Server(srvRaw, scfg, opts), tls.Client(raw, ccfg)
	t.Cleanup(func() { client.Close(); server.Close() })
	raw.SetDeadline(time.Now().Add(time.Minute))
	errc := make(chan error, 1)
	go func() { errc <- server.Handshake() }()
	if err := client.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	raw.SetDeadline(time.Time{})
	return server, client, raw, srvRaw
}

// waitTCPState waits until c's socket is in TCP state want.
func waitTCPState(t *testing.T, c *net.TCPConn, want uint8) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		var state uint8
		rc.Control(func(fd uintptr) {
			if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
				state = info.State
			}
		})
		if state == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server's socket is in TCP state %d, want %d", state, want)
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
