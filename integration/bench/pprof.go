package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"
)

// pprofProfile runs reps more runs of a shape while the forwarder's own Go
// CPU profiler samples it (Caddy's admin endpoint /debug/pprof/profile,
// on the unix socket adminSock) and writes the profile to file. It profiles
// the forwarder's Go code and the system calls it enters by where they are
// called from; the kernel's share of a call shows as time in those calls.
// The profiler's span must cover the runs (the CPU pass's wall time says
// how long they take); idle time adds no samples. Sampling costs CPU too,
// so this pass is separate from the CPU pass.
//
// (perf record -p samples nothing in a Go forwarder on the TCG guest,
// while it samples a shell loop there; Go's profiler works.)
func pprofProfile(adminSock, file string, reps int, span time.Duration, do func(context.Context, bool, func()) (transfer, error), timeout time.Duration) error {
	client := adminClient(adminSock)
	secs := max(int(span.Round(time.Second)/time.Second), 1)
	type answer struct {
		body []byte
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		resp, err := client.Get("http://localhost/debug/pprof/profile?seconds=" + strconv.Itoa(secs))
		if err != nil {
			got <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("%s: %s", resp.Status, body)
		}
		got <- answer{body, err}
	}()
	// The profiler starts when the request arrives.
	time.Sleep(500 * time.Millisecond)
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
	a := <-got
	switch {
	case a.err != nil:
		return fmt.Errorf("pprof: %w", a.err)
	case runErr != nil:
		return runErr
	case ran > time.Duration(secs)*time.Second:
		return fmt.Errorf("pprof: the runs took %v, longer than the %d s profiled", ran, secs)
	}
	return os.WriteFile(file, a.body, 0o644)
}

// adminClient is an HTTP client of a Caddy admin endpoint on the unix
// socket sock (any URL's host reaches it).
func adminClient(sock string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
}
