package ktls

import (
	"errors"
	"io"
)

// ReadFrom copies r to the connection. With TX in the kernel it hands r to
// the TCP socket's ReadFrom, so files go out with sendfile(2) and sockets
// with splice(2), encrypted by the kernel. Otherwise it copies through Write.
func (c *Conn) ReadFrom(r io.Reader) (int64, error) {
	if err := c.Handshake(); err != nil {
		return 0, err
	}
	if !c.kernelTX() {
		return io.Copy(writerOnly{c}, r)
	}
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if err := c.writableLocked(); err != nil {
		return 0, err
	}
	// In chunks, so that the TX key's wear is checked between them.
	var total int64
	for {
		if err := c.beforeSealLocked(-1); err != nil {
			return total, err
		}
		n, err := readFromFlattened(c.sock, &io.LimitedReader{R: r, N: maxSealChunk})
		c.txBound += sealedBound(n)
		total += n
		if err != nil || n < maxSealChunk {
			return total, err
		}
	}
}

// readFromFlattened calls dst.ReadFrom with nested *io.LimitedReaders
// collapsed into one. The standard library's sendfile path unwraps a single
// LimitedReader only, and Caddy's file server wraps a file in two; without
// this the file would be copied through userspace. Afterwards every
// wrapper's N is lowered by the bytes copied, as if it had been read
// through.
func readFromFlattened(dst io.ReaderFrom, r io.Reader) (int64, error) {
	var wrappers []*io.LimitedReader
	inner := r
	for {
		lr, ok := inner.(*io.LimitedReader)
		if !ok {
			break
		}
		wrappers = append(wrappers, lr)
		inner = lr.R
	}
	if len(wrappers) < 2 {
		return dst.ReadFrom(r)
	}
	limit := wrappers[0].N
	for _, w := range wrappers[1:] {
		limit = min(limit, w.N)
	}
	if limit <= 0 {
		return 0, nil
	}
	n, err := dst.ReadFrom(&io.LimitedReader{R: inner, N: limit})
	for _, w := range wrappers {
		w.N -= n
	}
	return n, err
}

// WriteTo copies the connection's plaintext to w until EOF (close_notify or
// FIN). With RX in the kernel it lets the socket's ReadFrom/WriteTo move the
// bytes (splice(2) when w is a socket). splice stops with EINVAL at a
// control record: that record is handled as in Read, and the copy resumes.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	if err := c.Handshake(); err != nil {
		return 0, err
	}
	if !c.kernelRX() {
		return io.Copy(w, readerOnly{c})
	}
	c.readMu.Lock()
	defer c.readMu.Unlock()
	var total int64
	for {
		if len(c.pending) > 0 {
			n, err := w.Write(c.pending)
			total += int64(n)
			c.pending = c.pending[n:]
			if err != nil {
				return total, err
			}
			continue
		}
		if c.readErr != nil {
			if errors.Is(c.readErr, io.EOF) {
				return total, nil
			}
			return total, c.readErr
		}
		// In chunks to a ReaderFrom, so that the RX key's wear is checked
		// between them; otherwise after each WriteTo.
		var n int64
		var err error
		more := false
		if rf, ok := w.(io.ReaderFrom); ok {
			n, err = rf.ReadFrom(&io.LimitedReader{R: c.sock, N: maxSealChunk})
			more = err == nil && n == maxSealChunk
		} else {
			n, err = c.sock.WriteTo(w)
		}
		total += n
		if werr := c.openedLocked(n); werr != nil {
			c.fail(werr)
			return total, werr
		}
		switch {
		case more:
			continue
		case err == nil:
			return total, nil
		case !isControlRecordErrno(err):
			return total, err
		}
		if err := c.readKernelRecord(); err != nil {
			if isTimeout(err) {
				return total, err
			}
			c.fail(err)
		}
	}
}

// writerOnly and readerOnly hide ReadFrom/WriteTo so io.Copy does not
// recurse into the method that called it.
type writerOnly struct{ io.Writer }

type readerOnly struct{ io.Reader }
