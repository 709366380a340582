package caddyktls

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// Real activity reports, as a running forwarder POSTs them, validate
// against docs/activity-report.schema.json; each carries an ID of the
// configured instance, the process start and a sequence that grows by one
// per report; a retry resends the very same body; per sandbox the totals
// are the running sum of the deltas and end at exactly the bytes moved;
// and GET /sandbox/activity shows the last report's ID and sequence and
// the same totals.
func TestSandboxActivityReportSchema(t *testing.T) {
	schema := loadSchema(t, "docs/activity-report.schema.json")
	sizes := []int64{3<<20 + 5, 70001}
	sandbox := uniqueSandbox("sbx-schema")
	var mu sync.Mutex
	var bodies [][]byte
	var failedOnce bool
	push := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var buf bytes.Buffer
		buf.ReadFrom(r.Body)
		w.Header().Set("Connection", "close")
		mu.Lock()
		defer mu.Unlock()
		bodies = append(bodies, buf.Bytes())
		if !failedOnce {
			// The first report is refused once: its retry must be the same body.
			failedOnce = true
			http.Error(w, "try again", http.StatusInternalServerError)
		}
	}))
	t.Cleanup(push.Close)
	e := newSandboxEnv(t, map[string]any{"activity_push": map[string]any{"url": push.URL, "interval": "30ms", "backoff": "10ms", "instance": "fwd-test-1"}})
	forwardtest.CheckLeaks(t)
	var movedTo, movedFrom int64
	for i, size := range sizes {
		up := forwardtest.NewUpstream(t, size+3)
		e.exactTunnel(t, sandbox, up, size, uint64(40+i))
		movedTo, movedFrom = movedTo+size, movedFrom+size+3
	}
	var reports []forward.ActivityReport
	var lastSeen forward.SandboxDelta
	defer func() {
		if t.Failed() {
			t.Logf("the last entry for %s: %+v; pushers %+v", sandbox, lastSeen, forwarder.ActivityReports())
		}
	}()
	waitUntil(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		reports = reports[:0]
		var seen []string
		for _, b := range bodies {
			var rep forward.ActivityReport
			if err := json.Unmarshal(b, &rep); err != nil {
				t.Fatalf("report %s: %v", b, err)
			}
			if !slices.Contains(seen, rep.ID) { // a retry's copy counts once
				seen = append(seen, rep.ID)
				reports = append(reports, rep)
			}
		}
		for _, rep := range slices.Backward(reports) {
			for _, d := range rep.Sandboxes {
				if d.Sandbox == sandbox {
					lastSeen = d
					return d.TotalBytesToSandbox == movedTo && d.TotalBytesFromSandbox == movedFrom && d.OpenTunnels == 0
				}
			}
		}
		return false
	}, fmt.Sprintf("a report with totals %d/%d and no tunnel open", movedTo, movedFrom))
	mu.Lock()
	captured := slices.Clone(bodies)
	mu.Unlock()
	if len(captured) < 2 || !bytes.Equal(captured[0], captured[1]) {
		t.Errorf("the refused first report was not resent as the same body:\n%s\n%s", captured[0], captured[min(1, len(captured)-1)])
	}
	for _, b := range captured {
		if err := schema.validate(decodeJSON(t, b)); err != nil {
			t.Errorf("report %s does not validate: %v", b, err)
		}
	}
	var to, from int64
	for i, rep := range reports {
		want := fmt.Sprintf("fwd-test-1/%d/%d", forwarder.Tunnels().Started().UnixNano(), rep.Sequence)
		if rep.ID != want || rep.Instance != "fwd-test-1" || !rep.ProcessStart.Equal(forwarder.Tunnels().Started()) {
			t.Errorf("report %d: id %q, instance %q, process_start %v; want %q, fwd-test-1, %v", i, rep.ID, rep.Instance, rep.ProcessStart, want, forwarder.Tunnels().Started())
		}
		if i > 0 && rep.Sequence != reports[i-1].Sequence+1 {
			t.Errorf("report %d: sequence %d after %d, want consecutive", i, rep.Sequence, reports[i-1].Sequence)
		}
		for _, d := range rep.Sandboxes {
			if d.Sandbox != sandbox {
				continue
			}
			to, from = to+d.BytesToSandbox, from+d.BytesFromSandbox
			if d.TotalBytesToSandbox != to || d.TotalBytesFromSandbox != from {
				t.Errorf("report %d: totals %d/%d, want the running sum of the deltas %d/%d", rep.Sequence, d.TotalBytesToSandbox, d.TotalBytesFromSandbox, to, from)
			}
		}
	}
	if to != movedTo || from != movedFrom {
		t.Errorf("deltas sum to %d/%d, want the %d/%d bytes moved", to, from, movedTo, movedFrom)
	}
	last := reports[len(reports)-1]
	var act forwarder.ActivityResponse
	e.adminGet(t, "/sandbox/activity", &act)
	if act.LastReport == nil || act.LastReport.ID != last.ID || act.LastReport.Sequence != last.Sequence {
		t.Errorf("GET /sandbox/activity last_report %+v, want the last report's id %s and sequence %d", act.LastReport, last.ID, last.Sequence)
	}
	i := slices.IndexFunc(act.Sandboxes, func(a forward.SandboxActivity) bool { return a.Sandbox == sandbox })
	if i < 0 {
		t.Fatalf("GET /sandbox/activity has no %s", sandbox)
	}
	if a := act.Sandboxes[i]; a.ReportedBytesToSandbox != movedTo || a.ReportedBytesFromSandbox != movedFrom ||
		a.BytesToSandbox != movedTo || a.BytesFromSandbox != movedFrom {
		t.Errorf("GET /sandbox/activity %+v, want bytes and reported totals %d/%d", a, movedTo, movedFrom)
	}
}

