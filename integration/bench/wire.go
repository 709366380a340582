package main

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
)

// The gateway and the raw upstream speak a tiny protocol through every L4
// contender: a 24-byte header, then the shape's bytes. The forwarder only ever
// sees opaque tenant bytes.
//
//	op (1) 'U' upload | 'D' download | 'S' small calls; 3 zero bytes;
//	req (4), resp (4): small-call sizes; seed (4): the tunnel's payload
//	stream; n (8): bytes (U, D) or calls (S)
//
// U: the gateway sends n bytes of stream seed and half-closes; the upstream
// reads to EOF and answers how many bytes it received (8) and their SHA-256
// (32), then closes. D: the upstream sends n bytes of stream seed and
// closes. S: n times, the gateway sends req bytes and the upstream, having
// checked them, answers resp bytes (call i takes the stream's bytes from
// i*(req+resp) on: the request, then the response); then the gateway
// half-closes, and the upstream closes at EOF, or answers an error text to
// any byte after the last call. L (load): as S without a count: calls until
// the gateway half-closes between two calls (n is ignored). The gateway reads every tunnel to EOF, the
// upstream uploads and small calls: a byte more than the shape's fails the
// run.
const headerLen = 24

const (
	opUpload   = 'U'
	opDownload = 'D'
	opSmall    = 'S'
	opLoad     = 'L'
)

type header struct {
	op        byte
	req, resp uint32
	seed      uint32
	n         uint64
}

func (h header) marshal() []byte {
	b := make([]byte, headerLen)
	b[0] = h.op
	binary.BigEndian.PutUint32(b[4:], h.req)
	binary.BigEndian.PutUint32(b[8:], h.resp)
	binary.BigEndian.PutUint32(b[12:], h.seed)
	binary.BigEndian.PutUint64(b[16:], h.n)
	return b
}

func readHeader(r io.Reader) (header, error) {
	b := make([]byte, headerLen)
	if _, err := io.ReadFull(r, b); err != nil {
		return header{}, err
	}
	h := header{op: b[0], req: binary.BigEndian.Uint32(b[4:]), resp: binary.BigEndian.Uint32(b[8:]),
		seed: binary.BigEndian.Uint32(b[12:]), n: binary.BigEndian.Uint64(b[16:])}
	if h.req > maxCallLen || h.resp > maxCallLen {
		return h, fmt.Errorf("small-call sizes %d/%d above %d", h.req, h.resp, maxCallLen)
	}
	return h, nil
}

// The payload is a stream without a period: word k (8 bytes, little endian)
// of stream seed is splitmix64's output function of (seed<<32 + k + 1) ×
// golden. Both steps are bijections, so below 2^32 words (32 GiB) no word
// recurs, in a stream or in another seed's: a replayed, swapped or
// misplaced stretch, or bytes of another tunnel, change what arrives. It
// does not compress, and it costs three multiplies a word, no table (under
// TCG a costlier generator would take more guest time than the forwarder
// under test).
const golden = 0x9e3779b97f4a7c15

// maxCallLen caps a small call's request and response.
const maxCallLen = 1 << 20

// bulkSeed is the stream of the bulk shapes. They run one tunnel at a time,
// so one stream serves them all and its digest is computed once per size
// (payloadSum); small calls run side by side, each tunnel on its own seed.
const bulkSeed = 0

var lastSeed atomic.Uint32

// nextSeed is a small-call tunnel's seed, unique in the run (seeds wrap
// after 2^32 tunnels).
func nextSeed() uint32 { return lastSeed.Add(1) }

// streamWord is word k of stream seed.
func streamWord(seed uint32, k uint64) uint64 {
	z := (uint64(seed)<<32 + k + 1) * golden
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// fillStream fills b with stream seed from byte offset off on.
func fillStream(b []byte, seed uint32, off int64) {
	var w [8]byte
	if i := off % 8; i != 0 { // the tail of the word off falls in
		binary.LittleEndian.PutUint64(w[:], streamWord(seed, uint64(off)/8))
		n := copy(b, w[i:])
		b, off = b[n:], off+int64(n)
	}
	k := uint64(off) / 8
	for ; len(b) >= 8; k++ {
		binary.LittleEndian.PutUint64(b, streamWord(seed, k))
		b = b[8:]
	}
	if len(b) > 0 {
		binary.LittleEndian.PutUint64(w[:], streamWord(seed, k))
		copy(b, w[:])
	}
}

// payload is an io.Reader of the first n bytes of stream seed.
type payload struct {
	seed   uint32
	off, n int64
}

func newPayload(seed uint32, n int64) *payload { return &payload{seed: seed, n: n} }

func (p *payload) Read(b []byte) (int, error) {
	if p.off >= p.n {
		return 0, io.EOF
	}
	b = b[:min(int64(len(b)), p.n-p.off)]
	fillStream(b, p.seed, p.off)
	p.off += int64(len(b))
	return len(b), nil
}

// writeChunk is what WriteTo hands over at once.
const writeChunk = 1 << 20

// WriteTo hands the stream out in large slices: one write per MiB instead
// of one per caller buffer.
func (p *payload) WriteTo(w io.Writer) (int64, error) {
	var total int64
	buf := make([]byte, min(writeChunk, p.n-p.off))
	for p.off < p.n {
		b := buf[:min(int64(len(buf)), p.n-p.off)]
		fillStream(b, p.seed, p.off)
		m, err := w.Write(b)
		p.off += int64(m)
		total += int64(m)
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// callBytes fills req and resp with call i's request and response in stream
// seed.
func callBytes(req, resp []byte, seed uint32, i uint64) {
	off := int64(i) * int64(len(req)+len(resp))
	fillStream(req, seed, off)
	fillStream(resp, seed, off+int64(len(req)))
}

var sums sync.Map // int64 -> [32]byte

// payloadSum is the SHA-256 of newPayload(bulkSeed, n), computed once per
// size.
func payloadSum(n int64) [32]byte {
	if s, ok := sums.Load(n); ok {
		return s.([32]byte)
	}
	h := sha256.New()
	newPayload(bulkSeed, n).WriteTo(h)
	var s [32]byte
	copy(s[:], h.Sum(nil))
	sums.Store(n, s)
	return s
}

// uploadReply is the upstream's answer to an upload: the bytes it received
// up to EOF, and their SHA-256.
type uploadReply struct {
	n   uint64
	sum [32]byte
}

const uploadReplyLen = 8 + 32

func (r uploadReply) marshal() []byte {
	return append(binary.BigEndian.AppendUint64(nil, r.n), r.sum[:]...)
}

func parseUploadReply(b []byte) uploadReply {
	r := uploadReply{n: binary.BigEndian.Uint64(b)}
	copy(r.sum[:], b[8:])
	return r
}

// closeWriter is a connection whose sending side ends on its own (TLS:
// close_notify; TCP: FIN) while it still reads.
type closeWriter interface{ CloseWrite() error }

func closeWrite(c io.Writer) error {
	cw, ok := c.(closeWriter)
	if !ok {
		return fmt.Errorf("%T cannot half-close", c)
	}
	return cw.CloseWrite()
}

// expectEOF reads r to its end and fails on any byte before it.
func expectEOF(r io.Reader) error {
	b := make([]byte, 512)
	n, err := io.ReadAtLeast(r, b, 1)
	switch {
	case n > 0:
		return fmt.Errorf("%d bytes where the stream should end (%q)", n, b[:n])
	case errors.Is(err, io.EOF):
		return nil
	}
	return fmt.Errorf("waiting for the end of the stream: %w", err)
}
