// Package cputest is a test's view of its process's CPU: what the process
// has used (Used, for benchmarks' CPU figures) and goroutines that make
// each other wait for one (Busy, for tests of what measures that wait).
package cputest

import (
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Used is the user and system CPU time this process has used.
func Used(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Busy starts n goroutines that compute and yield, as handshakes do
// between their reads, until stop, which waits for them to end. With n
// well above GOMAXPROCS each waits, runnable, behind the others: the Go
// scheduler's run-queue delay grows with n.
func Busy(n int) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				for i := 0; i < 1<<20; i++ {
				}
				runtime.Gosched()
			}
		})
	}
	return sync.OnceFunc(func() { close(done); wg.Wait() })
}
