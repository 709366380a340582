package ttfbjson

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// The committed run decodes and encodes again to the very bytes bench
// ttfb wrote (json.MarshalIndent, two spaces, a final newline): no field
// of the document is missing from these types, and none is renamed.
func TestCommittedTTFBRoundTrips(t *testing.T) {
	name := filepath.Join("..", "..", "..", "docs", "bench", "ttfb.json")
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
