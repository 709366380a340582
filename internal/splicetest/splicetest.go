// Package splicetest holds connections for tests of the relays (splice,
// forward, gateway) that stand in for a kTLS conn without a kernel that
// has kTLS.
package splicetest

import (
	"net"
	"syscall"
	"time"
)

// RecordCloser is a TCP connection that a relay splices both ways (it is a
// splice.Source and a splice.Sink) and whose half-close, as a kTLS conn's,
// first writes a record (close_notify) through the socket's write wait,
// which a deadline in the past refuses before anything is written.
type RecordCloser struct{ *net.TCPConn }

// SpliceSink returns the socket.
func (c RecordCloser) SpliceSink() (syscall.RawConn, bool) {
	rc, err := c.TCPConn.SyscallConn()
	return rc, err == nil
}

// SpliceSource returns the socket.
func (c RecordCloser) SpliceSource() (syscall.RawConn, bool) { return c.SpliceSink() }

// WriteWait is the record's wait for the socket to take writes. It writes
// nothing, and fails as a write would once the connection's write
// deadline has passed.
func (c RecordCloser) WriteWait() error {
	rc, err := c.TCPConn.SyscallConn()
	if err != nil {
		return err
	}
	return writeWait(rc)
}

func writeWait(rc syscall.RawConn) error {
	return rc.Write(func(uintptr) bool { return true })
}

// AwaitPastDeadline waits, up to within, until rc's write wait fails: a
// write deadline in the past is on the socket (a relay's Pause puts one
// there). It writes nothing, and reports whether the deadline came.
func AwaitPastDeadline(rc syscall.RawConn, within time.Duration) bool {
	for end := time.Now().Add(within); time.Now().Before(end); time.Sleep(time.Millisecond) {
		if writeWait(rc) != nil {
			return true
		}
	}
	return false
}

// CloseWrite waits as the record's write would, then half-closes.
func (c RecordCloser) CloseWrite() error {
	if err := c.WriteWait(); err != nil {
		return err
	}
	return c.TCPConn.CloseWrite()
}
