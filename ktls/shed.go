package ktls

import (
	"errors"
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// shedRecord is a fatal access_denied alert as a plaintext TLS record: the
// record version is TLS 1.2's, as every TLS 1.3 record's outer version.
var shedRecord = []byte{recordAlert, 0x03, 0x03, 0x00, 0x02, alertLevelFatal, AlertAccessDenied}

// Shed refuses c, a server's connection of which no byte has been written,
// before any handshake work: it sends a fatal access_denied alert as a
// plaintext record in place of the ServerHello (before the handshake there
// are no keys, and alerts go in the clear) and closes c. A TLS client
// reports it as the peer's alert during its handshake (crypto/tls:
// "remote error: tls: access denied"; gateway.ErrOverloaded). It costs a
// write and a close: what a server too busy to handshake does instead.
//
// A ClientHello still unread makes the close a reset, which the client
// meets only after the alert: Linux returns the bytes queued before a
// reset first.
func Shed(c net.Conn) error {
	c.SetWriteDeadline(time.Now().Add(RefuseLinger))
	_, err := c.Write(shedRecord)
	return errors.Join(err, c.Close())
}

// ShedFD is Shed for a connection accepted with accept4(2) that was never
// made a net.Conn: a listener that sheds below Go's accept, which would
// register the socket with the netpoller and set its keepalive options
// first. fd is non-blocking and nothing was written on it, so the alert
// fits its send buffer at once (or the peer has gone: the write fails,
// MSG_NOSIGNAL keeps SIGPIPE away); ShedFD then closes fd.
func ShedFD(fd int) error {
	err := unix.Sendto(fd, shedRecord, unix.MSG_NOSIGNAL|unix.MSG_DONTWAIT, nil)
	return errors.Join(err, unix.Close(fd))
}
