package ktls

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"sort"
	"testing"
	"testing/iotest"
)

// streamConn is a net.Conn whose reads come from a reader.
type streamConn struct {
	net.Conn
	r io.Reader
}

func (s *streamConn) Read(p []byte) (int, error) { return s.r.Read(p) }

func record(typ byte, body []byte) []byte {
	b := []byte{typ, 3, 3, 0, 0}
	binary.BigEndian.PutUint16(b[3:], uint16(len(body)))
	return append(b, body...)
}

// checkRecordReader reads stream through a recordConn with reads of up to
// readSize bytes and checks that it returns the same bytes, no read crosses
// a record boundary, and the reader sits at a boundary after each record.
func checkRecordReader(t *testing.T, stream []byte, readSize int, oneByte bool) {
	var src io.Reader = bytes.NewReader(stream)
	if oneByte {
		src = iotest.OneByteReader(src)
	}
	rc := newRecordConn(&streamConn{r: src})
	var out []byte
	buf := make([]byte, readSize)
	// Track record ends in the input to check each Read against them.
	ends := map[int]bool{}
	var endList []int
	for off := 0; off+recordHeaderLen <= len(stream); {
		off += recordHeaderLen + int(binary.BigEndian.Uint16(stream[off+3:off+5]))
		ends[off] = true
		endList = append(endList, off)
	}
	nextEnd := func(pos int) int {
		i := sort.SearchInts(endList, pos+1)
		if i == len(endList) {
			return -1
		}
		return endList[i]
	}
	for {
		pos := len(out)
		n, err := rc.Read(buf)
		if n > 0 {
			if e := nextEnd(pos); e >= 0 && pos+n > e {
				t.Fatalf("read of %d bytes at %d crosses the record end at %d", n, pos, e)
			}
			out = append(out, buf[:n]...)
			if ends[len(out)] != rc.atRecordBoundary() {
				t.Fatalf("at %d: atRecordBoundary %v, record end %v", len(out), rc.atRecordBoundary(), ends[len(out)])
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Fatal("Read returned 0, nil")
		}
	}
	if !bytes.Equal(out, stream) {
		t.Fatalf("got %d bytes, want %d (content differs: %v)", len(out), len(stream), len(out) == len(stream))
	}
}

func TestRecordReader(t *testing.T) {
	stream := bytes.Join([][]byte{
		record(22, bytes.Repeat([]byte{1}, 300)),
		record(20, []byte{1}),
		record(23, nil), // empty record: ends with its header
		record(23, bytes.Repeat([]byte{2}, 17000)),
		record(21, []byte{1, 0}),
	}, nil)
	for _, size := range []int{1, 3, 5, 6, 512, 1 << 16} {
		checkRecordReader(t, stream, size, false)
		checkRecordReader(t, stream, size, true)
	}
}

// TestRecordReaderServerRandom: the ServerHello random comes from the first
// record in each direction.
func TestRecordReaderServerRandom(t *testing.T) {
	random := bytes.Repeat([]byte{0xab}, 32)
	hello := append([]byte{2, 0, 0, 70, 3, 3}, random...)
	hello = append(hello, make([]byte, 38)...)
	rc := newRecordConn(&streamConn{r: bytes.NewReader(record(22, hello))})
	io.ReadAll(rc)
	if got, ok := serverRandom(rc.firstIn); !ok || !bytes.Equal(got, random) {
		t.Fatalf("serverRandom = %x, %v", got, ok)
	}
	if _, ok := serverRandom(record(22, []byte{1, 0, 0, 0})); ok {
		t.Fatal("a ClientHello was taken for a ServerHello")
	}
}

// FuzzRecordReader checks the recordConn invariants on arbitrary streams
// and read sizes.
func FuzzRecordReader(f *testing.F) {
	f.Add(record(22, []byte("hello")), uint16(3), false)
	f.Add(append(record(23, nil), record(21, []byte{1, 0})...), uint16(1), true)
	f.Add([]byte{22, 3, 3, 0xff, 0xff, 1, 2}, uint16(100), false) // truncated body
	f.Fuzz(func(t *testing.T, stream []byte, readSize uint16, oneByte bool) {
		if readSize == 0 {
			readSize = 1
		}
		// A truncated tail ends in io.EOF mid-record: the bytes must
		// still match and the reader must not claim a boundary.
		checkRecordReader(t, stream, int(readSize), oneByte)
	})
}
