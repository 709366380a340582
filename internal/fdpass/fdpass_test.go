package fdpass

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// childEnv makes the test binary a child of TestPassTCPToChild (TestMain):
// it receives connections on descriptor 3 and serves them.
const childEnv = "FDPASS_TEST_CHILD"

// Message kinds of the test's protocol.
const (
	kindConns  = 1
	kindResult = 2
)

// job is what the parent asks of the child per connection: read n bytes
// of stream seedIn, then write n bytes of stream seedOut.
type job struct {
	SeedIn, SeedOut uint64
	N               int
}

// result is the child's answer.
type result struct {
	Received  [][32]byte // SHA-256 of what it read, per connection
	FDsBefore int        // its open descriptors before Receive
	FDsAfter  int        // and after closing everything it received
	Err       string
}

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		if err := child(); err != nil {
			fmt.Fprintln(os.Stderr, "fdpass child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// child serves TestPassTCPToChild: one message of jobs and connections in,
// one result out.
func child() error {
	f := os.NewFile(3, "parent")
	c, err := FileConn(f)
	f.Close()
	if err != nil {
		return err
	}
	defer c.Close()
	var res result
	res.FDsBefore = countFDs()
	m, err := Receive(c, Limits{})
	if err != nil {
		return err
	}
	var jobs []job
	if err := json.Unmarshal(m.Payload, &jobs); err != nil || len(jobs) != len(m.Files) {
		m.Close()
		return fmt.Errorf("%d jobs (%v) for %d files", len(jobs), err, len(m.Files))
	}
	conns := make([]net.Conn, len(jobs))
	for i, f := range m.Files {
		conns[i], err = net.FileConn(f)
		if err != nil {
			m.Close()
			return err
		}
	}
	m.Close()
	res.Received = make([][32]byte, len(jobs))
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Go(func() {
			defer conns[i].Close()
			h := sha256.New()
			if _, err := io.CopyN(h, conns[i], int64(j.N)); err != nil {
				errs[i] = err
				return
			}
			res.Received[i] = [32]byte(h.Sum(nil))
			if _, err := io.Copy(conns[i], stream(j.SeedOut, j.N)); err != nil {
				errs[i] = err
				return
			}
			errs[i] = conns[i].(*net.TCPConn).CloseWrite()
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		res.Err = err.Error()
	}
	res.FDsAfter = countFDs()
	b, err := json.Marshal(res)
	if err != nil {
		return err
	}
	return Send(c, kindResult, b)
}

// stream is a deterministic pseudo-random stream of n bytes.
func stream(seed uint64, n int) io.Reader {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	return io.LimitReader(rand.NewChaCha8(key), int64(n))
}

func streamSum(seed uint64, n int) [32]byte {
	h := sha256.New()
	io.Copy(h, stream(seed, n))
	return [32]byte(h.Sum(nil))
}

// countFDs counts this process's open descriptors.
func countFDs() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		panic(err)
	}
	return len(ents)
}

// tcpPair returns the two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server *net.TCPConn) {
	t.Helper()
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
		c.Close()
		t.Fatal(err)
	}
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

