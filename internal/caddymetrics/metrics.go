package caddymetrics

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
)

// The process's metrics are read from process state at scrape time: Caddy
// makes a new metrics registry for each config load, while tunnels and
// counters outlive reloads. Each feature adds the collectors of its
// families once (Add, from its package initialization), saying which
// modules move them; every configuration's registry exports them through
// a view (Register).
var (
	sourcesMu sync.Mutex
	sources   []source
	// movers says, for every family (its Desc), the modules that can
	// move it.
	movers = map[*prometheus.Desc][]string{}
)

// A source is a collector of some families and the modules that move
// them.
type source struct {
	c  prometheus.Collector
	by []string
	// ifLoaded: collected only where one of by is loaded (a family whose
	// collection has a cost, such as probing the kernel).
	ifLoaded bool
}

// Add adds collectors of families that the modules by move.
func Add(by []string, cs ...prometheus.Collector) {
	for _, c := range cs {
		add(source{c: c, by: by})
	}
}

// AddIfLoaded adds a collector that a configuration collects only when one
// of by is loaded in it.
func AddIfLoaded(by []string, c prometheus.Collector) {
	add(source{c: c, by: by, ifLoaded: true})
}

func add(s source) {
	ch := make(chan *prometheus.Desc, 32)
	go func() {
		s.c.Describe(ch)
		close(ch)
	}()
	sourcesMu.Lock()
	defer sourcesMu.Unlock()
	for d := range ch {
		movers[d] = s.by
	}
	sources = append(sources, s)
}

// Gathered is a collector of constant metrics read from process state at
// scrape time: Gather sends the series of Descs.
type Gathered struct {
	Descs  []*prometheus.Desc
	Gather func(ch chan<- prometheus.Metric)
}

