// Package cputest makes a process's goroutines wait for a CPU, for tests
// of what measures that wait.
package cputest

import (
	"runtime"
	"sync"
)

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
