package tcpfile

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// sockopts reads options' values from c's socket.
func sockopts(t *testing.T, c syscall.Conn) (v [len(options)]int) {
	t.Helper()
	onSocket(t, c, func(fd int) (err error) {
		v, err = get(fd)
		return err
	})
	return v
}

// set puts v on fd, in the options' order.
func set(fd int, v [len(options)]int) error {
	for i, o := range options {
		if err := unix.SetsockoptInt(fd, o.level, o.name, v[i]); err != nil {
			return fmt.Errorf("setting %s: %w", o.what, err)
		}
	}
	return nil
}

// goValues are the options' goValue.
func goValues() (v [len(options)]int) {
	for i, o := range options {
		v[i] = o.goValue
	}
	return v
}

// net.FileConn sets every option to its goValue, which Conn does not set
// again: a Go release that changed one would leave it on the socket.
func TestFileConnSetsGoValues(t *testing.T) {
	_, b := forwardtest.TCPPair(t)
	onSocket(t, b, func(fd int) error { return set(fd, [len(options)]int{0, 600, 60, 4, 0}) })
	f, err := b.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got, want := sockopts(t, c.(syscall.Conn)), goValues(); got != want {
		t.Fatalf("net.FileConn set %v, the table says %v (TCP_NODELAY, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT, SO_KEEPALIVE)", got, want)
	}
}

// onSocket runs fn on c's descriptor, failing t on an error.
func onSocket(t *testing.T, c syscall.Conn, fn func(fd int) error) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := control(rc.Control, fn); err != nil {
		t.Fatal(err)
	}
}

// A socket's Nagle and keepalive settings come through Conn as they were,
// on and off, none of them Go's defaults for a new connection (which
// net.FileConn alone would set: Nagle off, keepalive on at 15 s, 15 s, 9
// probes), and the connection carries bytes: from a file (what a process
// receives) and from a socket of this process (*net.TCPConn), which the
// caller then closes.
func TestConnKeepsOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		want [len(options)]int // TCP_NODELAY, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT, SO_KEEPALIVE
	}{
		{"keepalive-on", [len(options)]int{0, 7, 5, 3, 1}},
		{"keepalive-off", [len(options)]int{1, 600, 60, 4, 0}},
		{"some-as-go-sets-them", [len(options)]int{1, 15, 60, 9, 0}},
		{"all-as-go-sets-them", goValues()},
	} {
		for _, from := range []string{"file", "socket"} {
			t.Run(tc.name+"/"+from, func(t *testing.T) {
				testConnKeepsOptions(t, tc.want, from == "file")
			})
		}
	}
}

func testConnKeepsOptions(t *testing.T, want [len(options)]int, fromFile bool) {
	a, b := forwardtest.TCPPair(t)
	onSocket(t, b, func(fd int) error { return set(fd, want) })
	var s syscall.Conn = b
	if fromFile {
		f, err := b.File()
		if err != nil {
			t.Fatal(err)
		}
		b.Close()
		s = f
	}
	c, err := Conn(s)
	s.(io.Closer).Close()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := sockopts(t, c); got != want {
		t.Errorf("options after Conn %v, want %v (TCP_NODELAY, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT, SO_KEEPALIVE)", got, want)
	}
	if _, err := a.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("read %q, %v through the new Conn", buf, err)
	}
}

// noFile is a syscall.Conn without a File method.
type noFile struct{}

func (noFile) SyscallConn() (syscall.RawConn, error) { return nil, errors.New("unused") }

// A file that is no TCP socket is refused, and so are a socket of this
// process that is no TCP socket and a descriptor holder without a file;
// Conn leaves no descriptor open.
func TestConnRefusesOtherFiles(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	u0, u1 := os.NewFile(uintptr(fds[0]), "unix-0"), os.NewFile(uintptr(fds[1]), "unix-1")
	defer u0.Close()
	defer u1.Close()
	before := kerneltest.OpenFDs(t)
	for _, f := range []*os.File{r, u0} {
		c, err := Conn(f)
		if c != nil || err == nil || !strings.Contains(err.Error(), f.Name()) {
			t.Errorf("Conn(%s) = %v, %v; want an error naming it", f.Name(), c, err)
		}
	}
	uc, err := net.FileConn(u1)
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	before = kerneltest.OpenFDs(t)
	for _, tc := range []struct {
		s    syscall.Conn
		says string
	}{
		{uc.(*net.UnixConn), "reading TCP_NODELAY"},
		{noFile{}, "a tcpfile.noFile has no file"},
	} {
		if c, err := Conn(tc.s); c != nil || err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("Conn(%T) = %v, %v; want an error saying %q", tc.s, c, err, tc.says)
		}
	}
	if after := kerneltest.OpenFDs(t); after != before {
		t.Errorf("%d descriptors open before, %d after the refusals", before, after)
	}
}
