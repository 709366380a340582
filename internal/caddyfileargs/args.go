// Package caddyfileargs reads the arguments of the Caddyfile options of
// caddy-ktls's modules: the few shapes every module's options take (one
// string, a duration, a positive integer or size, on|off, a header line, a
// control-plane endpoint block), each with the same errors. Each module's
// Caddyfile parsing sits beside the module, on these readers.
package caddyfileargs

import (
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/dustin/go-humanize"
)

// NoArgsOrBlock reads a directive (what, in messages) that takes neither
// arguments nor a block.
func NoArgsOrBlock(d *caddyfile.Dispenser, what string) error {
	d.Next() // the directive's name
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(d.Nesting()) {
		return d.Errf("the %s takes no block", what)
	}
	return nil
}

// NoArgs fails when the option d is on has arguments.
func NoArgs(d *caddyfile.Dispenser) error {
	if opt := d.Val(); d.NextArg() {
		return d.Errf("%s takes no arguments", opt)
	}
	return nil
}

// PositiveInt reads the one argument of the option d is on, a positive
// integer.
func PositiveInt(d *caddyfile.Dispenser) (int, error) {
	opt := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	n, err := strconv.Atoi(d.Val())
	if err != nil || n <= 0 {
		return 0, d.Errf("%s: %q is not a positive integer", opt, d.Val())
	}
	if d.NextArg() {
		return 0, d.ArgErr()
	}
	return n, nil
}

// Limit reads the one argument of the option d is on, a bound: a positive
// integer, or off (no bound), returned as -1.
func Limit(d *caddyfile.Dispenser) (int, error) {
	if d.CountRemainingArgs() != 1 {
		return 0, d.ArgErr()
	}
	if d.NextArg(); d.Val() == "off" {
		return -1, nil
	}
	d.Prev()
	return PositiveInt(d)
}

// Duration reads the one argument of the option d is on, a positive
// duration.
func Duration(d *caddyfile.Dispenser) (caddy.Duration, error) {
	opt := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	dur, err := caddy.ParseDuration(d.Val())
	if err != nil || dur <= 0 {
		return 0, d.Errf("%s: %q is not a positive duration", opt, d.Val())
	}
	if d.NextArg() {
		return 0, d.ArgErr()
	}
	return caddy.Duration(dur), nil
}

// OneOf reads exactly one argument, which must be one of choices.
func OneOf(d *caddyfile.Dispenser, choices ...string) (string, error) {
	opt := d.Val()
	args := d.RemainingArgs()
	switch {
	case len(args) == 1 && slices.Contains(choices, args[0]):
		return args[0], nil
	case len(args) == 1:
		return "", d.Errf("%s takes one of %s, got %q", opt, strings.Join(choices, ", "), args[0])
	default:
		return "", d.Errf("%s takes one of %s, got %d arguments", opt, strings.Join(choices, ", "), len(args))
	}
}

// String reads the one argument of the option d is on.
func String(d *caddyfile.Dispenser) (string, error) {
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.ArgErr()
	}
	return v, nil
}

// Size reads the one argument of the option d is on, a positive size in
// bytes: 10MB, 512KiB, or a number of bytes.
func Size(d *caddyfile.Dispenser) (int64, error) {
	opt := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	n, err := humanize.ParseBytes(d.Val())
	if err != nil || n == 0 || n > math.MaxInt64 {
		return 0, d.Errf("%s: %q is not a positive size such as 10MB", opt, d.Val())
	}
	if d.NextArg() {
		return 0, d.ArgErr()
	}
	return int64(n), nil
}

// Header reads a `header <name> <value>` line into h (made when nil).
func Header(d *caddyfile.Dispenser, h *http.Header) error {
	args := d.RemainingArgs()
	if len(args) != 2 {
		return d.Errf("header takes a field name and a value, got %d arguments", len(args))
	}
	if *h == nil {
		*h = http.Header{}
	}
	h.Add(args[0], args[1])
	return nil
}

// Endpoint reads a control-plane endpoint, the option d is on:
//
//	<option> <url> {
//		header <name> <value>   # repeatable
//		...                     # the option's own lines: other
//	}
//
// other reads each line that is not a header, and refuses the ones it does
// not know.
func Endpoint(d *caddyfile.Dispenser, url *string, h *http.Header, other func(opt string) error) error {
	opt := d.Val()
	if !d.NextArg() {
		return d.Errf("%s needs the control plane's URL", opt)
	}
	*url = d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() == "header" {
			if err := Header(d, h); err != nil {
				return err
			}
			continue
		}
		if err := other(d.Val()); err != nil {
			return err
		}
	}
	return nil
}

// Table reads the options whose argument has one of the shapes above, by
// name, each into its field.
type Table struct {
	Strings   map[string]*string
	Durations map[string]*caddy.Duration
	Ints      map[string]*int // positive
	Sizes     map[string]*int64
	Flags     map[string]*bool     // no arguments: on
	Lists     map[string]*[]string // one or more arguments, appended
}

// Read reads the option d is on into its field when t has it.
func (t Table) Read(d *caddyfile.Dispenser) (handled bool, err error) {
	opt := d.Val()
	if dst, ok := t.Strings[opt]; ok {
		*dst, err = String(d)
		return true, err
	}
	if dst, ok := t.Durations[opt]; ok {
		*dst, err = Duration(d)
		return true, err
	}
	if dst, ok := t.Ints[opt]; ok {
		*dst, err = PositiveInt(d)
		return true, err
	}
	if dst, ok := t.Sizes[opt]; ok {
		*dst, err = Size(d)
		return true, err
	}
	if dst, ok := t.Lists[opt]; ok {
		args := d.RemainingArgs()
		if len(args) == 0 {
			return true, d.ArgErr()
		}
		*dst = append(*dst, args...)
		return true, nil
	}
	if dst, ok := t.Flags[opt]; ok {
		if err := NoArgs(d); err != nil {
			return true, err
		}
		*dst = true
		return true, nil
	}
	return false, nil
}
