package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
)

// mergedRun is one harness run of a merged document.
type mergedRun struct {
	date       string
	contenders []string
}

// mergeResults joins the documents of several harness runs, e.g. two VMs
// run side by side with the contenders split between them, into one report.
// They must come from the same setup (schema, mode, kernel, guest, Go,
// parameters) for their cells to compare; a contender measured twice on one
// shape is refused rather than one of the two silently picked.
func mergeResults(docs []*Results) (*Results, error) {
	if len(docs) == 1 {
		return docs[0], nil
	}
	first := docs[0]
	m := *first
	m.Results, m.Skipped, m.Notes = nil, nil, nil
	m.TLSStatDelta = map[string]float64{}
	var dates []string
	cell := map[[2]string]int{}
	for i, d := range docs {
		for _, f := range []struct{ name, a, b string }{
			{"mode", first.Mode, d.Mode}, {"kernel", first.Kernel, d.Kernel},
			{"host", first.Host, d.Host}, {"go", first.Go, d.Go}, {"commit", first.Commit, d.Commit},
		} {
			if f.a != f.b {
				return nil, fmt.Errorf("run %d: %s %q, run 1: %q: only runs of one setup merge", i+1, f.name, f.b, f.a)
			}
		}
		if !sameParams(first.Params, d.Params) {
			return nil, fmt.Errorf("run %d: parameters differ from run 1's: only runs of one setup merge", i+1)
		}
		run := mergedRun{date: d.Date}
		for _, res := range d.Results {
			key := [2]string{res.Contender, res.Shape}
			if j, dup := cell[key]; dup {
				return nil, fmt.Errorf("%s on %s is in run %d and run %d", res.Contender, res.Shape, j, i+1)
			}
			cell[key] = i + 1
			m.Results = append(m.Results, res)
			if !slices.Contains(run.contenders, res.Contender) {
				run.contenders = append(run.contenders, res.Contender)
			}
		}
		m.merged = append(m.merged, run)
		dates = append(dates, d.Date)
		m.Skipped = append(m.Skipped, d.Skipped...)
		for _, n := range d.Notes {
			if !slices.Contains(m.Notes, n) {
				m.Notes = append(m.Notes, n)
			}
		}
		for k, v := range d.TLSStatDelta {
			m.TLSStatDelta[k] += v
		}
	}
	m.Date = strings.Join(dates, ", ")
	m.OK = allOK(docs)
	return &m, nil
}

// allOK is false when any run failed, unknown (nil) when any run did not
// say, true otherwise.
func allOK(docs []*Results) *bool {
	var unknown bool
	for _, d := range docs {
		switch {
		case d.OK == nil:
			unknown = true
		case !*d.OK:
			return d.OK
		}
	}
	if unknown {
		return nil
	}
	return docs[0].OK
}

// sameParams compares two parameter sets value by value.
func sameParams(a, b map[string]json.RawMessage) bool {
	if len(a) != len(b) {
		return false
	}
	for k, va := range a {
		vb, ok := b[k]
		if !ok {
			return false
		}
		var ca, cb bytes.Buffer
		if json.Compact(&ca, va) != nil || json.Compact(&cb, vb) != nil || ca.String() != cb.String() {
			return false
		}
	}
	return true
}
