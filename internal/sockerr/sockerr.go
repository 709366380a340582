// Package sockerr reads what the kernel says about a TCP socket that Go's
// net package hides: the error a reset left pending on it, and whether it
// was reset. The splice relay and the tests of every package use it, so a
// reset is named the same way everywhere. It imports nothing of this module.
package sockerr

import (
	"errors"
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// TCPConn returns the TCP socket under c: c itself, or what its NetConn
// chain (as *tls.Conn offers it) leads to; nil without one.
func TCPConn(c net.Conn) *net.TCPConn {
	for {
		if tc, ok := c.(*net.TCPConn); ok {
			return tc
		}
		nc, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return nil
		}
		c = nc.NetConn()
	}
}

// ReadError returns the error a read on c failed with, except where Go
// reported the failure as "not pollable" (internal/poll.ErrNotPollable):
// epoll can report a reset as EPOLLERR alone (the socket cannot take more
// bytes, so no EPOLLOUT) before the kernel has closed the connection, and a
// read parked in the netpoller then returns without calling read(2). The
// reset is still the TCP socket's pending error (SO_ERROR, reached through
// NetConn), and that is what ReadError returns, as a *os.SyscallError of
// "read". c is the connection that was read, or any connection over the
// same TCP socket.
//
// A write on the same socket, woken by the same reset, can take the pending
// error first (write(2) returns it); the read's error is then left as it
// was, and NotPollable tells the caller to look at the write's.
func ReadError(c net.Conn, err error) error {
	if !NotPollable(err) {
		return err
	}
	if tc := TCPConn(c); tc != nil {
		if errno := pendingError(tc); errno != 0 {
			return os.NewSyscallError("read", errno)
		}
	}
	return err
}

// NotPollable reports whether err is, or wraps, Go's "not pollable".
func NotPollable(err error) bool {
	for ; err != nil; err = errors.Unwrap(err) {
		if err.Error() == "not pollable" {
			return true
		}
	}
	return false
}

// pendingError takes c's pending socket error (SO_ERROR); 0 when none.
func pendingError(c *net.TCPConn) syscall.Errno {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var soErr int
	if rc.Control(func(fd uintptr) { soErr, _ = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR) }) != nil {
		return 0
	}
	return syscall.Errno(soErr)
}

// tcpStateClose is TCP_CLOSE (include/net/tcp_states.h): the state a reset
// leaves a socket in. While we have not sent our FIN, an orderly end (the
// peer's FIN) leaves it in CLOSE_WAIT, and a close_notify without FIN in
// ESTABLISHED; after our FIN, both FINs also end in TCP_CLOSE (the socket
// moves to TIME_WAIT as a separate timewait socket), so the check only
// applies before it.
const tcpStateClose = 7

// Reset reports whether the socket of c (c itself must offer it, as
// syscall.Conn) was reset by its peer.
func Reset(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	var state uint8
	if err := rc.Control(func(fd uintptr) {
		if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			state = info.State
		}
	}); err != nil {
		return false
	}
	return state == tcpStateClose
}
