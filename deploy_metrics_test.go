package caddyktls

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// The operator kit's queries (deploy/grafana/caddy-ktls.json and
// deploy/prometheus/caddy-ktls.rules.yml) against what this binary exports.
// promtool checks the rules' syntax and behaviour (deploy/deploy_test.go);
// this test checks that they read metrics that exist: a query naming a
// metric nobody exports is silently empty, and an alert on it never fires.

const (
	dashboardFile = "deploy/grafana/caddy-ktls.json"
	rulesFile     = "deploy/prometheus/caddy-ktls.rules.yml"
)

// targetLabels are the labels Prometheus adds to every series it scrapes:
// the queries may filter and group by them although /metrics has none.
var targetLabels = []string{"job", "instance"}

// TestDeployQueriesNameExportedMetrics starts Caddy with the module (a
// layer4 forwarder and an HTTP server behind the listener wrapper, so that
// both register their collectors), carries one tunnel (the one family whose
// series only appear after a handshake, caddy_ktls_offload_directions_total,
// then has its series), and scrapes /metrics. Every metric each dashboard
// and alert query names must be in that scrape, every label it filters or
// groups by must be one of that metric's labels, and every literal label
// value it compares with must be one the metric takes.
//
// Why a scrape and not the collectors' descriptors: the queries also read
// Caddy's own metrics (process_open_fds, process_max_fds), which only the
// registry behind /metrics has, and label values only exist in series. The
// test checks that the scrape holds every family the module's collectors
// describe, so that no family goes missing for want of traffic.
func TestDeployQueriesNameExportedMetrics(t *testing.T) {
	e := newSandboxConfig(t, nil)
	// Every module that moves metrics: a configuration exports the
	// families its modules can move. The gateway modules, the lookups
	// (a control plane nobody asks: no request reaches them).
	addGatewayModules(t, e, addGatewaySide(t, e), nil)
	lookup := map[string]any{"handler": "sandbox_lookup", "sandbox": "x", "url": "http://127.0.0.1:9/lookup/{sandbox}"}
	e.cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["wrapped"] = map[string]any{
		"listen":            []string{loopbackAddr(t)},
		"listener_wrappers": []any{map[string]any{"wrapper": "ktls"}},
		"automatic_https":   map[string]any{"disable": true},
		"routes": []any{
			map[string]any{"match": []any{map[string]any{"path": []string{"/lookup"}}}, "handle": []any{lookup}},
			map[string]any{"handle": []any{map[string]any{"handler": "static_response", "body": "ok"}}},
		},
	}
	e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["lookups"] = map[string]any{
		"listen": []string{loopbackAddr(t)},
		"routes": []any{map[string]any{"handle": []any{lookup}}},
	}
	e.start(t)

	const reply = 4 << 10
	up := forwardtest.NewUpstream(t, reply)
	c := e.dial(t, uniqueSandbox("sbx-deploy"), up.Addr())
	if _, err := io.ReadFull(c, make([]byte, reply)); err != nil {
		t.Fatalf("tunnel read: %v", err)
	}
	c.Close()
	waitIdle(t)

	exported := scrapeFamilies(t, parseMetrics(t, e.adminBody(t, "/metrics")))
	// The modes a connection can be offloaded in: only those that
	// happened have a series yet.
	for _, m := range []ktls.Mode{ktls.ModeUserspace, ktls.ModeSW, ktls.ModeHW} {
		exported.addValue("caddy_ktls_offload_directions_total", "mode", m.String())
	}
	for _, name := range describedFamilies(caddymetrics.All) {
		// A histogram is in a scrape as its _bucket, _sum and _count.
		if exported[name] == nil && exported[name+"_count"] == nil {
			t.Errorf("/metrics has no %s, which the module's collectors describe: drive the traffic that makes it appear", name)
		}
	}

	// The checker itself: a name, a label and a value that do not exist.
	for _, bad := range []string{
		`rate(caddy_ktls_no_such_metric_total[5m])`,
		`sum by (sandbox) (rate(caddy_ktls_sandbox_rejects_total[5m]))`,
		`caddy_ktls_sandbox_rejects_total{reason="no-such-reason"}`,
		`caddy_ktls_handshakes_total{reason=~"none|nonne"}`,
	} {
		if errs := exported.check(t, bad); len(errs) == 0 {
			t.Errorf("check(%s) found nothing wrong", bad)
		}
	}
	for _, bad := range []string{
		`caddy_ktls_handshakes_total{module="layer4.handlers.ktls"}`,
		`caddy_ktls_handshakes_total{module=~"layer4.handlers.ktls|caddy.listeners.ktls"}`,
		`caddy_ktls_handshake_duration_seconds_bucket{module!="layer4.handlers.sandbox_proxy"}`,
	} {
		if errs := coversModules(t, bad, moduleid.Engine); len(errs) == 0 {
			t.Errorf("coversModules(%s) found nothing wrong", bad)
		}
	}

	// Every module's series are in the scrape: the handshakes of every
	// module that serves TLS, the gateway modules' included.
	for _, m := range moduleid.Engine {
		if !exported["caddy_ktls_handshakes_total"]["module"][m] {
			t.Errorf("/metrics has no caddy_ktls_handshakes_total series of %s", m)
		}
	}

	used := map[string]bool{}
	queries := 0
	for where, expr := range dashboardQueries(t) {
		queries++
		for _, err := range exported.check(t, expr) {
			t.Errorf("%s %s: %s", dashboardFile, where, err)
		}
		for _, err := range coversModules(t, expr, moduleid.Engine) {
			t.Errorf("%s %s: %s", dashboardFile, where, err)
		}
		markUsed(t, expr, used)
	}
	alerts := ruleExprs(t, rulesFile)
	for name, expr := range alerts {
		for _, err := range exported.check(t, expr) {
			t.Errorf("%s alert %s: %s", rulesFile, name, err)
		}
		if name != "CaddyKTLSGatewayCertificateRefused" { // the forwarder's ktls handler's, by design
			for _, err := range coversModules(t, expr, moduleid.Engine) {
				t.Errorf("%s alert %s: %s", rulesFile, name, err)
			}
		}
		markUsed(t, expr, used)
	}
	if queries < 20 || len(alerts) < 10 {
		t.Errorf("found %d dashboard queries and %d alerts; the files have more", queries, len(alerts))
	}
	var unused []string
	for _, name := range describedFamilies(caddymetrics.All) {
		if !used[name] {
			unused = append(unused, name)
		}
	}
	t.Logf("%d dashboard queries and %d alerts read %d metrics; module families on neither: %v", queries, len(alerts), len(used), unused)
}

