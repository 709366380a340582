package caddyfileargs

import (
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// noArgsOrBlock reads a directive (what, in messages) that takes neither
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

// noArgs fails when the option d is on has arguments.
func NoArgs(d *caddyfile.Dispenser) error {
	if opt := d.Val(); d.NextArg() {
		return d.Errf("%s takes no arguments", opt)
	}
	return nil
}

// positiveIntArg reads the one argument of the option d is on, a positive
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

// oneOf reads exactly one argument, which must be one of choices.
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
