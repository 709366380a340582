package caddyktls

import (
	"slices"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/prometheus/client_golang/prometheus"
)

// TestMetricsHelp checks what the module's metric families say about
// themselves, as an operator reads them on /metrics: every label is named
// in the HELP text, every value of a label with a small fixed set of values
// is named and explained there, and no name is a Go-internal one (the
// method that happens to count, such as ReadFrom).
func TestMetricsHelp(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(caddymetrics.All)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	// Labels whose every value the HELP text must name. The others (the
	// module IDs, a rejection or handshake-failure reason from a long
	// list, a histogram's le) are named by a pointer or a rule instead.
	enumerated := []string{"event", "mode", "path", "direction", "outcome", "feature", "result"}
	// What HELP must name for a label that is not enumerated, or whose
	// series appear only with traffic (the offload modes).
	mustName := map[string][]string{
		"caddy_ktls_handshakes_total/reason":       {"none", "rx-disabled", "handshake-failed", "userspace"},
		"caddy_ktls_offload_directions_total/mode": {"sw", "hw", "userspace", "not offloaded"},
	}
	seen := 0
	for _, f := range families {
		name, help := f.GetName(), f.GetHelp()
		if !strings.HasPrefix(name, "caddy_ktls_") {
			continue
		}
		seen++
		for _, internal := range []string{"readfrom", "read_from", "writeto", "splice_read"} {
			if strings.Contains(name, internal) {
				t.Errorf("%s: a Go-internal name (%s): name what it counts for the operator", name, internal)
			}
		}
		values := map[string][]string{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(values[l.GetName()], l.GetValue()) {
					values[l.GetName()] = append(values[l.GetName()], l.GetValue())
				}
			}
		}
		for _, label := range []string{"reason", "mode"} {
			if want := mustName[name+"/"+label]; want != nil && values[label] == nil {
				values[label] = nil // no series yet: check the names all the same
			}
		}
		for label, vs := range values {
			if !strings.Contains(help, label) {
				t.Errorf("%s: HELP does not name its label %q: %q", name, label, help)
			}
			if slices.Contains(enumerated, label) {
				for _, v := range vs {
					if !strings.Contains(help, v) {
						t.Errorf("%s: HELP does not say what %s=%q counts: %q", name, label, v, help)
					}
				}
			}
			for _, v := range mustName[name+"/"+label] {
				if !strings.Contains(help, v) {
					t.Errorf("%s: HELP does not say what %s=%q counts: %q", name, label, v, help)
				}
			}
		}
	}
	if seen < 15 {
		t.Fatalf("gathered %d caddy_ktls_ families, want the module's every family", seen)
	}
	// Not offloaded is not offloaded: the HELP of a family that counts
	// userspace connections does not call them offloaded.
	for _, f := range families {
		if help := f.GetHelp(); strings.HasPrefix(help, "Offloaded connections") {
			t.Errorf("%s: HELP calls every connection it counts offloaded, userspace ones included: %q", f.GetName(), help)
		}
	}
}