// TestPassTCPToChild: three live TCP connections go to another process
// (this test binary, re-executed) in one message and are served there:
// each carries 1 MiB each way after the parent closed its own descriptors,
// SHA-256 checked at both ends, and the child holds as many descriptors
// after closing what it received as before it received.
func TestPassTCPToChild(t *testing.T) {
	const conns, n = 3, 1 << 20
	a, b, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	bf, err := b.File()
	b.Close()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.ExtraFiles = []*os.File{bf}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		bf.Close()
		t.Fatal(err)
	}
	bf.Close()
	defer func() {
		// Closing a ends a child still waiting for a message.
		a.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("child: %v\n%s", err, stderr.String())
		}
	}()

	clients := make([]*net.TCPConn, conns)
	// The sockets go as they are, no *os.File made of them: Send reads
	// each descriptor under its RawConn's Control.
	servers := make([]syscall.Conn, conns)
	jobs := make([]job, conns)
	for i := range conns {
		var server *net.TCPConn
		clients[i], server = tcpPair(t)
		defer clients[i].Close()
		// Bounds a run whose child failed; no assertion depends on it.
		clients[i].SetDeadline(time.Now().Add(2 * time.Minute))
		servers[i] = server
		jobs[i] = job{SeedIn: uint64(10 + i), SeedOut: uint64(20 + i), N: n}
	}
	payload, _ := json.Marshal(jobs)
	err = Send(a, kindConns, payload, servers...)
	for _, s := range servers {
		s.(*net.TCPConn).Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	// The child's descriptors are now the only ones of the servers' sockets.
	got := make([][32]byte, conns)
	errs := make([]error, 2*conns)
	var wg sync.WaitGroup
	for i, c := range clients {
		wg.Go(func() {
			if _, err := io.Copy(c, stream(jobs[i].SeedIn, n)); err != nil {
				errs[2*i] = err
			}
		})
		wg.Go(func() {
			h := sha256.New()
			m, err := io.Copy(h, c)
			if err == nil && m != n {
				err = fmt.Errorf("connection %d: %d bytes back, want %d", i, m, n)
			}
			errs[2*i+1] = err
			got[i] = [32]byte(h.Sum(nil))
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	m, err := Receive(a, Limits{})
	if err != nil {
		t.Fatalf("child's result: %v\n%s", err, stderr.String())
	}
	defer m.Close()
	var res result
	if m.Kind != kindResult || len(m.Files) != 0 || json.Unmarshal(m.Payload, &res) != nil {
		t.Fatalf("child's result: kind %d, %d files, payload %q", m.Kind, len(m.Files), m.Payload)
	}
	if res.Err != "" {
		t.Fatalf("child: %s", res.Err)
	}
	for i, j := range jobs {
		if res.Received[i] != streamSum(j.SeedIn, n) {
			t.Errorf("connection %d: the child read other bytes than the parent sent", i)
		}
		if got[i] != streamSum(j.SeedOut, n) {
			t.Errorf("connection %d: the parent read other bytes than the child sent", i)
		}
	}
	if res.FDsAfter != res.FDsBefore {
		t.Errorf("child: %d descriptors before receiving, %d after closing what it received", res.FDsBefore, res.FDsAfter)
	}
}

// TestSendReceive: a message's kind, payload and descriptors arrive as
// sent; each received descriptor is the sent open file (a pipe's write
// end, written through it), one new slot each until Close.
func TestSendReceive(t *testing.T) {
	a, b, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	var readers []*os.File
	var writers []syscall.Conn
	for range 3 {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		defer w.Close()
		readers, writers = append(readers, r), append(writers, w)
	}
	payload := bytes.Repeat([]byte("state "), 1000)
	if err := Send(a, 7, payload, writers...); err != nil {
		t.Fatal(err)
	}
	before := countFDs()
	m, err := Receive(b, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if m.Kind != 7 || !bytes.Equal(m.Payload, payload) || len(m.Files) != 3 {
		t.Fatalf("kind %d, %d payload bytes, %d files; want 7, %d, 3", m.Kind, len(m.Payload), len(m.Files), len(payload))
	}
	if got := countFDs(); got != before+3 {
		t.Errorf("%d descriptors after Receive, want %d", got, before+3)
	}
	for i, f := range m.Files {
		msg := fmt.Sprintf("through %d", i)
		if _, err := f.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(readers[i], buf); err != nil || string(buf) != msg {
			t.Fatalf("pipe %d: read %q, %v", i, buf, err)
		}
		flags, err := unix.FcntlInt(f.Fd(), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Errorf("received descriptor %d: flags %#x, %v: want close-on-exec", i, flags, err)
		}
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if got := countFDs(); got != before {
		t.Errorf("%d descriptors after Close, want %d", got, before)
	}
	// No descriptors at all is a message too.
	if err := Send(a, 8, nil); err != nil {
		t.Fatal(err)
	}
	if m, err := Receive(b, Limits{}); err != nil || m.Kind != 8 || len(m.Payload) != 0 || len(m.Files) != 0 {
		t.Fatalf("empty message: %+v, %v", m, err)
	}
}

// header builds a message header.
func header(magic string, version, kind, files uint16, payloadLen uint32) []byte {
	h := make([]byte, headerLen)
	copy(h, magic)
	binary.BigEndian.PutUint16(h[4:], version)
	binary.BigEndian.PutUint16(h[6:], kind)
	binary.BigEndian.PutUint16(h[8:], files)
	binary.BigEndian.PutUint32(h[12:], payloadLen)
	return h
}

// rawSend sends msg with count descriptors of /dev/null, bypassing Send's
// checks, and closes its own descriptors.
func rawSend(t *testing.T, c *net.UnixConn, msg []byte, count int) {
	t.Helper()
	var fds []int
	for range count {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		fds = append(fds, fd)
	}
	var oob []byte
	if count > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(msg, oob, nil); err != nil {
		t.Fatal(err)
	}
}

// TestReceiveErrorsCloseDescriptors: every message Receive refuses leaves
// this process with the descriptors it had before the call, whatever
// arrived with it, and the error says what was wrong.
func TestReceiveErrorsCloseDescriptors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		msg   []byte
		fds   int
		lim   Limits
		check func(error) bool
		says  string
	}{
		{"other version", append(header("ktfd", 2, 1, 3, 5), "hello"...), 3, Limits{},
			func(err error) bool { var v *VersionError; return errors.As(err, &v) && v.Got == 2 }, "protocol version 2"},
		{"not ours", append(header("HTTP", 1, 1, 2, 5), "hello"...), 2, Limits{},
			func(err error) bool { return errors.Is(err, ErrMalformed) }, "not an fdpass message"},
		{"too many descriptors", header("ktfd", 1, 1, 8, 0), 8, Limits{Files: 4},
			func(err error) bool { return errors.Is(err, ErrControlTruncated) }, "4 arrived and were closed"},
		{"payload above the limit", append(header("ktfd", 1, 1, 2, 100), make([]byte, 100)...), 2, Limits{Payload: 10},
			func(err error) bool { return errors.Is(err, ErrTruncated) }, "limit 10 bytes"},
		{"fewer descriptors than announced", header("ktfd", 1, 1, 3, 0), 2, Limits{},
			func(err error) bool { return errors.Is(err, ErrMalformed) }, "announces 3 descriptors, 2 arrived"},
		{"more descriptors than announced", header("ktfd", 1, 1, 1, 0), 2, Limits{},
			func(err error) bool { return errors.Is(err, ErrMalformed) }, "announces 1 descriptors, 2 arrived"},
		{"payload length mismatch", append(header("ktfd", 1, 1, 1, 9), "hello"...), 1, Limits{},
			func(err error) bool { return errors.Is(err, ErrMalformed) }, "announces 9 payload bytes, 5 arrived"},
		{"reserved field", func() []byte { h := header("ktfd", 1, 1, 1, 0); h[11] = 1; return h }(), 1, Limits{},
			func(err error) bool { return errors.Is(err, ErrMalformed) }, "reserved"},
		{"shorter than a header", []byte("ktfd\x00"), 1, Limits{},
			func(err error) bool { return errors.Is(err, ErrMalformed) }, "shorter than the header"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b, err := Pair()
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			defer b.Close()
			rawSend(t, a, tc.msg, tc.fds)
			before := countFDs()
			m, err := Receive(b, tc.lim)
			if m != nil || !tc.check(err) || !strings.Contains(fmt.Sprint(err), tc.says) {
				t.Fatalf("Receive = %+v, %v; want the error saying %q", m, err, tc.says)
			}
			if after := countFDs(); after != before {
				t.Fatalf("%d descriptors before Receive, %d after its error: the message's leaked", before, after)
			}
			// The connection goes on: the next message is whole.
			if err := Send(a, 3, []byte("next")); err != nil {
				t.Fatal(err)
			}
			if m, err := Receive(b, tc.lim); err != nil || string(m.Payload) != "next" {
				t.Fatalf("the message after: %+v, %v", m, err)
			}
		})
	}
}

// TestReceiveEOF: the peer's close is io.EOF.
func TestReceiveEOF(t *testing.T) {
	a, b, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	a.Close()
	if m, err := Receive(b, Limits{}); m != nil || err != io.EOF {
		t.Fatalf("Receive after the peer closed = %+v, %v; want io.EOF", m, err)
	}
}

// A Conn, its type checked once, carries a message and its descriptors
// as the package's functions do, and refuses what Send refuses.
func TestConnSendReceive(t *testing.T) {
	a, b, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	ca, err := NewConn(a)
	if err != nil {
		t.Fatal(err)
	}
	cb, err := NewConn(b)
	if err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if err := ca.Send(9, []byte("state"), w); err != nil {
		t.Fatal(err)
	}
	m, err := cb.Receive(Limits{Files: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Kind != 9 || string(m.Payload) != "state" || len(m.Files) != 1 {
		t.Fatalf("kind %d, payload %q, %d files; want 9, \"state\", 1", m.Kind, m.Payload, len(m.Files))
	}
	if _, err := io.WriteString(m.Files[0], "through"); err != nil {
		t.Fatal(err)
	}
	m.Close()
	w.Close()
	if got, err := io.ReadAll(r); string(got) != "through" || err != nil {
		t.Fatalf("read %q (%v) through the passed descriptor", got, err)
	}
	if err := ca.Send(1, nil, make([]syscall.Conn, MaxFiles+1)...); err == nil || !strings.Contains(err.Error(), "at most 253") {
		t.Fatalf("Conn.Send of %d files: %v", MaxFiles+1, err)
	}
}

// TestSendRefuses: Send refuses more descriptors than a message carries,
// and a stream socket (on which messages would run together), and so does
// Receive, and NewConn; nothing is sent.
func TestSendRefuses(t *testing.T) {
	a, b, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	files := make([]syscall.Conn, MaxFiles+1)
	if err := Send(a, 1, nil, files...); err == nil || !strings.Contains(err.Error(), "at most 253") {
		t.Fatalf("Send of %d files: %v", len(files), err)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var streams []*net.UnixConn
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "stream")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		streams = append(streams, c.(*net.UnixConn))
	}
	if err := Send(streams[0], 1, []byte("x")); err == nil || !strings.Contains(err.Error(), "SOCK_SEQPACKET") {
		t.Fatalf("Send on a stream socket: %v", err)
	}
	if _, err := Receive(streams[1], Limits{}); err == nil || !strings.Contains(err.Error(), "SOCK_SEQPACKET") {
		t.Fatalf("Receive on a stream socket: %v", err)
	}
	if c, err := NewConn(streams[0]); c != nil || err == nil || !strings.Contains(err.Error(), "SOCK_SEQPACKET") {
		t.Fatalf("NewConn of a stream socket: %v, %v", c, err)
	}
	f, err := streams[0].File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if c, err := FileConn(f); err == nil {
		c.Close()
		t.Fatal("FileConn took a stream socket")
	}
	// Nothing reached b.
	b.SetReadDeadline(time.Unix(1, 0))
	if _, err := Receive(b, Limits{}); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("b received %v after the refusals", err)
	}
}

// TestPeerCredentials: the peer of a socket pair is this process.
func TestPeerCredentials(t *testing.T) {
	a, b, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	cred, err := PeerCredentials(a)
	if err != nil {
		t.Fatal(err)
	}
	if int(cred.Pid) != os.Getpid() || int(cred.Uid) != os.Getuid() || int(cred.Gid) != os.Getgid() {
		t.Fatalf("peer %+v, want pid %d uid %d gid %d", cred, os.Getpid(), os.Getuid(), os.Getgid())
	}
}
