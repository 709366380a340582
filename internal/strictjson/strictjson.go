// Package strictjson decodes the versioned JSON states that travel between
// processes in an upgrade, strictly and, on the path of a state that is
// right, in one pass.
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
)

// Errors of Versioned.
var (
	// ErrTrailing: something follows the object.
	ErrTrailing = errors.New("data after the object")
	// ErrNoVersion: the object has no "v".
	ErrNoVersion = errors.New(`no version ("v")`)
	// ErrVersion: the object is of another version than the decoder's.
	ErrVersion = errors.New("another version")
)

// Decode decodes b, one JSON value, into v: a field v does not know, or
// anything after the value but white space, is an error.
func Decode(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return ErrTrailing
	}
	return nil
}

// Versioned decodes b, a JSON object whose field "v" is the version of its
// encoding, into v, which holds the fields of version want ("v" among
// them, which version reads back once v is decoded). The version decides
// which fields are known, so an object of another version is refused as
// such (ErrVersion), whatever else it holds; then ErrNoVersion, then
// Decode's errors. got is the version b names, 0 where it names none.
// A right object is read once; a wrong one once more, to say what is
// wrong.
func Versioned(b []byte, v any, want int, version func() int) (got int, err error) {
	err = Decode(b, v)
	if err == nil && version() == want {
		return want, nil
	}
	var probe struct {
		V *int `json:"v"`
	}
	switch perr := json.Unmarshal(b, &probe); {
	case perr != nil:
		return 0, perr
	case probe.V == nil:
		return 0, ErrNoVersion
	case *probe.V != want:
		return *probe.V, ErrVersion
	}
	return want, err
}