// Describe implements prometheus.Collector.
func (g *Gathered) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range g.Descs {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (g *Gathered) Collect(ch chan<- prometheus.Metric) { g.Gather(ch) }

// collector is every family of the process.
type collector struct{}

// All is every family of the process, every series (tests, and the
// families' documentation).
var All prometheus.Collector = collector{}

// Describe implements prometheus.Collector.
func (collector) Describe(ch chan<- *prometheus.Desc) {
	for _, s := range snapshotSources() {
		s.c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	c.collect(ch, func(source) bool { return true })
}

// collect sends the series of the sources that include says to ch.
func (collector) collect(ch chan<- prometheus.Metric, include func(source) bool) {
	for _, s := range snapshotSources() {
		if include(s) {
			s.c.Collect(ch)
		}
	}
}

func snapshotSources() []source {
	sourcesMu.Lock()
	defer sourcesMu.Unlock()
	return slices.Clone(sources)
}

// metricsView is what one configuration's metrics registry exports of the
// process's metrics (the collector): the families and series its loaded
// modules can move, and every series that has moved, so that a reload that
// removes a module hides nothing it counted. A series with a module label
// is that module's; one without, its family's (collector.movers). Caddy
// makes a registry for each configuration load; each module adds itself to
// its load's view as it provisions (Register).
type metricsView struct {
	mu      sync.Mutex
	modules map[string]bool
}

// views holds the view of each loaded configuration's registry.
var views = struct {
	sync.Mutex
	m map[*prometheus.Registry]*metricsView
}{m: map[*prometheus.Registry]*metricsView{}}

// Register exports the process's metrics into this configuration's
// registry, with what module can move among them.
func Register(ctx caddy.Context, module string) error {
	if !slices.Contains(moduleid.Any, module) {
		return fmt.Errorf("metrics: %s is not in the tables of the modules that move metrics (internal/moduleid)", module)
	}
	reg := ctx.GetMetricsRegistry()
	views.Lock()
	v := views.m[reg]
	if v == nil {
		v = &metricsView{modules: map[string]bool{}}
		if err := reg.Register(v); err != nil {
			views.Unlock()
			return err
		}
		views.m[reg] = v
		if ctx.Context != nil {
			// The load's context ends when the configuration is unloaded.
			context.AfterFunc(ctx, func() {
				views.Lock()
				delete(views.m, reg)
				views.Unlock()
			})
		}
	}
	views.Unlock()
	v.mu.Lock()
	v.modules[module] = true
	v.mu.Unlock()
	return nil
}

// Describe implements prometheus.Collector: every family the collector
// has, whether or not this configuration exports it.
func (v *metricsView) Describe(ch chan<- *prometheus.Desc) {
	All.Describe(ch)
}

// Collect implements prometheus.Collector.
func (v *metricsView) Collect(ch chan<- prometheus.Metric) {
	v.mu.Lock()
	loaded := maps.Clone(v.modules)
	v.mu.Unlock()
	all := make(chan prometheus.Metric, 64)
	go func() {
		collector{}.collect(all, func(s source) bool {
			return !s.ifLoaded || slices.ContainsFunc(s.by, func(m string) bool { return loaded[m] })
		})
		close(all)
	}()
	for m := range all {
		if exports(m, loaded) {
			ch <- m
		}
	}
}

// exports says whether a configuration whose modules are loaded exports m:
// when one of them can move it, or it has moved.
func exports(m prometheus.Metric, loaded map[string]bool) bool {
	sourcesMu.Lock()
	by, ok := movers[m.Desc()]
	sourcesMu.Unlock()
	if !ok {
		Undeclared(m.Desc().String(), "a family no module is declared to move")
		return true
	}
	var pb dto.Metric
	if err := m.Write(&pb); err != nil {
		return true
	}
	for _, l := range pb.GetLabel() {
		if l.GetName() == "module" {
			by = []string{l.GetValue()}
		}
	}
	if slices.ContainsFunc(by, func(m string) bool { return loaded[m] }) {
		return true
	}
	switch {
	case pb.Counter != nil:
		return pb.Counter.GetValue() != 0
	case pb.Gauge != nil:
		return pb.Gauge.GetValue() != 0
	case pb.Histogram != nil:
		return pb.Histogram.GetSampleCount() != 0
	}
	return true
}

// CounterFamily is a CounterVec whose series are declared where it is
// made, from the tables of the code that observes it: each exists from
// zero, and one that was not declared is counted all the same and
// reported (Undeclared).
type CounterFamily struct {
	*prometheus.CounterVec
	name     string
	declared map[string]bool
}

// NewCounterFamily makes a CounterFamily with a series for every
// combination of the label values (one list per label).
func NewCounterFamily(opts prometheus.CounterOpts, labels []string, values ...[]string) *CounterFamily {
	f := &CounterFamily{CounterVec: prometheus.NewCounterVec(opts, labels), name: opts.Name, declared: map[string]bool{}}
	for _, lvs := range labelSets(values) {
		f.CounterVec.WithLabelValues(lvs...)
		f.declared[strings.Join(lvs, "\x00")] = true
	}
	return f
}

// WithLabelValues returns the counter of lvs.
func (f *CounterFamily) WithLabelValues(lvs ...string) prometheus.Counter {
	if !f.declared[strings.Join(lvs, "\x00")] {
		Undeclared(f.name, strings.Join(lvs, ","))
	}
	return f.CounterVec.WithLabelValues(lvs...)
}

// HistogramFamily is CounterFamily's HistogramVec.
type HistogramFamily struct {
	*prometheus.HistogramVec
	name     string
	declared map[string]bool
}

func NewHistogramFamily(opts prometheus.HistogramOpts, labels []string, values ...[]string) *HistogramFamily {
	f := &HistogramFamily{HistogramVec: prometheus.NewHistogramVec(opts, labels), name: opts.Name, declared: map[string]bool{}}
	for _, lvs := range labelSets(values) {
		f.HistogramVec.WithLabelValues(lvs...)
		f.declared[strings.Join(lvs, "\x00")] = true
	}
	return f
}

// WithLabelValues returns the histogram of lvs.
func (f *HistogramFamily) WithLabelValues(lvs ...string) prometheus.Observer {
	if !f.declared[strings.Join(lvs, "\x00")] {
		Undeclared(f.name, strings.Join(lvs, ","))
	}
	return f.HistogramVec.WithLabelValues(lvs...)
}

// labelSets returns every combination of one value from each list.
func labelSets(values [][]string) [][]string {
	sets := [][]string{nil}
	for _, vs := range values {
		var next [][]string
		for _, set := range sets {
			for _, v := range vs {
				next = append(next, append(slices.Clip(set), v))
			}
		}
		sets = next
	}
	return sets
}

// undeclaredPanics makes Undeclared panic in tests, so that an observation
// the tables miss fails the test that made it.
var undeclaredPanics = testing.Testing()

// Undeclared reports an observation of series, which metric did not
// declare: a table that misses a value some code observes. The observation
// is counted all the same; this is said once per series, at ERROR.
func Undeclared(metric, series string) {
	if undeclaredPanics {
		panic(fmt.Sprintf("metric %s: series %s was not declared: add its label values to the table that declares them", metric, series))
	}
	logUndeclared(caddy.Log(), metric, series)
}

// undeclaredLogged holds the series logUndeclared has logged.
var undeclaredLogged sync.Map

func logUndeclared(logger *zap.Logger, metric, series string) {
	if _, logged := undeclaredLogged.LoadOrStore(metric+"\x00"+series, true); logged {
		return
	}
	logger.Error("metric series not declared: counted, but it had no series from zero (a bug in caddy-ktls: please report it)",
		zap.String("metric", metric), zap.String("series", series))
}

// MovedBy returns the modules that can move the family d (none: a family no
// source added).
func MovedBy(d *prometheus.Desc) []string {
	sourcesMu.Lock()
	defer sourcesMu.Unlock()
	return movers[d]
}
