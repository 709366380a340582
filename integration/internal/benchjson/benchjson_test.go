package benchjson

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// The committed runs decode and encode again to the very bytes bench
// wrote (json.MarshalIndent, two spaces, a final newline): no field of a
// document is missing from these types, and none is renamed.
func TestCommittedRunsRoundTrip(t *testing.T) {
	for file, doc := range map[string]interface {
		header() Header
	}{"load.json": &LoadReport{}, "load-gateway.json": &LoadReport{}, "ttfb.json": &TTFBReport{}} {
		name := filepath.Join("..", "..", "..", "docs", "bench", file)
		data, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(doc); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		h := doc.header()
		if want := map[string]Header{"load.json": {Kind: LoadKind, Schema: LoadSchema}, "load-gateway.json": {Kind: LoadKind, Schema: LoadSchema}, "ttfb.json": {Kind: TTFBKind, Schema: TTFBSchema}}[file]; h.Kind != want.Kind || h.Schema != want.Schema {
			t.Errorf("%s: kind %q schema %d, want %q %d", name, h.Kind, h.Schema, want.Kind, want.Schema)
		}
		out, err := json.MarshalIndent(doc, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if out = append(out, '\n'); !bytes.Equal(out, data) {
			t.Errorf("%s decoded and encoded again differs from the file:\n%s", name, out)
		}
	}
}

func (r *LoadReport) header() Header { return r.Header }
func (r *TTFBReport) header() Header { return r.Header }

// A step's memory figures are written when recorded and left out when not
// (0), so that a run before they were recorded reads as one without them.
func TestStepMemoryOmittedWhenZero(t *testing.T) {
	for _, tc := range []struct {
		step Step
		want string
	}{
		{Step{}, `{"rate":0,"seconds":0,"offered":0,"completed":0,"generator_saturated":0,"goodput":0,"p50_us":0,"p99_us":0,"p999_us":0,"max_us":0,"lag_p99_us":0,"lag_max_us":0,"gen_cpu":0,"contender_cpu":0,"settle_s":0}`},
		{Step{ContenderRSS: 3 << 20, ContenderFDs: 7}, `{"rate":0,"seconds":0,"offered":0,"completed":0,"generator_saturated":0,"goodput":0,"p50_us":0,"p99_us":0,"p999_us":0,"max_us":0,"lag_p99_us":0,"lag_max_us":0,"gen_cpu":0,"contender_cpu":0,"contender_rss_bytes":3145728,"contender_fds":7,"settle_s":0}`},
	} {
		got, err := json.Marshal(tc.step)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != tc.want {
			t.Errorf("got  %s\nwant %s", got, tc.want)
		}
	}
}

func TestErrorCount(t *testing.T) {
	s := Step{Errors: map[string]int{ClassRefused: 2, ClassTimeout: 3}}
	if n := s.ErrorCount(); n != 5 {
		t.Errorf("ErrorCount %d, want 5", n)
	}
	if n := (&Step{}).ErrorCount(); n != 0 {
		t.Errorf("ErrorCount of no errors %d, want 0", n)
	}
}