// TestDeployDocListsEveryAlert: docs/deploy.md's alert table has a row
// for every alert of the rules file and none for an alert it does not
// have, and its dashboard section names every row of the dashboard.
func TestDeployDocListsEveryAlert(t *testing.T) {
	raw, err := os.ReadFile("docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	section := func(heading string) string {
		_, rest, ok := strings.Cut(doc, "\n"+heading+"\n")
		if !ok {
			t.Fatalf("docs/deploy.md has no %q section", heading)
		}
		body, _, _ := strings.Cut(rest, "\n#")
		return body
	}
	alerts := section("### Alerts")
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(CaddyKTLS[A-Za-z]+)`").FindAllStringSubmatch(alerts, -1) {
		listed[m[1]] = true
	}
	rules := ruleExprs(t, rulesFile)
	for name := range rules {
		if !listed[name] {
			t.Errorf("docs/deploy.md#alerts has no row for the alert %s (%s)", name, rulesFile)
		}
	}
	for name := range listed {
		if _, ok := rules[name]; !ok {
			t.Errorf("docs/deploy.md#alerts lists %s, which %s does not have", name, rulesFile)
		}
	}
	if len(listed) < 19 {
		t.Errorf("read %d alert rows from docs/deploy.md; it has more", len(listed))
	}

	dashboard := strings.ToLower(strings.Join(strings.Fields(section("### Dashboard")), " "))
	var dash struct {
		Panels []struct {
			Type  string `json:"type"`
			Title string `json:"title"`
		} `json:"panels"`
	}
	rawDash, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(rawDash, &dash); err != nil {
		t.Fatal(err)
	}
	rows := 0
	for _, p := range dash.Panels {
		if p.Type != "row" {
			continue
		}
		rows++
		title, _, _ := strings.Cut(strings.ToLower(p.Title), " (")
		if !strings.Contains(dashboard, title) {
			t.Errorf("docs/deploy.md#dashboard does not name the dashboard's row %q", p.Title)
		}
	}
	if rows < 6 {
		t.Errorf("read %d rows from %s; it has more", rows, dashboardFile)
	}
}

// coversModules returns an error for each selector of expr on a
// per-module metric of the kTLS engine (handshakes, their failures and
// durations, engine closes) whose module matcher leaves out one of modules:
// the series of every module that serves TLS count in the dashboard's
// ratios and the alerts.
func coversModules(t *testing.T, expr string, modules []string) []error {
	t.Helper()
	q, err := parsePromQL(expr)
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	var errs []error
	for _, s := range q.selectors {
		if !strings.HasPrefix(s.metric, "caddy_ktls_handshake") && s.metric != "caddy_ktls_connections_closed_total" {
			continue
		}
		for _, m := range s.matchers {
			if m.label != "module" {
				continue
			}
			for _, mod := range modules {
				if !matcherAccepts(t, m, mod) {
					errs = append(errs, fmt.Errorf("%s{module%s%q} leaves out the module %s", s.metric, m.op, m.value, mod))
				}
			}
		}
	}
	return errs
}

// matcherAccepts says whether the label matcher m accepts the value v.
func matcherAccepts(t *testing.T, m promMatcher, v string) bool {
	t.Helper()
	switch m.op {
	case "=":
		return v == m.value
	case "!=":
		return v != m.value
	}
	re, err := regexp.Compile("^(?:" + m.value + ")$")
	if err != nil {
		t.Fatalf("matcher %v: %v", m, err)
	}
	return re.MatchString(v) == (m.op == "=~")
}

// families maps each metric of a scrape to its labels and their values.
type families map[string]map[string]map[string]bool

func (f families) addValue(metric, label, value string) {
	if f[metric] == nil {
		f[metric] = map[string]map[string]bool{}
	}
	if f[metric][label] == nil {
		f[metric][label] = map[string]bool{}
	}
	f[metric][label][value] = true
}

// scrapeFamilies reads the series parseMetrics returned (name{labels}).
func scrapeFamilies(t *testing.T, series map[string]float64) families {
	t.Helper()
	f := families{}
	for s := range series {
		name, labels, _ := strings.Cut(s, "{")
		if f[name] == nil {
			f[name] = map[string]map[string]bool{}
		}
		if labels == "" {
			continue
		}
		ms, err := parseMatchers(strings.TrimSuffix(labels, "}") + "}")
		if err != nil {
			t.Fatalf("/metrics series %s: %v", s, err)
		}
		for _, m := range ms {
			f.addValue(name, m.label, m.value)
		}
	}
	return f
}

// describedFamilies returns the metric names the collectors describe.
func describedFamilies(cs ...prometheus.Collector) []string {
	re := regexp.MustCompile(`fqName: "([^"]+)"`)
	var names []string
	for _, c := range cs {
		ch := make(chan *prometheus.Desc)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			if m := re.FindStringSubmatch(d.String()); m != nil {
				names = append(names, m[1])
			}
		}
	}
	sort.Strings(names)
	return names
}

