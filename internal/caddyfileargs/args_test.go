package caddyfileargs

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// block runs read on each line of the block of `opts { ... }`.
func block(t *testing.T, input string, read func(d *caddyfile.Dispenser) error) error {
	t.Helper()
	d := caddyfile.NewTestDispenser(input)
	d.Next()
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := read(d); err != nil {
			return err
		}
	}
	return nil
}

// TestTable: each shape reads into its field; a wrong argument count or
// value is an error naming the option; an option the table lacks is not
// handled.
func TestTable(t *testing.T) {
	var (
		s     string
		dur   caddy.Duration
		n     int
		size  int64
		flag  bool
		list  []string
		other []string
	)
	tab := Table{
		Strings:   map[string]*string{"name": &s},
		Durations: map[string]*caddy.Duration{"wait": &dur},
		Ints:      map[string]*int{"count": &n},
		Sizes:     map[string]*int64{"rate": &size},
		Flags:     map[string]*bool{"on": &flag},
		Lists:     map[string]*[]string{"allow": &list},
	}
	err := block(t, "opts {\n name a\n wait 1m30s\n count 7\n rate 10MiB\n on\n allow 10.0.0.0/8 fd00::/8\n allow 127.0.0.1\n custom x\n}",
		func(d *caddyfile.Dispenser) error {
			handled, err := tab.Read(d)
			if !handled {
				other = append(other, d.Val())
				d.RemainingArgs()
			}
			return err
		})
	if err != nil {
		t.Fatal(err)
	}
	if s != "a" || time.Duration(dur) != 90*time.Second || n != 7 || size != 10<<20 || !flag ||
		strings.Join(list, " ") != "10.0.0.0/8 fd00::/8 127.0.0.1" || strings.Join(other, " ") != "custom" {
		t.Errorf("read %q %v %d %d %v %v, others %v", s, dur, n, size, flag, list, other)
	}
	for _, tc := range []struct{ input, want string }{
		{"name", "wrong argument count"},
		{"name a b", "wrong argument count"},
		{"wait soon", `wait: "soon" is not a positive duration`},
		{"wait -1s", `wait: "-1s" is not a positive duration`},
		{"count 0", `count: "0" is not a positive integer`},
		{"rate 0", `rate: "0" is not a positive size such as 10MB`},
		{"rate lots", `rate: "lots" is not a positive size`},
		{"on yes", "on takes no arguments"},
		{"allow", "wrong argument count"},
	} {
		err := block(t, "opts {\n"+tc.input+"\n}", func(d *caddyfile.Dispenser) error {
			_, err := tab.Read(d)
			return err
		})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one containing %q", tc.input, err, tc.want)
		}
	}
}

// TestEndpoint: the URL argument, repeated header lines, the option's own
// lines handed on; no URL, a second argument, a bad header line or an
// unknown line is an error.
func TestEndpoint(t *testing.T) {
	var url string
	var h http.Header
	var seen []string
	d := caddyfile.NewTestDispenser("wake https://cp/wake {\n header Authorization \"Bearer x\"\n header X-A 1\n header X-A 2\n timeout 5s\n}")
	d.Next()
	err := Endpoint(d, &url, &h, func(opt string) error {
		seen = append(seen, opt+" "+strings.Join(d.RemainingArgs(), " "))
		return nil
	})
	if err != nil || url != "https://cp/wake" || h.Get("Authorization") != "Bearer x" || strings.Join(h.Values("X-A"), ",") != "1,2" ||
		strings.Join(seen, ";") != "timeout 5s" {
		t.Errorf("err %v, url %q, headers %v, others %v", err, url, h, seen)
	}
	for _, tc := range []struct{ input, want string }{
		{"wake", "wake needs the control plane's URL"},
		{"wake a b", "wrong argument count"},
		{"wake a {\n header X\n}", "header takes a field name and a value, got 1 arguments"},
		{"wake a {\n bogus 1\n}", `unknown wake option "bogus"`},
	} {
		d := caddyfile.NewTestDispenser(tc.input)
		d.Next()
		var u string
		var hh http.Header
		err := Endpoint(d, &u, &hh, func(opt string) error { return d.Errf("unknown wake option %q", opt) })
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one containing %q", tc.input, err, tc.want)
		}
	}
}
