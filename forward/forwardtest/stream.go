package forwardtest

import (
	"crypto/sha256"
	"io"
	"net"
	"testing"
	"time"
)

// Stream is one end of a tunnel moving bytes both ways (RunStream): what
// it sent and what it read, as SHA-256 sums and byte counts, and how it
// ended.
type Stream struct {
	Sent, Recv   [32]byte
	SentN, RecvN int64
	Err          error
}

// RunStream writes frame on c, then, once start is closed, seed's pattern
// in paced chunks until release is closed and 32 chunks more, then
// half-closes; meanwhile it reads c to its end. It closes c.
func RunStream(c interface {
	net.Conn
	CloseWrite() error
}, frame []byte, seed uint64, start, release <-chan struct{}) *Stream {
	s := &Stream{}
	defer c.Close()
	errc := make(chan error, 1)
	go func() {
		if _, err := c.Write(frame); len(frame) > 0 && err != nil {
			errc <- err
			return
		}
		<-start
		h, p := sha256.New(), NewPattern(seed)
		buf := make([]byte, 16<<10)
		for more := 32; more > 0; time.Sleep(2 * time.Millisecond) {
			select {
			case <-release:
				more--
			default:
			}
			p.Read(buf)
			h.Write(buf)
			if _, err := c.Write(buf); err != nil {
				errc <- err
				return
			}
			s.SentN += int64(len(buf))
		}
		copy(s.Sent[:], h.Sum(nil))
		errc <- c.CloseWrite()
	}()
	h := sha256.New()
	s.RecvN, s.Err = io.Copy(h, c)
	copy(s.Recv[:], h.Sum(nil))
	if werr := <-errc; s.Err == nil {
		s.Err = werr
	}
	return s
}

// ExactBothWays fails t unless each stream's bytes reached one of the
// upstream's connections exact, and the stream read exactly what that
// connection sent.
func ExactBothWays(t testing.TB, streams []*Stream, ups []Result) {
	t.Helper()
	for i, s := range streams {
		ok := false
		for _, r := range ups {
			ok = ok || (r.RecvSum == s.Sent && r.Received == s.SentN && r.SentSum == s.Recv && r.Sent == s.RecvN)
		}
		if !ok || s.Err != nil || s.RecvN == 0 {
			t.Errorf("stream %d (sent %d, read %d, %v): no upstream connection received its bytes exact and sent it what it read", i, s.SentN, s.RecvN, s.Err)
		}
	}
}