// check returns what is wrong with the metrics, labels and label values
// expr names.
func (f families) check(t *testing.T, expr string) []error {
	t.Helper()
	q, err := parsePromQL(expr)
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	if len(q.selectors) == 0 {
		return []error{fmt.Errorf("%q names no metric", expr)}
	}
	var errs []error
	for _, s := range q.selectors {
		labels, ok := f[s.metric]
		if !ok {
			errs = append(errs, fmt.Errorf("metric %s is not exported (not in /metrics)", s.metric))
			continue
		}
		for _, m := range s.matchers {
			if slices.Contains(targetLabels, m.label) {
				continue
			}
			values, ok := labels[m.label]
			if !ok {
				errs = append(errs, fmt.Errorf("%s has no label %q (it has %v)", s.metric, m.label, sortedKeys(labels)))
				continue
			}
			for _, v := range literalValues(m) {
				if !values[v] {
					errs = append(errs, fmt.Errorf("%s{%s} never takes the value %q (it takes %v)", s.metric, m.label, v, sortedKeys(values)))
				}
			}
		}
	}
	for _, l := range q.groupLabels {
		if slices.Contains(targetLabels, l) {
			continue
		}
		if !slices.ContainsFunc(q.selectors, func(s promSelector) bool { _, ok := f[s.metric][l]; return ok }) {
			errs = append(errs, fmt.Errorf("grouping label %q is a label of none of the metrics of %q", l, expr))
		}
	}
	return errs
}

