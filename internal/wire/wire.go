// Package wire encodes the states that objects carry from one process to
// the one that replaces it in an upgrade (a tunnel, its relay, its TLS
// session): a version byte, then the fields in an order the version fixes,
// with nothing named. A state is decoded once per object while the object
// stands still, so the encoding is read in one pass without reflection.
//
// Values:
//
//	Uint16  2 bytes, big-endian
//	Uint    unsigned varint (encoding/binary), shortest form only
//	Int     zig-zag varint, shortest form only
//	Bool    one byte, 0 or 1
//	Float   8 bytes, IEEE 754, little-endian
//	Bytes   Uint length, then the bytes (Text alike: a string)
//	Time    Bool (set), then if set Int nanoseconds since 1970 (UTC)
//	Count   Uint: how many elements follow (each at least a byte long)
//	Index   Uint: which of a table's values (below the table's length)
//	Texts   Count, then each Text
//	AddrPort Bytes of netip.AddrPort's binary form
//
// A Reader is strict: a value cut short, a varint not in its shortest
// form, a Bool other than 0 or 1, a length past the end, or anything left
// after the last field (End) is an error, so that each state has one
// encoding and a state of another layout is not taken for one.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"time"
)

// Errors of a Reader.
var (
	ErrShort    = errors.New("the state ends inside a field (or a count or length runs past its end)")
	ErrVarint   = errors.New("a number not in its shortest form, or over 64 bits")
	ErrBool     = errors.New("a boolean other than 0 or 1")
	ErrTrailing = errors.New("data after the last field")
	ErrIndex    = errors.New("a number past the values it numbers")
)

// Writer appends a state's fields to B.
type Writer struct {
	B []byte
}

// NewWriter returns a Writer whose state starts with version, with room for
// size bytes.
func NewWriter(version byte, size int) *Writer {
	w := &Writer{B: make([]byte, 1, max(size, 1))}
	w.B[0] = version
	return w
}

func (w *Writer) Uint16(v uint16) { w.B = binary.BigEndian.AppendUint16(w.B, v) }
func (w *Writer) Uint(v uint64)   { w.B = binary.AppendUvarint(w.B, v) }
func (w *Writer) Int(v int64)     { w.B = binary.AppendVarint(w.B, v) }

func (w *Writer) Bool(v bool) {
	var b byte
	if v {
		b = 1
	}
	w.B = append(w.B, b)
}

func (w *Writer) Float(v float64) { w.B = binary.LittleEndian.AppendUint64(w.B, math.Float64bits(v)) }

func (w *Writer) Bytes(v []byte) {
	w.Uint(uint64(len(v)))
	w.B = append(w.B, v...)
}

func (w *Writer) Text(v string) {
	w.Uint(uint64(len(v)))
	w.B = append(w.B, v...)
}

// Time writes t's wall clock (a monotonic reading means nothing in another
// process); the zero Time is written as unset.
func (w *Writer) Time(t time.Time) {
	w.Bool(!t.IsZero())
	if !t.IsZero() {
		w.Int(t.UnixNano())
	}
}

func (w *Writer) Texts(v []string) {
	w.Uint(uint64(len(v)))
	for _, e := range v {
		w.Text(e)
	}
}

func (w *Writer) AddrPort(v netip.AddrPort) {
	b, _ := v.MarshalBinary() // never fails
	w.Bytes(b)
}

// Reader reads a state's fields in order. The first error sticks: every
// later read returns a zero value, and Err or End returns the error,
// naming the field it met it in.
type Reader struct {
	b     []byte
	field string
	err   error
}

// NewReader returns a Reader of state b, whose first byte (its version)
// Version returns.
func NewReader(b []byte) *Reader { return &Reader{b: b} }

