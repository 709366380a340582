package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"
)

// perfProfile runs reps more runs of a shape with perf record sampling the
// forwarder (pid, all its threads) on the cpu-clock (guest time under
// icount), with call graphs from frame pointers (Go keeps them on amd64),
// and writes perf report's text next to prefix: prefix.self.txt (where the
// samples fell, by symbol, kernel and user) and prefix.children.txt (the
// same with callees' samples charged to their callers). Its figures are
// shares of the forwarder's CPU; sampling costs CPU too, so this pass is
// separate from the CPU pass.
//
// perf record -p stopped by a signal records no samples (perf 6.1 on the
// 7.3 guest); with a workload it samples the target until the workload
// ends. The workload is a sleep of span, which must cover the runs (the
// CPU pass's wall time says how long they take); idle time adds no samples.
// The rate is 1 kHz: at 10 kHz the TCG guest, where a sampling interrupt
// takes long, throttles the event to no samples at all.
func perfProfile(pid int, prefix string, reps int, span time.Duration, do func(context.Context, bool, func()) (transfer, error), timeout time.Duration) error {
	// perf record maps its output file, which a 9p share (the VM's
	// /run/vm-out) refuses: the samples go to the temporary directory.
	data := filepath.Join(os.TempDir(), filepath.Base(prefix)+".perf.data")
	defer os.Remove(data)
	secs := strconv.FormatFloat(span.Seconds(), 'f', 3, 64)
	rec := exec.Command("perf", "record", "-e", "cpu-clock", "-F", "1000", "-g", "-p", strconv.Itoa(pid), "-o", data, "--", "sleep", secs)
	log, err := os.Create(prefix + ".record.log")
	if err != nil {
		return err
	}
	defer log.Close()
	rec.Stdout, rec.Stderr = log, log
	if err := rec.Start(); err != nil {
		return fmt.Errorf("perf record: %w", err)
	}
	start := time.Now()
	var runErr error
	for range reps {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		_, runErr = do(ctx, false, nil)
		cancel()
		if runErr != nil {
			break
		}
	}
	ran := time.Since(start)
	if err := rec.Wait(); err != nil {
		return fmt.Errorf("perf record: %w (log %s)", err, log.Name())
	}
	if runErr != nil {
		return runErr
	}
	if ran > span {
		return fmt.Errorf("perf record: the runs took %v, longer than the %v recorded", ran, span)
	}
	for _, r := range []struct{ suffix, children string }{{"self", "--no-children"}, {"children", "--children"}} {
		out, err := os.Create(prefix + "." + r.suffix + ".txt")
		if err != nil {
			return err
		}
		rep := exec.Command("perf", "report", "-i", data, "--stdio", r.children, "--sort", "dso,sym", "-g", "none", "--percent-limit", "0.2")
		rep.Stdout, rep.Stderr = out, out
		err = rep.Run()
		out.Close()
		if err != nil {
			return fmt.Errorf("perf report: %w (see %s)", err, out.Name())
		}
	}
	return nil
}