// literalValues returns the label values a matcher compares with, when it
// names them literally: the value of = and !=, the alternatives of a =~ or
// !~ that is a plain list (a|b|c). A Grafana variable ($x) or a real regular
// expression names none.
func literalValues(m promMatcher) []string {
	if strings.Contains(m.value, "$") {
		return nil
	}
	switch m.op {
	case "=", "!=":
		return []string{m.value}
	}
	if !regexp.MustCompile(`^[A-Za-z0-9_.:-]+(\|[A-Za-z0-9_.:-]+)*$`).MatchString(m.value) {
		return nil
	}
	return strings.Split(m.value, "|")
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func markUsed(t *testing.T, expr string, used map[string]bool) {
	t.Helper()
	q, err := parsePromQL(expr)
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	for _, s := range q.selectors {
		used[s.metric] = true
		// A histogram's series name its family.
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if base, ok := strings.CutSuffix(s.metric, suffix); ok {
				used[base] = true
			}
		}
	}
}

// dashboardQueries returns every PromQL query of the Grafana dashboard by
// where it is: each panel target's expr (rows' nested panels included) and
// each query variable's label_values() selector. It fails t on a panel
// without a query.
func dashboardQueries(t *testing.T) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		ID      int    `json:"id"`
		Type    string `json:"type"`
		Title   string `json:"title"`
		Targets []struct {
			Expr  string `json:"expr"`
			RefID string `json:"refId"`
		} `json:"targets"`
		Panels []json.RawMessage `json:"panels"`
	}
	var dash struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	out := map[string]string{}
	var walk func([]json.RawMessage)
	walk = func(ps []json.RawMessage) {
		for _, r := range ps {
			var p panel
			if err := json.Unmarshal(r, &p); err != nil {
				t.Fatalf("%s: %v", dashboardFile, err)
			}
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if len(p.Targets) == 0 {
				t.Errorf("%s: panel %d %q has no query", dashboardFile, p.ID, p.Title)
			}
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" {
					t.Errorf("%s: panel %d %q: target %s has no expr", dashboardFile, p.ID, p.Title, tg.RefID)
				}
				out[fmt.Sprintf("panel %d %q target %s", p.ID, p.Title, tg.RefID)] = tg.Expr
			}
		}
	}
	walk(dash.Panels)
	labelValues := regexp.MustCompile(`^label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\)$`)
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			if err := json.Unmarshal(v.Query, &q.Query); err != nil {
				t.Fatalf("%s: variable %s: query: %v", dashboardFile, v.Name, err)
			}
		}
		m := labelValues.FindStringSubmatch(strings.TrimSpace(q.Query))
		if m == nil {
			t.Errorf("%s: variable %s: %q is not label_values(<selector>, <label>)", dashboardFile, v.Name, q.Query)
			continue
		}
		// The label it lists must be on the selector: check it as a grouping.
		out["variable "+v.Name] = fmt.Sprintf("sum by (%s) (%s)", m[2], m[1])
	}
	return out
}

