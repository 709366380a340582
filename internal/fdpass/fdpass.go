// Package fdpass passes open file descriptors between processes with a
// message: one SCM_RIGHTS send over a Unix SOCK_SEQPACKET socket carries a
// header, a payload of the caller's (a kind of message says which), and up
// to MaxFiles descriptors. A sequenced-packet socket keeps each message
// whole, so a message and its descriptors arrive together or not at all.
//
// The receiving side is strict, because every descriptor the kernel hands
// over is a slot in this process's table until closed: a message whose
// control data was cut short (more descriptors than the receiver allows:
// MSG_CTRUNC), whose payload was cut short (MSG_TRUNC), whose header is not
// ours or of another version, or whose descriptor count disagrees with the
// header is an error, and on every error path each descriptor that arrived
// is closed. Descriptors arrive close-on-exec.
//
// The package moves bytes and descriptors only. Who may connect is the
// caller's to decide: the socket's file mode, and PeerCredentials.
package fdpass

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Version is the protocol version this package writes and reads.
const Version = 1

// MaxFiles is the most descriptors one message carries (the kernel's
// SCM_MAX_FD).
const MaxFiles = 253

// DefaultMaxPayload is the payload limit when Limits.Payload is zero.
const DefaultMaxPayload = 64 << 10

// headerLen: magic (4), version (2), kind (2), descriptors (2), reserved
// (2), payload length (4); big endian.
const headerLen = 16

var magic = [4]byte{'k', 't', 'f', 'd'}

// Message is one message: what kind it is, its payload, and the files
// received with it, which the receiver owns and closes.
type Message struct {
	Kind    uint16
	Payload []byte
	Files   []*os.File
}

// Close closes every file of m.
func (m *Message) Close() error {
	var errs []error
	for _, f := range m.Files {
		errs = append(errs, f.Close())
	}
	m.Files = nil
	return errors.Join(errs...)
}

// Limits bound what Receive accepts. Zero fields take the defaults.
type Limits struct {
	Files   int // descriptors per message; default and most MaxFiles
	Payload int // payload bytes; default DefaultMaxPayload
}

func (l Limits) files() int {
	if l.Files <= 0 || l.Files > MaxFiles {
		return MaxFiles
	}
	return l.Files
}

func (l Limits) payload() int {
	if l.Payload <= 0 {
		return DefaultMaxPayload
	}
	return l.Payload
}

// Errors of Receive. Every one leaves no received descriptor open.
var (
	// ErrControlTruncated: the message carried more descriptors than the
	// receiver's limit (the kernel set MSG_CTRUNC); those that arrived
	// were closed.
	ErrControlTruncated = errors.New("fdpass: control data truncated: more descriptors than the receiver allows")
	// ErrTruncated: the message was longer than the receiver's payload limit.
	ErrTruncated = errors.New("fdpass: message truncated: payload above the receiver's limit")
	// ErrMalformed: not a message of this protocol, or inconsistent.
	ErrMalformed = errors.New("fdpass: malformed message")
)

// VersionError is a message of another protocol version.
type VersionError struct {
	Got uint16
}

func (e *VersionError) Error() string {
	return fmt.Sprintf("fdpass: message of protocol version %d, this build speaks version %d", e.Got, Version)
}

// Pair returns two connected SOCK_SEQPACKET Unix sockets, close-on-exec.
func Pair() (a, b *net.UnixConn, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("fdpass: socketpair: %w", err)
	}
	if a, err = fileUnixConn(fds[0], "fdpass-a"); err != nil {
		unix.Close(fds[1])
		return nil, nil, err
	}
	if b, err = fileUnixConn(fds[1], "fdpass-b"); err != nil {
		a.Close()
		return nil, nil, err
	}
	return a, b, nil
}

// fileUnixConn makes a *net.UnixConn of fd, which it takes.
func fileUnixConn(fd int, name string) (*net.UnixConn, error) {
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	return FileConn(f)
}

// FileConn returns a *net.UnixConn over a duplicate of f, which must be a
// SOCK_SEQPACKET Unix socket (a child's inherited end of Pair). The caller
// closes f.
func FileConn(f *os.File) (*net.UnixConn, error) {
	c, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("fdpass: %w", err)
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("fdpass: %T is not a Unix socket", c)
	}
	if err := checkSeqpacket(uc); err != nil {
		uc.Close()
		return nil, err
	}
	return uc, nil
}