// The schema checker rejects what the schema forbids, so that a report
// passing it means something: each mutation of a valid report fails.
func TestActivityReportSchemaRejects(t *testing.T) {
	schema := loadSchema(t, "docs/activity-report.schema.json")
	valid := `{"id":"fwd-1/1764456000000000000/42","instance":"fwd-1","process_start":"2026-11-29T22:40:00Z","sequence":42,` +
		`"sent_at":"2026-11-29T22:41:28.5Z","sandboxes":[{"sandbox":"sbx-1","bytes_to_sandbox":1024,"bytes_from_sandbox":4096,` +
		`"open_tunnels":1,"last_activity":"2026-11-29T22:41:27.5+01:00","total_bytes_to_sandbox":8192,"total_bytes_from_sandbox":65536,` +
		`"since":"2026-11-29T22:40:03Z"}]}`
	if err := schema.validate(decodeJSON(t, []byte(valid))); err != nil {
		t.Fatalf("the valid report fails: %v", err)
	}
	for _, c := range []struct{ from, to, want string }{
		{`"sequence":42,`, `"sequence":42,"extra":1,`, "extra"},
		{`"instance":"fwd-1",`, ``, "instance"},
		{`"sequence":42`, `"sequence":0`, "minimum"},
		{`"sequence":42`, `"sequence":4.5`, "integer"},
		{`"bytes_to_sandbox":1024`, `"bytes_to_sandbox":-1`, "minimum"},
		{`/42"`, `/x"`, "pattern"},
		{`"sandboxes":[`, `"sandboxes":[1,`, "object"},
		{`"open_tunnels":1,`, `"open_tunnels":1,"peer":"x",`, "peer"},
		{`"since":"2026-11-29T22:40:03Z"`, `"since":"yesterday"`, "pattern"},
		{`"sandbox":"sbx-1"`, `"sandbox":7`, "string"},
	} {
		doc := strings.Replace(valid, c.from, c.to, 1)
		if doc == valid {
			t.Fatalf("mutation %q changed nothing", c.from)
		}
		if err := schema.validate(decodeJSON(t, []byte(doc))); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s -> %s: error %v, want one naming %q", c.from, c.to, err, c.want)
		}
	}
}