// ruleExprs returns the expr of every alerting or recording rule in a rules
// file, by the rule's name. It reads the YAML this project writes (no YAML
// library is a dependency): `- alert:` or `- record:` items, each with an
// `expr:` that is a plain or quoted scalar on its line or a block scalar
// (| or >) on the lines indented below it.
func ruleExprs(t *testing.T, path string) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(raw), "\n")
	indent := func(s string) int { return len(s) - len(strings.TrimLeft(s, " ")) }
	out := map[string]string{}
	name, rules := "", 0
	for i := 0; i < len(lines); i++ {
		line := strings.TrimSpace(lines[i])
		if rest, ok := strings.CutPrefix(line, "- alert:"); ok {
			name, rules = strings.TrimSpace(rest), rules+1
		} else if rest, ok := strings.CutPrefix(line, "- record:"); ok {
			name, rules = strings.TrimSpace(rest), rules+1
		}
		value, ok := strings.CutPrefix(line, "expr:")
		if !ok {
			continue
		}
		if name == "" || out[name] != "" {
			t.Fatalf("%s:%d: an expr without a rule of its own", path, i+1)
		}
		value = strings.TrimSpace(value)
		switch {
		case value == "|" || value == "|-" || value == ">" || value == ">-":
			var block []string
			key := indent(lines[i])
			for i+1 < len(lines) && (strings.TrimSpace(lines[i+1]) == "" || indent(lines[i+1]) > key) {
				i++
				block = append(block, lines[i])
			}
			value = strings.Join(block, "\n")
		case strings.HasPrefix(value, `"`):
			if value, err = strconv.Unquote(value); err != nil {
				t.Fatalf("%s:%d: %v", path, i+1, err)
			}
		case strings.HasPrefix(value, "'"):
			value = strings.ReplaceAll(strings.TrimSuffix(strings.TrimPrefix(value, "'"), "'"), "''", "'")
		}
		if strings.TrimSpace(value) == "" {
			t.Fatalf("%s:%d: rule %s: empty expr", path, i+1, name)
		}
		out[name] = value
	}
	if rules == 0 || len(out) != rules {
		t.Fatalf("%s: %d rules, %d exprs read", path, rules, len(out))
	}
	return out
}

// A PromQL reader that knows just enough of the language to find the
// metrics, label matchers and grouping labels of a query: the vector
// selectors (a name not followed by "(", with its {matchers}), and the
// label lists of by, without, on, ignoring, group_left and group_right.
// Ranges and subqueries ([...]) are skipped whole, Grafana's
// $__rate_interval included.

type promMatcher struct{ label, op, value string }

type promSelector struct {
	metric   string
	matchers []promMatcher
}

type promQuery struct {
	selectors   []promSelector
	groupLabels []string
}

type promToken struct {
	kind byte // 'i' identifier, 's' string, 'n' number or duration, 'v' Grafana variable, 'p' punctuation
	text string
}

func lexPromQL(s string) ([]promToken, error) {
	var toks []promToken
	isIdent := func(c byte, first bool) bool {
		return c == '_' || c == ':' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || !first && '0' <= c && c <= '9'
	}
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '#':
			for i < len(s) && s[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			j := i + 1
			for j < len(s) && s[j] != c {
				if s[j] == '\\' && c != '`' {
					j++
				}
				j++
			}
			if j >= len(s) {
				return nil, fmt.Errorf("unterminated string at %d", i)
			}
			v := s[i+1 : j]
			if c == '"' {
				u, err := strconv.Unquote(s[i : j+1])
				if err != nil {
					return nil, fmt.Errorf("string at %d: %v", i, err)
				}
				v = u
			}
			toks = append(toks, promToken{'s', v})
			i = j + 1
		case c == '[':
			j := strings.IndexByte(s[i:], ']')
			if j < 0 {
				return nil, fmt.Errorf("unterminated [ at %d", i)
			}
			i += j + 1
		case '0' <= c && c <= '9' || c == '.':
			j := i
			for j < len(s) && (isIdent(s[j], false) || s[j] == '.') {
				j++
			}
			toks = append(toks, promToken{'n', s[i:j]})
			i = j
		case c == '$':
			j := i + 1
			for j < len(s) && (isIdent(s[j], false) || s[j] == '{' || s[j] == '}') {
				j++
			}
			toks = append(toks, promToken{'v', s[i:j]})
			i = j
		case isIdent(c, true):
			j := i
			for j < len(s) && isIdent(s[j], false) {
				j++
			}
			toks = append(toks, promToken{'i', s[i:j]})
			i = j
		default:
			if i+1 < len(s) && slices.Contains([]string{"!=", "=~", "!~", "==", ">=", "<="}, s[i:i+2]) {
				toks = append(toks, promToken{'p', s[i : i+2]})
				i += 2
			} else if strings.IndexByte("{}(),=+-*/%^<>@", c) >= 0 {
				toks = append(toks, promToken{'p', s[i : i+1]})
				i++
			} else {
				return nil, fmt.Errorf("unexpected %q at %d", c, i)
			}
		}
	}
	return toks, nil
}