// Version reads the version byte: 0 and ErrShort for an empty state.
func (r *Reader) Version() byte {
	r.field = "version"
	if len(r.b) == 0 {
		r.fail(ErrShort)
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

// Field names the field the next reads belong to, for the error.
func (r *Reader) Field(name string) { r.field = name }

func (r *Reader) fail(err error) {
	if r.err == nil {
		r.err = fmt.Errorf("%s: %w", r.field, err)
	}
	r.b = nil
}

func (r *Reader) Uint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	switch {
	case n == 0:
		r.fail(ErrShort)
		return 0
	case n < 0 || n != varintLen(v):
		r.fail(ErrVarint)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *Reader) Uint16() uint16 {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 2 {
		r.fail(ErrShort)
		return 0
	}
	v := binary.BigEndian.Uint16(r.b)
	r.b = r.b[2:]
	return v
}

// Count reads how many elements follow, each at least one byte long: a
// count the rest of the state cannot hold is ErrShort, before anything
// is allocated for it.
func (r *Reader) Count() int {
	n := r.Uint()
	if n > uint64(len(r.b)) {
		r.fail(ErrShort)
		return 0
	}
	return int(n)
}

// Index reads which of n values (a table's, in an order the version
// fixes) the field holds: ErrIndex for n or more.
func (r *Reader) Index(n int) int {
	v := r.Uint()
	if r.err == nil && v >= uint64(n) {
		r.fail(fmt.Errorf("%d: %w", v, ErrIndex))
		return 0
	}
	return int(v)
}

func (r *Reader) Int() int64 {
	u := r.Uint() // the zig-zag form, so its shortest form is the Uint's
	return int64(u>>1) ^ -int64(u&1)
}

func (r *Reader) Bool() bool {
	if r.err != nil {
		return false
	}
	if len(r.b) == 0 {
		r.fail(ErrShort)
		return false
	}
	b := r.b[0]
	if b > 1 {
		r.fail(ErrBool)
		return false
	}
	r.b = r.b[1:]
	return b == 1
}

func (r *Reader) Float() float64 {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 8 {
		r.fail(ErrShort)
		return 0
	}
	v := math.Float64frombits(binary.LittleEndian.Uint64(r.b))
	r.b = r.b[8:]
	return v
}

// View returns the next byte string without copying it: it is part of
// the state, for a nested state's decoder. nil for an empty one.
func (r *Reader) View() []byte {
	n := r.Uint()
	if r.err != nil {
		return nil
	}
	if n > uint64(len(r.b)) {
		r.fail(ErrShort)
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	if n == 0 {
		return nil
	}
	return v
}

// Bytes returns a copy of the next byte string, nil for an empty one.
func (r *Reader) Bytes() []byte {
	if v := r.View(); v != nil {
		return append([]byte(nil), v...)
	}
	return nil
}

// Text reads a string. (Not String: a Reader is no fmt.Stringer, which
// fmt would call, and so consume a field, on printing one.)
func (r *Reader) Text() string { return string(r.View()) }

// Time reads what Writer.Time wrote: the zero Time, or a UTC time.
func (r *Reader) Time() time.Time {
	if !r.Bool() {
		return time.Time{}
	}
	return time.Unix(0, r.Int()).UTC()
}

// Texts reads what Writer.Texts wrote: nil for none.
func (r *Reader) Texts() []string {
	n := r.Count()
	if n == 0 {
		return nil
	}
	v := make([]string, n)
	for i := range v {
		v[i] = r.Text()
	}
	return v
}

func (r *Reader) AddrPort() netip.AddrPort {
	var v netip.AddrPort
	if b := r.View(); r.err == nil {
		if err := v.UnmarshalBinary(b); err != nil {
			r.fail(err)
		}
	}
	return v
}

// Err returns the first error met, nil for none.
func (r *Reader) Err() error { return r.err }

// End returns the first error met, else ErrTrailing when bytes are left.
func (r *Reader) End() error {
	if r.err == nil && len(r.b) > 0 {
		r.field = "end"
		r.fail(ErrTrailing)
	}
	return r.err
}

// varintLen is the length of v's shortest unsigned varint.
func varintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}