// checkSeqpacket refuses any socket but SOCK_SEQPACKET: on a stream socket
// messages would run together and descriptors could attach to the wrong one.
func checkSeqpacket(c *net.UnixConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return fmt.Errorf("fdpass: %w", err)
	}
	var typ int
	var serr error
	if err := rc.Control(func(fd uintptr) { typ, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TYPE) }); err != nil {
		return fmt.Errorf("fdpass: %w", err)
	}
	if serr != nil {
		return fmt.Errorf("fdpass: SO_TYPE: %w", serr)
	}
	if typ != unix.SOCK_SEQPACKET {
		return fmt.Errorf("fdpass: socket type %d, want SOCK_SEQPACKET (%d)", typ, unix.SOCK_SEQPACKET)
	}
	return nil
}

// Send sends one message with the descriptors of files (an *os.File, a
// *net.TCPConn: anything with a syscall.RawConn), which stay the caller's:
// the receiver gets its own descriptors of the same open files, as
// *os.File. Each descriptor is read under its RawConn's Control, which
// keeps it open meanwhile and leaves its blocking mode as it is
// (os.File.Fd would put a shared socket into blocking mode for every
// holder), and no descriptor is duplicated to send it.
func Send(c *net.UnixConn, kind uint16, payload []byte, files ...syscall.Conn) error {
	if err := checkSeqpacket(c); err != nil {
		return err
	}
	return send(c, kind, payload, files)
}

// Conn is a SOCK_SEQPACKET Unix socket whose type was checked once, when
// NewConn made it: its Send and Receive are the package's, without asking
// the kernel again for every message.
type Conn struct{ c *net.UnixConn }

// NewConn checks that c is a SOCK_SEQPACKET Unix socket.
func NewConn(c *net.UnixConn) (*Conn, error) {
	if err := checkSeqpacket(c); err != nil {
		return nil, err
	}
	return &Conn{c}, nil
}

// Send is the package's Send on c.
func (c *Conn) Send(kind uint16, payload []byte, files ...syscall.Conn) error {
	return send(c.c, kind, payload, files)
}

// Receive is the package's Receive on c.
func (c *Conn) Receive(lim Limits) (*Message, error) { return receive(c.c, lim) }

func send(c *net.UnixConn, kind uint16, payload []byte, files []syscall.Conn) error {
	if len(files) > MaxFiles {
		return fmt.Errorf("fdpass: %d files, at most %d per message", len(files), MaxFiles)
	}
	if len(payload) > 1<<31 {
		return fmt.Errorf("fdpass: payload of %d bytes", len(payload))
	}
	msg := make([]byte, headerLen, headerLen+len(payload))
	copy(msg, magic[:])
	binary.BigEndian.PutUint16(msg[4:], Version)
	binary.BigEndian.PutUint16(msg[6:], kind)
	binary.BigEndian.PutUint16(msg[8:], uint16(len(files)))
	binary.BigEndian.PutUint32(msg[12:], uint32(len(payload)))
	msg = append(msg, payload...)
	return withFDs(files, nil, func(fds []int) error {
		var oob []byte
		if len(fds) > 0 {
			oob = unix.UnixRights(fds...)
		}
		msgSync.Add(1)
		n, oobn, err := c.WriteMsgUnix(msg, oob, nil)
		if err != nil {
			return fmt.Errorf("fdpass: send: %w", err)
		}
		if n != len(msg) || oobn != len(oob) {
			return fmt.Errorf("fdpass: sent %d of %d bytes, %d of %d control bytes", n, len(msg), oobn, len(oob))
		}
		return nil
	})
}

// msgSync orders, for the race detector, what a goroutine did before it
// sent a message before what a goroutine of the same process does after it
// received it (both ends of a session in one process, as in tests): the
// socket guarantees that order, but the detector sees none through
// sendmsg(2) and recvmsg(2) (package syscall marks read and write only,
// with its ioSync), and reported races that cannot happen.
var msgSync atomic.Int64

// withFDs calls f with the descriptors of files, each held by its
// RawConn's Control so that none is closed meanwhile.
func withFDs(files []syscall.Conn, fds []int, f func([]int) error) error {
	if len(files) == 0 {
		return f(fds)
	}
	rc, err := files[0].SyscallConn()
	if err != nil {
		return fmt.Errorf("fdpass: descriptor %d (%T): %w", len(fds), files[0], err)
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = withFDs(files[1:], append(fds, int(fd)), f) }); err != nil {
		return fmt.Errorf("fdpass: descriptor %d (%T): %w", len(fds), files[0], err)
	}
	return ferr
}

// Receive reads one message within lim. io.EOF: the peer closed the
// connection. On any error no descriptor of the message stays open.
func Receive(c *net.UnixConn, lim Limits) (*Message, error) {
	if err := checkSeqpacket(c); err != nil {
		return nil, err
	}
	return receive(c, lim)
}

