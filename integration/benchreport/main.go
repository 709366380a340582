// Command benchreport renders the benchmark reports of issue 7 from
// measurements, deterministically (the same input gives byte-identical
// output):
//
//	benchreport results -in docs/bench/results-1.json,docs/bench/results-2.json -md docs/bench/results.md -png docs/bench/results.png
//	benchreport host -in raw.txt -md docs/bench/host.md
//	benchreport gateway -in docs/bench/gateway-results-1.json,docs/bench/gateway-results-2.json -md docs/bench/gateway.md -full gateway-results.md
//	benchreport load -in docs/bench/load.json -md docs/bench/load.md
//	benchreport ttfb -in docs/bench/ttfb.json -md docs/bench/ttfb.md
//
// "results" reads the VM harness's results.json (integration/bench.sh), or
// several of them from runs of one setup merged into one report, and
// writes the contender tables, the goals with met/missed, and a bar chart of
// CPU seconds per GiB. "host" reads the output of the host Go benchmarks as
// integration/bench-host.sh collects it (go test -bench lines plus "# key:
// value" header lines) and writes their table with the ratios the goals ask
// for. "gateway" reads the same JSON as "results" and writes the edge-gateway
// report of issue 19: the three paths' CPU summed and per hop, their ratios
// to the old path beside the published design's, and what the cost model
// can say; -full names the full report of the same run to link. "load"
// reads the JSON of the open-loop load run (bench load) and writes
// docs/bench/load.md: capacity, latency per offered rate, errors by class,
// goodput past capacity and the bulk mix's fairness. "ttfb" reads the JSON
// of the time-to-first-byte run (bench ttfb) and writes docs/bench/ttfb.md:
// per RTT between gateway and forwarder, each chain's percentiles, the
// round trips across that path, the goal's verdict and the path checks.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(2)
	}
}

func run(args []string) error {
	if len(args) == 0 {
		return errors.New("usage: benchreport results|host|gateway|load|ttfb -in FILE[,FILE...] -md FILE [-png FILE] [-full FILE]")
	}
	fs := flag.NewFlagSet("benchreport "+args[0], flag.ContinueOnError)
	in := fs.String("in", "", "input file; for results, several comma-separated ones merge into one report (runs of one setup)")
	md := fs.String("md", "", "markdown output file")
	png := fs.String("png", "", "PNG chart output file (results only)")
	full := fs.String("full", "", "gateway: the full report of the same run, linked from the gateway report (relative to it)")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	if *in == "" || *md == "" {
		return errors.New("-in and -md are required")
	}
	switch args[0] {
	case "gateway":
		if *png != "" {
			return errors.New("gateway: no chart")
		}
		names := strings.Split(*in, ",")
		r, err := readMerged(names)
		if err != nil {
			return err
		}
		return os.WriteFile(*md, renderGatewayMarkdown(r, names, *full), 0o644)
	case "results":
		names := strings.Split(*in, ",")
		r, err := readMerged(names)
		if err != nil {
			return err
		}
		chart := ""
		if *png != "" {
			if chart, err = filepath.Rel(filepath.Dir(*md), *png); err != nil {
				return err
			}
		}
		if err := os.WriteFile(*md, renderResultsMarkdown(r, names, chart), 0o644); err != nil {
			return err
		}
		if *png != "" {
			var buf bytes.Buffer
			if err := renderChart(&buf, r); err != nil {
				return err
			}
			return os.WriteFile(*png, buf.Bytes(), 0o644)
		}
		return nil
	case "load":
		if *png != "" {
			return errors.New("load: no chart")
		}
		data, err := os.ReadFile(*in)
		if err != nil {
			return err
		}
		l, err := parseLoad(data)
		if err != nil {
			return fmt.Errorf("%s: %w", *in, err)
		}
		return os.WriteFile(*md, renderLoadMarkdown(l, *in), 0o644)
	case "ttfb":
		if *png != "" {
			return errors.New("ttfb: no chart")
		}
		data, err := os.ReadFile(*in)
		if err != nil {
			return err
		}
		t, err := parseTTFB(data)
		if err != nil {
			return fmt.Errorf("%s: %w", *in, err)
		}
		return os.WriteFile(*md, renderTTFBMarkdown(t, *in), 0o644)
	case "host":
		if *png != "" {
			return errors.New("host: no chart")
		}
		data, err := os.ReadFile(*in)
		if err != nil {
			return err
		}
		h, err := parseHostBench(data)
		if err != nil {
			return fmt.Errorf("%s: %w", *in, err)
		}
		return os.WriteFile(*md, renderHostMarkdown(h), 0o644)
	default:
		return fmt.Errorf("unknown report %q: want results, host, gateway, load or ttfb", args[0])
	}
}

// readMerged reads the results documents names and merges them into one.
func readMerged(names []string) (*Results, error) {
	docs := make([]*Results, len(names))
	for i, name := range names {
		data, err := os.ReadFile(name)
		if err != nil {
			return nil, err
		}
		if docs[i], err = parseResults(data); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	r, err := mergeResults(docs)
	if err != nil {
		return nil, fmt.Errorf("merging %s: %w", strings.Join(names, ","), err)
	}
	return r, nil
}
