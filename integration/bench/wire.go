package main

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"sync"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// The gateway and the raw upstream speak a tiny protocol through every L4
// contender: a 24-byte header, then the shape's bytes. The forwarder only ever
// sees opaque tenant bytes.
//
//	op (1) 'U' upload | 'D' download | 'S' small calls; 3 zero bytes;
//	req (4), resp (4): small-call sizes; n (8): bytes (U, D) or calls (S)
//
// U: the gateway sends n bytes; the upstream answers their SHA-256 (32 bytes)
// and closes. D: the upstream sends n bytes and closes. S: n times, the
// gateway sends req bytes and the upstream, having checked them, answers resp
// bytes.
const headerLen = 24

const (
	opUpload   = 'U'
	opDownload = 'D'
	opSmall    = 'S'
)

type header struct {
	op        byte
	req, resp uint32
	n         uint64
}

func (h header) marshal() []byte {
	b := make([]byte, headerLen)
	b[0] = h.op
	binary.BigEndian.PutUint32(b[4:], h.req)
	binary.BigEndian.PutUint32(b[8:], h.resp)
	binary.BigEndian.PutUint64(b[16:], h.n)
	return b
}

func readHeader(r io.Reader) (header, error) {
	b := make([]byte, headerLen)
	if _, err := io.ReadFull(r, b); err != nil {
		return header{}, err
	}
	h := header{op: b[0], req: binary.BigEndian.Uint32(b[4:]), resp: binary.BigEndian.Uint32(b[8:]), n: binary.BigEndian.Uint64(b[16:])}
	if h.req > blockLen || h.resp > blockLen {
		return h, fmt.Errorf("small-call sizes %d/%d above %d", h.req, h.resp, blockLen)
	}
	return h, nil
}

// The payload is one pseudo-random block repeated: generating it costs
// nothing per transfer (under TCG a per-byte generator would cost more guest
// time than the forwarder under test), and it does not compress.
const blockLen = 1 << 20

var block = func() []byte {
	b := make([]byte, blockLen)
	forwardtest.NewPattern(7).Read(b)
	return b
}()

// payload is an io.Reader of the first n bytes of the repeated block.
type payload struct{ off, n int64 }

func newPayload(n int64) *payload { return &payload{n: n} }

func (p *payload) Read(b []byte) (int, error) {
	if p.off >= p.n {
		return 0, io.EOF
	}
	i := p.off % blockLen
	m := copy(b, block[i:min(int64(blockLen), i+p.n-p.off)])
	p.off += int64(m)
	return m, nil
}

// WriteTo hands the block out in large slices: one write per MiB instead of
// one per caller buffer.
func (p *payload) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for p.off < p.n {
		i := p.off % blockLen
		m, err := w.Write(block[i:min(int64(blockLen), i+p.n-p.off)])
		p.off += int64(m)
		total += int64(m)
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

var sums sync.Map // int64 -> [32]byte

// payloadSum is the SHA-256 of newPayload(n), computed once per size.
func payloadSum(n int64) [32]byte {
	if s, ok := sums.Load(n); ok {
		return s.([32]byte)
	}
	h := sha256.New()
	newPayload(n).WriteTo(h)
	var s [32]byte
	copy(s[:], h.Sum(nil))
	sums.Store(n, s)
	return s
}