func receive(c *net.UnixConn, lim Limits) (*Message, error) {
	bp := receiveBuffer(headerLen + lim.payload())
	defer receiveBuffers.Put(bp)
	buf := *bp
	oob := make([]byte, unix.CmsgSpace(lim.files()*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	msgSync.Load()
	// Descriptors first: whatever else went wrong, the kernel installed
	// them in this process.
	fds, perr := parseRights(oob[:oobn])
	m := &Message{}
	for _, fd := range fds {
		m.Files = append(m.Files, os.NewFile(uintptr(fd), "fdpass-"+strconv.Itoa(fd)))
	}
	fail := func(err error) (*Message, error) {
		m.Close()
		return nil, err
	}
	switch {
	case err != nil && len(fds) == 0 && errors.Is(err, io.EOF):
		return nil, io.EOF
	case err != nil:
		return fail(fmt.Errorf("fdpass: receive: %w", err))
	case perr != nil:
		return fail(perr)
	case flags&unix.MSG_CTRUNC != 0:
		return fail(fmt.Errorf("%w (limit %d; %d arrived and were closed)", ErrControlTruncated, lim.files(), len(fds)))
	case flags&unix.MSG_TRUNC != 0:
		return fail(fmt.Errorf("%w (limit %d bytes)", ErrTruncated, lim.payload()))
	case n < headerLen:
		return fail(fmt.Errorf("%w: %d bytes, shorter than the header", ErrMalformed, n))
	case [4]byte(buf[:4]) != magic:
		return fail(fmt.Errorf("%w: not an fdpass message (magic %q)", ErrMalformed, buf[:4]))
	}
	if v := binary.BigEndian.Uint16(buf[4:]); v != Version {
		return fail(&VersionError{Got: v})
	}
	m.Kind = binary.BigEndian.Uint16(buf[6:])
	if want := int(binary.BigEndian.Uint16(buf[8:])); want != len(fds) {
		return fail(fmt.Errorf("%w: the header announces %d descriptors, %d arrived", ErrMalformed, want, len(fds)))
	}
	if reserved := binary.BigEndian.Uint16(buf[10:]); reserved != 0 {
		return fail(fmt.Errorf("%w: reserved header field %#x", ErrMalformed, reserved))
	}
	if want := int(binary.BigEndian.Uint32(buf[12:])); want != n-headerLen {
		return fail(fmt.Errorf("%w: the header announces %d payload bytes, %d arrived", ErrMalformed, want, n-headerLen))
	}
	m.Payload = append([]byte(nil), buf[headerLen:n]...)
	return m, nil
}

// receiveBuffers hold Receive's buffers, as large as the payload limit:
// a fresh one per message was a large allocation, cleared and often
// faulted in, for a payload that is mostly a few hundred bytes.
var receiveBuffers sync.Pool

// receiveBuffer returns a buffer of n bytes from receiveBuffers, to Put
// back there.
func receiveBuffer(n int) *[]byte {
	if bp, ok := receiveBuffers.Get().(*[]byte); ok && cap(*bp) >= n {
		*bp = (*bp)[:n]
		return bp
	}
	b := make([]byte, n)
	return &b
}

// parseRights returns every descriptor of the SCM_RIGHTS control messages
// in oob. It walks the headers itself: the fds of every well-formed
// SCM_RIGHTS message before a malformed one are returned with the error,
// so that the caller closes them too. Any other control message is an
// error (its descriptors, if it were one, are returned all the same).
func parseRights(oob []byte) ([]int, error) {
	var fds []int
	var err error
	for len(oob) >= unix.SizeofCmsghdr {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		l := int(h.Len)
		if l < unix.SizeofCmsghdr || l > len(oob) {
			return fds, fmt.Errorf("%w: control message of length %d in %d bytes", ErrMalformed, l, len(oob))
		}
		data := oob[unix.CmsgLen(0):l]
		if h.Level == unix.SOL_SOCKET && h.Type == unix.SCM_RIGHTS {
			for i := 0; i+4 <= len(data); i += 4 {
				fds = append(fds, int(int32(binary.NativeEndian.Uint32(data[i:]))))
			}
		} else if err == nil {
			err = fmt.Errorf("%w: unexpected control message level %d type %d", ErrMalformed, h.Level, h.Type)
		}
		next := unix.CmsgSpace(l - unix.CmsgLen(0))
		if next > len(oob) {
			break
		}
		oob = oob[next:]
	}
	return fds, err
}

// PeerCredentials returns the process, user and group of the peer as the
// kernel recorded them when the connection was made (SO_PEERCRED).
func PeerCredentials(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("fdpass: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) { cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return nil, fmt.Errorf("fdpass: %w", err)
	}
	if serr != nil {
		return nil, fmt.Errorf("fdpass: SO_PEERCRED: %w", serr)
	}
	return cred, nil
}
