package loadjson

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// The committed load run decodes and encodes again to the very bytes bench
// load wrote (json.MarshalIndent, two spaces, a final newline): no field of
// the document is missing from these types, and none is renamed.
func TestCommittedLoadRoundTrips(t *testing.T) {
	name := filepath.Join("..", "..", "..", "docs", "bench", "load.json")
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var r Report
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if r.Kind != Kind || r.Schema != Schema {
		t.Errorf("%s: kind %q schema %d, want %q %d", name, r.Kind, r.Schema, Kind, Schema)
	}
	out, err := json.MarshalIndent(&r, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if out = append(out, '\n'); !bytes.Equal(out, data) {
		t.Errorf("%s decoded and encoded again differs from the file:\n%s", name, out)
	}
}

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
