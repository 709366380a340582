// Package tcpfile makes a *net.TCPConn of a TCP socket's file without
// changing the socket. net.FileConn treats the socket as a new connection
// and sets Go's defaults on it (TCP_NODELAY, and keepalive on with Go's
// idle time, interval and probe count), on the socket itself, which every
// holder of it shares: a socket that another owner configured (a tunnel
// moved from another process) would lose its liveness settings.
package tcpfile

import (
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// options are the settings net.FileConn overwrites, in the order they are
// put back: the keepalive timers before keepalive itself, so that a socket
// with keepalive on never runs a moment on Go's timers once restored.
// goValue is what net.FileConn sets (TestFileConnSetsGoValues): an option
// that had it already is not set again.
var options = [...]struct {
	level, name int
	what        string
	goValue     int
}{
	{unix.IPPROTO_TCP, unix.TCP_NODELAY, "TCP_NODELAY", 1},
	{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, "TCP_KEEPIDLE", 15},
	{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, "TCP_KEEPINTVL", 15},
	{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, "TCP_KEEPCNT", 9},
	{unix.SOL_SOCKET, unix.SO_KEEPALIVE, "SO_KEEPALIVE", 1},
}

// Conn returns a *net.TCPConn over a descriptor of its own of s, a
// connected TCP socket (a received *os.File, or a socket of this process:
// anything with a File method), with its Nagle and keepalive settings as
// they were before. The caller closes s. A socket that is not TCP is
// refused before anything is set on it.
func Conn(s syscall.Conn) (*net.TCPConn, error) {
	f, ok := s.(*os.File)
	if !ok {
		// A socket of this process: a file of its own first, which
		// net.FileConn duplicates in turn.
		fc, ok := s.(interface{ File() (*os.File, error) })
		if !ok {
			return nil, fmt.Errorf("tcpfile: a %T has no file", s)
		}
		var err error
		if f, err = fc.File(); err != nil {
			return nil, fmt.Errorf("tcpfile: %w", err)
		}
		defer f.Close()
	}
	var saved [len(options)]int
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("tcpfile: %w", err)
	}
	if err := control(rc.Control, func(fd int) (err error) {
		saved, err = get(fd)
		return err
	}); err != nil {
		return nil, fmt.Errorf("tcpfile: %s: %w", f.Name(), err)
	}
	nc, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("tcpfile: %w", err)
	}
	c, ok := nc.(*net.TCPConn)
	if !ok {
		nc.Close()
		return nil, fmt.Errorf("tcpfile: %s is a %T, not a TCP connection", f.Name(), nc)
	}
	crc, err := c.SyscallConn()
	if err == nil {
		err = control(crc.Control, func(fd int) error { return restore(fd, saved) })
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("tcpfile: %s: %w", f.Name(), err)
	}
	return c, nil
}

// get reads the options' values from fd.
func get(fd int) (v [len(options)]int, err error) {
	for i, o := range options {
		if v[i], err = unix.GetsockoptInt(fd, o.level, o.name); err != nil {
			return v, fmt.Errorf("reading %s: %w", o.what, err)
		}
	}
	return v, nil
}

// restore puts v back on fd after net.FileConn, in the options' order,
// but for the options whose value is the one net.FileConn set.
func restore(fd int, v [len(options)]int) error {
	for i, o := range options {
		if v[i] == o.goValue {
			continue
		}
		if err := unix.SetsockoptInt(fd, o.level, o.name, v[i]); err != nil {
			return fmt.Errorf("setting %s: %w", o.what, err)
		}
	}
	return nil
}

// control runs fn on the descriptor that ctl lends.
func control(ctl func(func(uintptr)) error, fn func(fd int) error) error {
	var ferr error
	err := ctl(func(fd uintptr) { ferr = fn(int(fd)) })
	return errors.Join(err, ferr)
}
