package ktls

import (
	"encoding/binary"
	"io"
	"net"
	"sync/atomic"
	"time"
)

const (
	recordHeaderLen = 5
	// helloPrefixLen covers a record header, the handshake header (4), the
	// legacy version (2) and the 32-byte random of a ServerHello.
	helloPrefixLen = recordHeaderLen + 4 + 2 + 32
)

// recordConn is the conn crypto/tls handshakes over. Its Read never returns
// a byte past the end of the current TLS record: crypto/tls over-reads by
// design (readFromUntil grows its buffer by needs+512), and a peer that sends
// application data in the same segment as its Finished would otherwise lose
// those records into the abandoned tls.Conn instead of the kernel's RX queue.
//
// It also keeps the first bytes each way, from which the ServerHello random
// (needed for TLS 1.2 key expansion, which the key log does not carry) is
// taken.
type recordConn struct {
	net.Conn
	header    [recordHeaderLen]byte
	headerLen int // bytes of header read so far
	remaining int // body bytes of the current record not yet returned

	firstIn, firstOut []byte // first helloPrefixLen bytes read and written

	// eof: a Read of the raw conn returned io.EOF. crypto/tls returns
	// io.EOF for close_notify and for the peer's FIN alike; only the FIN
	// comes through here.
	eof atomic.Bool
	// writes counts Write calls (ktls.Conn.refuseInUserspace).
	writes atomic.Int64

	// closeWriting: CloseWrite is sending close_notify on the userspace
	// path, whose write is bounded by the caller's write deadline alone
	// (SetWriteDeadline).
	closeWriting atomic.Bool

	// fed, while feeding: one record for crypto/tls to read instead of the
	// socket (ticket.go), then errTicketFed. Nothing is written meanwhile.
	fed     []byte
	feeding bool
}

// feed makes Read return record, then errTicketFed; nil ends feeding.
func (c *recordConn) feed(record []byte) { c.fed, c.feeding = record, record != nil }

func newRecordConn(c net.Conn) *recordConn { return &recordConn{Conn: c} }

// Read returns bytes of at most the current record.
func (c *recordConn) Read(p []byte) (int, error) {
	if c.feeding {
		if len(c.fed) == 0 {
			return 0, errTicketFed
		}
		n := copy(p, c.fed)
		c.fed = c.fed[n:]
		return n, nil
	}
	n, err := c.readBounded(p)
	if err == io.EOF {
		c.eof.Store(true)
	}
	if n > 0 && len(c.firstIn) < helloPrefixLen {
		c.firstIn = appendUpTo(c.firstIn, p[:n], helloPrefixLen)
	}
	return n, err
}

func (c *recordConn) readBounded(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if c.headerLen < recordHeaderLen {
		// In a header: read at most its rest, so the length is known
		// before any body byte is asked for.
		want := min(recordHeaderLen-c.headerLen, len(p))
		n, err := c.Conn.Read(p[:want])
		copy(c.header[c.headerLen:], p[:n])
		c.headerLen += n
		if c.headerLen == recordHeaderLen {
			c.remaining = int(binary.BigEndian.Uint16(c.header[3:5]))
			if c.remaining == 0 {
				c.headerLen = 0 // an empty record ends with its header
			}
		}
		return n, err
	}
	n, err := c.Conn.Read(p[:min(len(p), c.remaining)])
	c.remaining -= n
	if c.remaining == 0 {
		c.headerLen = 0
	}
	return n, err
}

// Write passes through, keeping the first bytes written.
func (c *recordConn) Write(p []byte) (int, error) {
	if c.feeding {
		// crypto/tls's alert about a fed record: the socket belongs to
		// the kernel, and our own end follows from the error.
		return 0, errTicketFed
	}
	c.writes.Add(1)
	if len(c.firstOut) < helloPrefixLen {
		c.firstOut = appendUpTo(c.firstOut, p, helloPrefixLen)
	}
	return c.Conn.Write(p)
}

// SetWriteDeadline passes through, except while closeWriting: crypto/tls
// bounds its close_notify with a fixed 5-second write deadline of its own
// (tls.Conn.closeNotify), which fails a half-close behind a peer that
// reads slowly, or a process slow to run, and loses the end of the stream
// for good. The caller's deadline, set on the raw conn, stays in force.
func (c *recordConn) SetWriteDeadline(t time.Time) error {
	if c.closeWriting.Load() {
		return nil
	}
	return c.Conn.SetWriteDeadline(t)
}

// atRecordBoundary reports whether no partial record has been consumed, so
// everything still unread is in the kernel's receive queue.
func (c *recordConn) atRecordBoundary() bool { return c.headerLen == 0 }

// serverRandom extracts the ServerHello random from the first record of the
// given direction; ok is false if that record is not a ServerHello.
func serverRandom(first []byte) (random []byte, ok bool) {
	if len(first) < helloPrefixLen || first[0] != recordHandshake || first[5] != 2 {
		return nil, false
	}
	return first[11:43], true
}

// clientHelloRandom extracts the ClientHello random from the first record
// read by a server; nil if that record is not a ClientHello.
func clientHelloRandom(first []byte) []byte {
	if len(first) < helloPrefixLen || first[0] != recordHandshake || first[5] != 1 {
		return nil
	}
	return first[11:43]
}

func appendUpTo(dst, src []byte, limit int) []byte {
	if room := limit - len(dst); len(src) > room {
		src = src[:room]
	}
	return append(dst, src...)
}