// parseMatchers reads label matchers up to and including the closing "}".
func parseMatchers(s string) ([]promMatcher, error) {
	toks, err := lexPromQL(s)
	if err != nil {
		return nil, err
	}
	ms, n, err := matchersAt(toks, 0)
	if err == nil && n != len(toks) {
		err = fmt.Errorf("%q: trailing tokens", s)
	}
	return ms, err
}

// matchersAt reads the matchers that follow an opening "{" (at toks[i:])
// and returns them with the index past the closing "}".
func matchersAt(toks []promToken, i int) ([]promMatcher, int, error) {
	var ms []promMatcher
	for {
		if i < len(toks) && toks[i].text == "}" {
			return ms, i + 1, nil
		}
		if i+2 >= len(toks) || toks[i].kind != 'i' || toks[i+1].kind != 'p' || toks[i+2].kind != 's' ||
			!slices.Contains([]string{"=", "!=", "=~", "!~"}, toks[i+1].text) {
			return nil, 0, fmt.Errorf("bad label matcher at token %d", i)
		}
		ms = append(ms, promMatcher{toks[i].text, toks[i+1].text, toks[i+2].text})
		i += 3
		if i < len(toks) && toks[i].text == "," {
			i++
		}
	}
}

func parsePromQL(expr string) (promQuery, error) {
	toks, err := lexPromQL(expr)
	if err != nil {
		return promQuery{}, err
	}
	var q promQuery
	next := func(i int) string {
		if i+1 < len(toks) {
			return toks[i+1].text
		}
		return ""
	}
	for i := 0; i < len(toks); i++ {
		tk := toks[i]
		switch {
		case tk.kind == 'i' && slices.Contains([]string{"by", "without", "on", "ignoring", "group_left", "group_right"}, tk.text):
			if next(i) != "(" {
				continue
			}
			for i += 2; i < len(toks) && toks[i].text != ")"; i++ {
				if toks[i].kind == 'i' {
					q.groupLabels = append(q.groupLabels, toks[i].text)
				} else if toks[i].text != "," {
					return q, fmt.Errorf("bad label list in %q", expr)
				}
			}
			if i >= len(toks) {
				return q, fmt.Errorf("unterminated label list in %q", expr)
			}
		case tk.kind == 'i' && slices.Contains([]string{"and", "or", "unless", "bool", "offset", "atan2"}, tk.text),
			tk.kind == 'i' && slices.Contains([]string{"inf", "nan"}, strings.ToLower(tk.text)):
		case tk.kind == 'i' && (next(i) == "(" || next(i) == "by" || next(i) == "without"):
			// A function or an aggregation.
		case tk.kind == 'i':
			s := promSelector{metric: tk.text}
			if next(i) == "{" {
				ms, n, err := matchersAt(toks, i+2)
				if err != nil {
					return q, fmt.Errorf("%s: %v", expr, err)
				}
				s.matchers, i = ms, n-1
			}
			q.selectors = append(q.selectors, s)
		case tk.text == "{":
			return q, fmt.Errorf("%q: a selector without a metric name", expr)
		}
	}
	return q, nil
}

func TestParsePromQL(t *testing.T) {
	q, err := parsePromQL(`(
	  sum by (job, reason) (rate(a_total{reason!~"x|y", job=~"$job"}[$__rate_interval]))
	/ ignoring (reason) group_left ()
	  (sum without (le) (b_total) + max(c offset 5m))
	) > 0.05 and on (instance) d{e="f"} == bool 1`)
	if err != nil {
		t.Fatal(err)
	}
	want := promQuery{
		selectors: []promSelector{
			{"a_total", []promMatcher{{"reason", "!~", "x|y"}, {"job", "=~", "$job"}}},
			{"b_total", nil}, {"c", nil}, {"d", []promMatcher{{"e", "=", "f"}}},
		},
		groupLabels: []string{"job", "reason", "reason", "le", "instance"},
	}
	if fmt.Sprint(q) != fmt.Sprint(want) {
		t.Errorf("parsePromQL:\n got %+v\nwant %+v", q, want)
	}
	for _, bad := range []string{`{__name__="x"}`, `x{a="b"`, `x{a=b}`, `sum by (a`} {
		if _, err := parsePromQL(bad); err == nil {
			t.Errorf("parsePromQL(%q): no error", bad)
		}
	}
}
