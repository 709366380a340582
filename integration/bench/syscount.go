package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// countSource says how untracedSyscalls counts.
const countSource = "perf_event_open on the raw_syscalls:sys_enter tracepoint, one inherited counter per forwarder thread, opened for this pass only: every syscall entered by any forwarder thread, counted in the kernel without stopping the thread (strace's ptrace stops stretch every syscall, and the Go runtime answers long syscalls with more of its own: sysmon's nanosleep, futex hand-offs)"

// untracedCount is the untraced structural run: what it moved and how many
// syscalls the forwarder entered meanwhile.
type untracedCount struct {
	bytes    int64
	calls    int
	syscalls int64
}

// countSyscalls runs one structural-size transfer of a shape (do, as
// shapeFunc returns it) with the forwarder's syscalls counted in the kernel.
func countSyscalls(pid int, do func(context.Context, bool) (transfer, error), timeout time.Duration) (untracedCount, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var tr transfer
	n, err := untracedSyscalls(pid, func() (err error) {
		tr, err = do(ctx, true)
		return err
	})
	return untracedCount{bytes: tr.bytes, calls: tr.calls, syscalls: n}, err
}

// errCounter marks a failure to count (no tracefs, no tracepoint, no
// perf_event_open) as opposed to a failed transfer.
var errCounter = errors.New("untraced syscall count unavailable")

// tracefsDirs are where tracefs may be mounted; the first is mounted for a
// moment when neither is (the VM's init mounts only proc, sysfs and
// devtmpfs, and many hosts mount it on demand).
var tracefsDirs = []string{"/sys/kernel/tracing", "/sys/kernel/debug/tracing"}

// sysEnterID is the perf tracepoint id of raw_syscalls:sys_enter. Only
// reading it needs tracefs: a counter opened with it does not, so a tracefs
// mounted here is unmounted again at once.
func sysEnterID() (uint64, error) {
	const event = "/events/raw_syscalls/sys_enter/id"
	for _, dir := range tracefsDirs {
		if b, err := os.ReadFile(dir + event); err == nil {
			return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		}
	}
	if err := unix.Mount("nodev", tracefsDirs[0], "tracefs", 0, ""); err != nil {
		return 0, fmt.Errorf("no tracefs at %s and mounting it failed: %w", strings.Join(tracefsDirs, " or "), err)
	}
	defer unix.Unmount(tracefsDirs[0], 0)
	b, err := os.ReadFile(tracefsDirs[0] + event)
	if err != nil {
		return 0, fmt.Errorf("raw_syscalls:sys_enter: %w (kernel without CONFIG_FTRACE_SYSCALLS?)", err)
	}
	return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
}

// untracedSyscalls counts the syscalls every thread of pid enters while fn
// runs. Each live thread gets an inherited counter, so threads they start
// meanwhile count too; a thread that appears between the listing and the
// opening is caught by listing again until no new one shows up.
func untracedSyscalls(pid int, fn func() error) (int64, error) {
	id, err := sysEnterID()
	if err != nil {
		return 0, fmt.Errorf("%w: %w", errCounter, err)
	}
	attr := unix.PerfEventAttr{
		Type:   unix.PERF_TYPE_TRACEPOINT,
		Size:   uint32(unsafe.Sizeof(unix.PerfEventAttr{})),
		Config: id,
		Bits:   unix.PerfBitInherit,
	}
	counters := map[int]int{} // tid → counter fd
	defer func() {
		for _, fd := range counters {
			unix.Close(fd)
		}
	}()
	for {
		tids, err := threads(pid)
		if err != nil {
			return 0, fmt.Errorf("%w: %w", errCounter, err)
		}
		added := 0
		for _, tid := range tids {
			if _, ok := counters[tid]; ok {
				continue
			}
			fd, err := unix.PerfEventOpen(&attr, tid, -1, -1, unix.PERF_FLAG_FD_CLOEXEC)
			if errors.Is(err, unix.ESRCH) {
				continue // the thread ended meanwhile
			}
			if err != nil {
				return 0, fmt.Errorf("%w: perf_event_open(raw_syscalls:sys_enter, tid %d): %w", errCounter, tid, err)
			}
			counters[tid] = fd
			added++
		}
		if added == 0 {
			break
		}
	}
	if err := fn(); err != nil {
		return 0, err
	}
	var total int64
	buf := make([]byte, 8)
	for tid, fd := range counters {
		if n, err := unix.Read(fd, buf); err != nil || n != len(buf) {
			return 0, fmt.Errorf("%w: read counter of tid %d: %d bytes, %v", errCounter, tid, n, err)
		}
		total += int64(binary.NativeEndian.Uint64(buf))
	}
	return total, nil
}

// threads lists the thread ids of pid.
func threads(pid int) ([]int, error) {
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil, err
	}
	tids := make([]int, 0, len(entries))
	for _, e := range entries {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}
