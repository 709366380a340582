package wire

import (
	"bytes"
	"errors"
	"math"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
)

// fields is a state of every kind of value, for the tests.
type fields struct {
	u16  uint16
	u    uint64
	i    int64
	b    bool
	f    float64
	raw  []byte
	s    string
	when time.Time
	list []string
	ap   netip.AddrPort
	idx  int // one of 3
}

func (v fields) encode() []byte {
	w := NewWriter(7, 0)
	w.Uint(v.u)
	w.Int(v.i)
	w.Bool(v.b)
	w.Float(v.f)
	w.Bytes(v.raw)
	w.Text(v.s)
	w.Time(v.when)
	w.Uint16(v.u16)
	w.Texts(v.list)
	w.AddrPort(v.ap)
	w.Uint(uint64(v.idx))
	return w.B
}

func decode(b []byte) (fields, byte, error) {
	r := NewReader(b)
	version := r.Version()
	var v fields
	r.Field("u")
	v.u = r.Uint()
	r.Field("i")
	v.i = r.Int()
	r.Field("b")
	v.b = r.Bool()
	r.Field("f")
	v.f = r.Float()
	r.Field("raw")
	v.raw = r.Bytes()
	r.Field("s")
	v.s = r.Text()
	r.Field("when")
	v.when = r.Time()
	r.Field("u16")
	v.u16 = r.Uint16()
	r.Field("list")
	v.list = r.Texts()
	r.Field("ap")
	v.ap = r.AddrPort()
	r.Field("idx")
	v.idx = r.Index(3)
	return v, version, r.End()
}

func (v fields) equal(o fields) bool {
	return v.u == o.u && v.i == o.i && v.b == o.b && math.Float64bits(v.f) == math.Float64bits(o.f) &&
		bytes.Equal(v.raw, o.raw) && v.s == o.s && v.when.Equal(o.when) && v.when.IsZero() == o.when.IsZero() &&
		v.u16 == o.u16 && slices.Equal(v.list, o.list) && v.ap == o.ap && v.idx == o.idx
}

// TestRoundTrip: every kind of value comes back exactly, at its limits;
// the version byte comes first.
func TestRoundTrip(t *testing.T) {
	for _, v := range []fields{
		{},
		{u: math.MaxUint64, i: math.MinInt64, b: true, f: math.Inf(-1), raw: []byte{0, 1, 2}, s: "sandbox ✓", when: time.Date(2026, 12, 6, 1, 2, 3, 456789012, time.UTC), u16: 0xffff, list: []string{"a", "", "c"}, ap: netip.MustParseAddrPort("[2001:db8::1]:443")},
		{ap: netip.MustParseAddrPort("10.0.0.1:8080"), idx: 2},
		{u: 127, i: math.MaxInt64, f: -0.0, raw: bytes.Repeat([]byte{0xff}, 300), when: time.Unix(0, -1)},
		{u: 128, i: -1, f: 12.5, s: strings.Repeat("x", 1<<14), when: time.Unix(1, 0).In(time.FixedZone("x", 3600))},
	} {
		b := v.encode()
		if b[0] != 7 {
			t.Fatalf("state starts with %d, want the version 7", b[0])
		}
		got, version, err := decode(b)
		if err != nil || version != 7 || !got.equal(v) {
			t.Fatalf("decoded %+v, version %d, %v\nwant    %+v", got, version, err, v)
		}
		if len(v.raw) == 0 && got.raw != nil {
			t.Fatalf("an empty byte string decoded as %#v, want nil", got.raw)
		}
		if !v.when.IsZero() && got.when.Location() != time.UTC {
			t.Fatalf("time decoded in %v, want UTC", got.when.Location())
		}
	}
}

// TestBytesCopies: Bytes returns a copy that outlives the state (which
// its owner wipes); View returns part of the state itself.
func TestBytesCopies(t *testing.T) {
	w := NewWriter(1, 0)
	w.Bytes([]byte("secret"))
	w.Bytes([]byte("nested"))
	r := NewReader(w.B)
	r.Version()
	copied, view := r.Bytes(), r.View()
	if err := r.End(); err != nil {
		t.Fatal(err)
	}
	clear(w.B)
	if string(copied) != "secret" {
		t.Fatalf("Bytes = %q after the state was wiped, want its own copy", copied)
	}
	if !bytes.Equal(view, make([]byte, 6)) {
		t.Fatalf("View = %q after the state was wiped, want the state's own bytes", view)
	}
	if cap(view) != len(view) {
		t.Fatalf("View's capacity %d reaches past its %d bytes: an append would write over the state", cap(view), len(view))
	}
}

// TestRefusals: each malformed state is refused with the error that says
// what is wrong, naming the field; a Reader's first error sticks.
func TestRefusals(t *testing.T) {
	good := fields{u: 300, i: -5, b: true, f: 1, raw: []byte("ab"), s: "cd", when: time.Unix(5, 0), u16: 0x0304}.encode()
	for _, tc := range []struct {
		name  string
		state []byte
		want  error
		field string
	}{
		{"empty", nil, ErrShort, "version"},
		{"version only", []byte{7}, ErrShort, "u:"},
		{"cut in a varint", good[:2], ErrShort, "u:"},
		{"overlong varint", append([]byte{7, 0x80, 0x00}, good[3:]...), ErrVarint, "u:"},
		{"varint over 64 bits", []byte{7, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}, ErrVarint, "u:"},
		{"bool 2", append(append([]byte(nil), good[:4]...), append([]byte{2}, good[5:]...)...), ErrBool, "b:"},
		{"cut in a float", good[:10], ErrShort, "f:"},
		{"length past the end", append(append([]byte(nil), good[:13]...), 0x7f), ErrShort, "raw:"},
		{"cut in the time", good[:20], ErrShort, "when:"},
		{"cut in a uint16", good[:26], ErrShort, "u16:"},
		{"count past the end", append(append([]byte(nil), good[:27]...), 2, 0), ErrShort, "list:"},
		{"address of 5 bytes", append(append([]byte(nil), good[:28]...), 5, 1, 2, 3, 4, 5), nil, "ap:"},
		{"index past the table", append(bytes.Clone(good[:len(good)-1]), 3), ErrIndex, "idx: 3"},
		{"trailing", append(append([]byte(nil), good...), 0), ErrTrailing, "end:"},
	} {
		_, _, err := decode(tc.state)
		if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) || !strings.HasPrefix(err.Error(), tc.field) {
			t.Errorf("%s: %v; want %v in field %q", tc.name, err, tc.want, tc.field)
		}
	}
	if _, _, err := decode(good); err != nil {
		t.Fatalf("the good state: %v", err)
	}
}

// FuzzReader: no input makes a Reader panic or read past its state, and
// whatever it accepts is the one encoding of what it decoded.
func FuzzReader(f *testing.F) {
	f.Add(fields{}.encode())
	f.Add(fields{u: 300, i: -5, b: true, f: 1, raw: []byte("ab"), s: "cd", when: time.Unix(5, 0)}.encode())
	f.Add([]byte{7, 0x80, 0x00})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, version, err := decode(b)
		if err != nil {
			return
		}
		again := v.encode()
		again[0] = version
		if !bytes.Equal(again, b) {
			t.Fatalf("accepted %x, which encodes as %x", b, again)
		}
	})
}