// jsonSchema is the subset of JSON Schema that the repository's schemas
// use: type, required, properties, additionalProperties false, items,
// minimum and pattern. A keyword outside it fails loadSchema, so that a
// schema never says more than this checker enforces.
type jsonSchema struct {
	Type                 string                 `json:"type"`
	Required             []string               `json:"required"`
	Properties           map[string]*jsonSchema `json:"properties"`
	AdditionalProperties *bool                  `json:"additionalProperties"`
	Items                *jsonSchema            `json:"items"`
	Minimum              *json.Number           `json:"minimum"`
	Pattern              string                 `json:"pattern"`
	re                   *regexp.Regexp
}

var schemaKeywords = []string{"$schema", "$id", "title", "description", "type", "required", "properties",
	"additionalProperties", "items", "minimum", "pattern"}

func loadSchema(t *testing.T, path string) *jsonSchema {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s, err := parseSchema(raw)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return s
}

func parseSchema(raw []byte) (*jsonSchema, error) {
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(raw, &keys); err != nil {
		return nil, err
	}
	for k := range keys {
		if !slices.Contains(schemaKeywords, k) {
			return nil, fmt.Errorf("keyword %q: the checker does not enforce it", k)
		}
	}
	var s jsonSchema
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var err error
	if err = dec.Decode(&s); err != nil {
		return nil, err
	}
	if s.AdditionalProperties != nil && *s.AdditionalProperties {
		return nil, fmt.Errorf("additionalProperties true: leave it out")
	}
	if s.Pattern != "" {
		if s.re, err = regexp.Compile(s.Pattern); err != nil {
			return nil, err
		}
	}
	var props map[string]json.RawMessage
	json.Unmarshal(keys["properties"], &props)
	for name := range s.Properties {
		if s.Properties[name], err = parseSchema(props[name]); err != nil {
			return nil, fmt.Errorf("properties.%s: %w", name, err)
		}
	}
	if s.Items != nil {
		if s.Items, err = parseSchema(keys["items"]); err != nil {
			return nil, fmt.Errorf("items: %w", err)
		}
	}
	return &s, nil
}

func decodeJSON(t *testing.T, b []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return v
}

// validate returns the first way v breaks s, naming where.
func (s *jsonSchema) validate(v any) error { return s.check(v, "$") }

func (s *jsonSchema) check(v any, at string) error {
	switch s.Type {
	case "object":
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: %v is not an object", at, v)
		}
		for _, r := range s.Required {
			if _, ok := m[r]; !ok {
				return fmt.Errorf("%s: required %q missing", at, r)
			}
		}
		names := make([]string, 0, len(m))
		for k := range m {
			names = append(names, k)
		}
		sort.Strings(names)
		for _, k := range names {
			sub, ok := s.Properties[k]
			if !ok {
				if s.AdditionalProperties != nil {
					return fmt.Errorf("%s: property %q not allowed (additionalProperties false)", at, k)
				}
				continue
			}
			if err := sub.check(m[k], at+"."+k); err != nil {
				return err
			}
		}
	case "array":
		a, ok := v.([]any)
		if !ok {
			return fmt.Errorf("%s: %v is not an array", at, v)
		}
		if s.Items != nil {
			for i, e := range a {
				if err := s.Items.check(e, fmt.Sprintf("%s[%d]", at, i)); err != nil {
					return err
				}
			}
		}
	case "string":
		str, ok := v.(string)
		if !ok {
			return fmt.Errorf("%s: %v is not a string", at, v)
		}
		if s.re != nil && !s.re.MatchString(str) {
			return fmt.Errorf("%s: %q does not match the pattern %s", at, str, s.Pattern)
		}
	case "integer", "number":
		n, ok := v.(json.Number)
		if !ok {
			return fmt.Errorf("%s: %v is not a number", at, v)
		}
		if _, err := n.Int64(); s.Type == "integer" && err != nil {
			return fmt.Errorf("%s: %s is not an integer", at, n)
		}
		if s.Minimum != nil {
			f, _ := n.Float64()
			if lo, _ := s.Minimum.Float64(); f < lo {
				return fmt.Errorf("%s: %s is below the minimum %s", at, n, s.Minimum)
			}
		}
	case "":
	default:
		return fmt.Errorf("%s: type %q: the checker does not know it", at, s.Type)
	}
	return nil
}
