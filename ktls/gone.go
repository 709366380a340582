package ktls

import (
	"golang.org/x/sys/unix"
)

// Gone reports whether the peer has left with nothing more for this side
// to read, without reading or blocking: its connection was reset, or it
// ended its side (FIN) with no record queued in the socket and none held
// here. A peer that half-closes sends close_notify first, a record, so a
// FIN alone ends a truncated session: nothing can be carried for it.
//
// Where crypto/tls reads the records (RX in userspace) and this Conn has
// been read since its handshake, crypto/tls may hold a record it read:
// only a reset counts then. False before the handshake ended, after it
// failed, after a handoff, and while a Read is in progress.
func (c *Conn) Gone() bool {
	if !c.hsDone.Load() || c.hsErr != nil || c.handedOff.Load() || c.closing.Load() {
		return false
	}
	if !c.readMu.TryLock() {
		return false
	}
	defer c.readMu.Unlock()
	if len(c.pending) > 0 || len(c.ctrlBuf) > 0 && c.opener != nil || c.notified.Load() || c.readErr != nil {
		return false
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	gone := false
	canPeek := c.kernelRX() || c.opener != nil || !c.readSince.Load()
	controlFD(rc, func(fd int) error {
		info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			return err
		}
		switch info.State {
		case unix.BPF_TCP_CLOSE:
			// A reset: nothing can reach the peer any more.
			gone = true
		case unix.BPF_TCP_CLOSE_WAIT:
			if !canPeek {
				return nil
			}
			// On a kTLS socket a peek decrypts the next record, and
			// reports a control record (close_notify) as one: only
			// the end of the stream reads 0 bytes. The cmsg room is
			// there for it; without, the kernel fails a peek at a
			// control record with EIO.
			var b [1]byte
			oob := make([]byte, unix.CmsgSpace(1))
			n, oobn, _, _, err := unix.Recvmsg(fd, b[:], oob, unix.MSG_PEEK|unix.MSG_DONTWAIT)
			gone = err == nil && n == 0 && parseRecordType(oob[:oobn]) < 0
		}
		return nil
	})
	return gone
}
