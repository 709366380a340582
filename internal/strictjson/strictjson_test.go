package strictjson

import (
	"errors"
	"strings"
	"testing"
)

type wire struct {
	V int    `json:"v"`
	S string `json:"s"`
}

func TestDecode(t *testing.T) {
	for _, tc := range []struct {
		in, says string
		want     wire
	}{
		{in: `{"v":2,"s":"x"}`, want: wire{2, "x"}},
		{in: " {\"v\":2}\n\t ", want: wire{V: 2}},
		{in: `{"v":2,"t":1}`, says: `unknown field "t"`},
		{in: `{"v":2} {"v":3}`, says: ErrTrailing.Error()},
		{in: `{"v":2}x`, says: ErrTrailing.Error()},
		{in: `{"v":2`, says: "unexpected EOF"},
		{in: ``, says: "EOF"},
	} {
		var got wire
		err := Decode([]byte(tc.in), &got)
		if tc.says == "" {
			if err != nil || got != tc.want {
				t.Errorf("Decode(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("Decode(%q) = %+v, %v; want an error saying %q", tc.in, got, err, tc.says)
		}
		if tc.says == ErrTrailing.Error() && !errors.Is(err, ErrTrailing) {
			t.Errorf("Decode(%q): %v is not ErrTrailing", tc.in, err)
		}
	}
}

// Versioned refuses another version before anything else the object
// holds (fields that version may know, data after it), then a missing
// version, then what Decode refuses.
func TestVersioned(t *testing.T) {
	for _, tc := range []struct {
		in      string
		got     int
		is      error
		says    string
		decoded wire
	}{
		{in: `{"v":2,"s":"x"}`, got: 2, decoded: wire{2, "x"}},
		{in: `{"v":3,"s":"x"}`, got: 3, is: ErrVersion},
		{in: `{"v":3,"new":true}`, got: 3, is: ErrVersion},
		{in: `{"v":1,"s":"x"} {}`, says: "after top-level value"},
		{in: `{"s":"x"}`, is: ErrNoVersion},
		{in: `{"v":null}`, is: ErrNoVersion},
		{in: `{"v":2,"new":true}`, got: 2, says: `unknown field "new"`},
		{in: `{"v":"2"}`, says: "cannot unmarshal string"},
		{in: `[]`, says: "cannot unmarshal array"},
	} {
		var w wire
		got, err := Versioned([]byte(tc.in), &w, 2, func() int { return w.V })
		switch {
		case tc.is == nil && tc.says == "":
			if err != nil || got != tc.got || w != tc.decoded {
				t.Errorf("Versioned(%s) = %d, %v, %+v; want %d, nil, %+v", tc.in, got, err, w, tc.got, tc.decoded)
			}
		case tc.is != nil:
			if !errors.Is(err, tc.is) || got != tc.got {
				t.Errorf("Versioned(%s) = %d, %v; want %d, %v", tc.in, got, err, tc.got, tc.is)
			}
		default:
			if err == nil || !strings.Contains(err.Error(), tc.says) || got != tc.got {
				t.Errorf("Versioned(%s) = %d, %v; want %d and an error saying %q", tc.in, got, err, tc.got, tc.says)
			}
		}
	}
}
