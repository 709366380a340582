package main

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// countSource says how untracedSyscalls counts.
const countSource = "perf_event_open on the raw_syscalls:sys_enter tracepoint, one inherited counter per forwarder thread, opened for this pass only: every syscall entered by any forwarder thread, counted in the kernel without stopping the thread (strace's ptrace stops stretch every syscall, and the Go runtime answers long syscalls with more of its own: sysmon's nanosleep, futex hand-offs); untraced_top_syscalls: the same for each syscall of untracedBreakdown, from its syscalls:sys_enter_<name> tracepoint"

// untracedCount is the untraced structural run: what it moved and how many
// syscalls the forwarder entered meanwhile.
type untracedCount struct {
	bytes    int64
	calls    int
	syscalls int64
	top      []count // the syscalls of untracedBreakdown entered, most first
}

// untracedBreakdown are the syscalls the untraced pass counts one by one:
// those that move payload and those the Go runtime makes around them
// (parking and waking threads, sysmon's polls, preemption signals). What
// they leave of the total is everything else.
var untracedBreakdown = []string{
	"splice", "read", "write", "readv", "writev", "recvfrom", "sendto", "recvmsg", "sendmsg", "sendfile",
	"epoll_pwait", "epoll_pwait2", "nanosleep", "futex", "sched_yield", "tgkill", "getpid", "rt_sigreturn",
}

// countSyscalls runs one structural-size transfer of a shape (do, as
// shapeFunc returns it) with the forwarder's syscalls counted in the kernel.
func countSyscalls(pid int, do func(context.Context, bool, func()) (transfer, error), timeout time.Duration) (untracedCount, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var tr transfer
	n, top, err := untracedSyscalls(pid, func() (err error) {
		tr, err = do(ctx, true, nil)
		return err
	})
	return untracedCount{bytes: tr.bytes, calls: tr.calls, syscalls: n, top: top}, err
}

// errCounter marks a failure to count (no tracefs, no tracepoint, no
// perf_event_open) as opposed to a failed transfer.
var errCounter = errors.New("untraced syscall count unavailable")

// tracefsDirs are where tracefs may be mounted; the first is mounted for a
// moment when neither is (the VM's init mounts only proc, sysfs and
// devtmpfs, and many hosts mount it on demand).
var tracefsDirs = []string{"/sys/kernel/tracing", "/sys/kernel/debug/tracing"}

// tracepoint is a tracepoint the untraced pass counts.
type tracepoint struct {
	name string // the syscall, or "" for raw_syscalls:sys_enter (all of them)
	id   uint64 // its perf id
}

// sysEnterIDs are the perf tracepoint ids of raw_syscalls:sys_enter (first)
// and of syscalls:sys_enter_<name> for each name of untracedBreakdown this
// kernel has. Only reading them needs tracefs: a counter opened with one
// does not, so a tracefs mounted here is unmounted again at once.
func sysEnterIDs() ([]tracepoint, error) {
	dir := ""
	for _, d := range tracefsDirs {
		if _, err := os.Stat(d + "/events"); err == nil {
			dir = d
			break
		}
	}
	if dir == "" {
		if err := unix.Mount("nodev", tracefsDirs[0], "tracefs", 0, ""); err != nil {
			return nil, fmt.Errorf("no tracefs at %s and mounting it failed: %w", strings.Join(tracefsDirs, " or "), err)
		}
		defer unix.Unmount(tracefsDirs[0], 0)
		dir = tracefsDirs[0]
	}
	id := func(event string) (uint64, error) {
		b, err := os.ReadFile(dir + "/events/" + event + "/id")
		if err != nil {
			return 0, err
		}
		return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	}
	all, err := id("raw_syscalls/sys_enter")
	if err != nil {
		return nil, fmt.Errorf("raw_syscalls:sys_enter: %w (kernel without CONFIG_FTRACE_SYSCALLS?)", err)
	}
	tps := []tracepoint{{"", all}}
	for _, name := range untracedBreakdown {
		if n, err := id("syscalls/sys_enter_" + name); err == nil {
			tps = append(tps, tracepoint{name, n})
		}
	}
	return tps, nil
}

// untracedSyscalls counts the syscalls every thread of pid enters while fn
// runs, in all and one by one for untracedBreakdown (most first, those
// entered only). Each live thread gets inherited counters, so threads they
// start meanwhile count too; a thread that appears between the listing and
// the opening is caught by listing again until no new one shows up.
func untracedSyscalls(pid int, fn func() error) (int64, []count, error) {
	tps, err := sysEnterIDs()
	if err != nil {
		return 0, nil, fmt.Errorf("%w: %w", errCounter, err)
	}
	counters := map[int][]int{} // tid → a counter fd per tracepoint
	defer func() {
		for _, fds := range counters {
			for _, fd := range fds {
				unix.Close(fd)
			}
		}
	}()
	for {
		tids, err := threads(pid)
		if err != nil {
			return 0, nil, fmt.Errorf("%w: %w", errCounter, err)
		}
		added := 0
		for _, tid := range tids {
			if _, ok := counters[tid]; ok {
				continue
			}
			fds, err := openCounters(tid, tps)
			if errors.Is(err, unix.ESRCH) {
				continue // the thread ended meanwhile
			}
			if err != nil {
				return 0, nil, fmt.Errorf("%w: %w", errCounter, err)
			}
			counters[tid] = fds
			added++
		}
		if added == 0 {
			break
		}
	}
	if err := fn(); err != nil {
		return 0, nil, err
	}
	sums := make([]int64, len(tps))
	buf := make([]byte, 8)
	for tid, fds := range counters {
		for i, fd := range fds {
			if n, err := unix.Read(fd, buf); err != nil || n != len(buf) {
				return 0, nil, fmt.Errorf("%w: read counter of tid %d: %d bytes, %v", errCounter, tid, n, err)
			}
			sums[i] += int64(binary.NativeEndian.Uint64(buf))
		}
	}
	var top []count
	for i, tp := range tps[1:] {
		if sums[i+1] > 0 {
			top = append(top, count{tp.name, sums[i+1]})
		}
	}
	slices.SortStableFunc(top, func(a, b count) int { return cmp.Compare(b.Count, a.Count) })
	return sums[0], top, nil
}

// openCounters opens an inherited counter of each tracepoint on thread tid,
// or none.
func openCounters(tid int, tps []tracepoint) ([]int, error) {
	fds := make([]int, 0, len(tps))
	for _, tp := range tps {
		attr := unix.PerfEventAttr{
			Type:   unix.PERF_TYPE_TRACEPOINT,
			Size:   uint32(unsafe.Sizeof(unix.PerfEventAttr{})),
			Config: tp.id,
			Bits:   unix.PerfBitInherit,
		}
		fd, err := unix.PerfEventOpen(&attr, tid, -1, -1, unix.PERF_FLAG_FD_CLOEXEC)
		if err != nil {
			for _, fd := range fds {
				unix.Close(fd)
			}
			if errors.Is(err, unix.ESRCH) {
				return nil, err
			}
			return nil, fmt.Errorf("perf_event_open(sys_enter %q, tid %d): %w", tp.name, tid, err)
		}
		fds = append(fds, fd)
	}
	return fds, nil
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
