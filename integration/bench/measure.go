package main

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// clockTicks is USER_HZ, the unit of utime/stime in /proc/<pid>/stat: 100 on
// every Linux architecture Go supports (the kernel scales its internal HZ).
const clockTicks = 100

// cpuSample is a forwarder process's CPU time at one instant: user and
// system time of the whole process (all threads, live and exited) in ticks,
// and the nanoseconds each live thread has run (schedstat), which is exact
// where ticks are 10 ms coarse.
type cpuSample struct {
	user, sys int64
	threads   map[string]int64
}

func sampleCPU(pid int) (cpuSample, error) {
	proc := fmt.Sprintf("/proc/%d", pid)
	stat, err := os.ReadFile(proc + "/stat")
	if err != nil {
		return cpuSample{}, err
	}
	// The command name, field 2, may contain spaces: fields count from ')'.
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	if len(f) < 13 {
		return cpuSample{}, fmt.Errorf("%s/stat: %d fields", proc, len(f))
	}
	s := cpuSample{threads: map[string]int64{}}
	s.user, _ = strconv.ParseInt(f[11], 10, 64) // field 14, utime
	s.sys, _ = strconv.ParseInt(f[12], 10, 64)  // field 15, stime
	tasks, err := os.ReadDir(proc + "/task")
	if err != nil {
		return cpuSample{}, err
	}
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(proc, "task", t.Name(), "schedstat"))
		if err != nil {
			continue // exited meanwhile
		}
		ns, _ := strconv.ParseInt(strings.Fields(string(b))[0], 10, 64)
		s.threads[t.Name()] = ns
	}
	return s, nil
}

// cpuUsed is what the process ran between a and b: total from the threads'
// schedstat when no thread exited in between (an exited thread takes its
// schedstat with it), else from the ticks.
func cpuUsed(a, b cpuSample) (cpu, user, sys float64, source string) {
	user = float64(b.user-a.user) / clockTicks
	sys = float64(b.sys-a.sys) / clockTicks
	var ns int64
	for tid, after := range b.threads {
		ns += after - a.threads[tid]
	}
	for tid := range a.threads {
		if _, ok := b.threads[tid]; !ok {
			return user + sys, user, sys, "stat"
		}
	}
	return float64(ns) / 1e9, user, sys, "schedstat"
}

// structural is the syscall pass: one shape at a smaller size, run twice,
// once with the forwarder's syscalls counted in the kernel (untraced) and once
// with strace attached, which names every call and its fd.
type structural struct {
	Bytes                int64   `json:"bytes"`
	Calls                int     `json:"calls,omitempty"`
	Syscalls             int64   `json:"syscalls"`
	UserspaceBytes       int64   `json:"userspace_bytes"`
	DataSyscalls         int64   `json:"data_syscalls"`
	SyscallsPerGiB       float64 `json:"syscalls_per_gib"`
	DataSyscallsPerGiB   float64 `json:"data_syscalls_per_gib"`
	UserspaceBytesPerGiB float64 `json:"userspace_bytes_per_gib"`
	SyscallsPerCall      float64 `json:"syscalls_per_call,omitempty"`
	Top                  []count `json:"top_syscalls"`
	Source               string  `json:"source"`
	// PreOffloadBytes: of UserspaceBytes, those on a connection before the
	// forwarder installed kernel TLS keys on it (the handshake, which runs
	// in userspace everywhere).
	PreOffloadBytes int64 `json:"pre_offload_bytes"`
	// ControlRecordBytes: of UserspaceBytes, those recvmsg returned on a
	// connection after its key install. Kernel TLS hands a control record
	// (an alert, a session ticket, a KeyUpdate) only to recvmsg, and the
	// ktls package reads data with read(2) or splice, so these are the
	// records it must handle in userspace, not payload.
	ControlRecordBytes int64 `json:"control_record_bytes,omitempty"`
	// Tunnels: the tunnels the gateway opened during the pass (L4
	// contenders); PreambleBytes: the preamble frames' bytes it wrote.
	Tunnels       int64 `json:"tunnels,omitempty"`
	PreambleBytes int64 `json:"preamble_bytes,omitempty"`
	// The untraced run of the same size: the goal's syscall count.
	UntracedSyscalls        int64   `json:"untraced_syscalls,omitempty"`
	UntracedSyscallsPerGiB  float64 `json:"untraced_syscalls_per_gib,omitempty"`
	UntracedSyscallsPerCall float64 `json:"untraced_syscalls_per_call,omitempty"`
	UntracedTop             []count `json:"untraced_top_syscalls,omitempty"`
	UntracedSource          string  `json:"untraced_source,omitempty"`
	UntracedError           string  `json:"untraced_error,omitempty"`
}

type count struct {
	Name  string `json:"name"`
	Count int64  `json:"count"`
}

const straceSource = "strace -f -ff -yy -s 0 --absolute-timestamps=format:unix,precision:ns -e signal=none -p <forwarder pid>, attached for this pass only: syscalls = every syscall entered by any forwarder thread; data syscalls = those that move payload (read/readv/recvfrom/recvmsg/write/writev/sendto/sendmsg on TCP sockets, and every splice/sendfile); userspace bytes = sum of positive returns of read/readv/recvfrom/recvmsg/write/writev/sendto/sendmsg on TCP sockets; pre_offload_bytes = those of them on a connection before its first successful setsockopt(SOL_TLS) (kernel TLS key install); control_record_bytes = those recvmsg returned on a connection after its key install (control records: alerts, session tickets, KeyUpdates)"

// userspaceIO are the calls whose return value counts bytes copied between
// a socket and a userspace buffer (splice and sendfile move none).
var userspaceIO = map[string]bool{
	"read": true, "readv": true, "recvfrom": true, "recvmsg": true,
	"write": true, "writev": true, "sendto": true, "sendmsg": true,
}

// kernelIO are the calls that move payload without a userspace buffer.
var kernelIO = map[string]bool{"splice": true, "sendfile": true}

// straceCall matches the start of a syscall line of strace -ff -yy output:
// the entry time (--absolute-timestamps=format:unix,precision:ns; optional),
// the name and the first argument (with its fd decoration). A line cut by
// the detach ("<detached ...>") has no return value but was entered too.
var straceCall = regexp.MustCompile(`^(?:(\d+)\.(\d+) )?([a-z_0-9]+)\(([^,)]*)`)

// sockEvent is what one traced syscall did to a connection: moved n bytes
// through userspace, installed a kernel TLS key, or closed the socket.
type sockEvent struct {
	at   int64 // entry time, ns since the epoch
	kind byte  // 'n' bytes, 'r' bytes by recvmsg, 'k' key install, 'c' close
	n    int64
}

// offloadSplit returns, over every connection, the userspace bytes moved
// on it before a kernel TLS key install that came before its close, and
// those recvmsg returned on it after the install (control records). A
// connection is its -yy decoration (protocol and both addresses), which a
// later connection may reuse once the first is closed.
func offloadSplit(events map[string][]sockEvent) (pre, control int64) {
	for _, evs := range events {
		slices.SortStableFunc(evs, func(a, b sockEvent) int { return cmp.Compare(a.at, b.at) })
		var pending int64 // bytes since the open, no key yet
		keyed := false
		for _, e := range evs {
			switch {
			case e.kind == 'r' && keyed:
				control += e.n
			case (e.kind == 'n' || e.kind == 'r') && !keyed:
				pending += e.n
			case e.kind == 'k':
				if !keyed {
					pre += pending
				}
				pending, keyed = 0, true
			case e.kind == 'c':
				pending, keyed = 0, false
			}
		}
	}
	return pre, control
}

// entryTime is a strace timestamp, seconds and their decimal fraction, in
// ns since the epoch (0 without one).
func entryTime(sec, frac string) int64 {
	s, _ := strconv.ParseInt(sec, 10, 64)
	frac = (frac + "000000000")[:9]
	ns, _ := strconv.ParseInt(frac, 10, 64)
	return s*1e9 + ns
}

// traceSyscalls attaches strace to every thread of pid, runs fn, detaches and
// counts what the forwarder did meanwhile.
func traceSyscalls(pid int, prefix string, fn func() error) (structural, error) {
	cmd := exec.Command("strace", "-f", "-ff", "-yy", "-s", "0", "--absolute-timestamps=format:unix,precision:ns",
		"-e", "signal=none", "-o", prefix, "-p", strconv.Itoa(pid))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return structural{}, fmt.Errorf("strace: %w", err)
	}
	if err := waitTraced(pid); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return structural{}, fmt.Errorf("%w (strace: %s)", err, stderr.String())
	}
	runErr := fn()
	cmd.Process.Signal(os.Interrupt) // detaches from every thread
	cmd.Wait()
	if runErr != nil {
		return structural{}, runErr
	}
	return parseStrace(prefix)
}

// waitTraced waits until every thread of pid has a tracer, so no syscall of
// the pass goes uncounted.
func waitTraced(pid int) error {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return err
		}
		all := true
		for _, t := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, t.Name()))
			if err == nil && strings.Contains(string(b), "\nTracerPid:\t0\n") {
				all = false
				break
			}
		}
		if all {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return errors.New("strace did not attach to every thread within 30s")
}

func parseStrace(prefix string) (structural, error) {
	files, err := filepath.Glob(prefix + ".*")
	if err != nil || len(files) == 0 {
		return structural{}, fmt.Errorf("no strace output at %s.*", prefix)
	}
	var s structural
	counts := map[string]int64{}
	events := map[string][]sockEvent{}
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			return s, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			m := straceCall.FindStringSubmatch(line)
			if m == nil {
				continue // "+++ exited", "--- SIG", "[ Process ... ]"
			}
			at, call, arg := entryTime(m[1], m[2]), m[3], m[4]
			counts[call]++
			onSocket := strings.Contains(arg, "<TCP") || strings.Contains(arg, "<socket:")
			if kernelIO[call] || userspaceIO[call] && onSocket {
				s.DataSyscalls++
			}
			conn := arg[strings.IndexByte(arg, '<')+1:] // the decoration, when onSocket
			i := strings.LastIndex(line, ") = ")
			if i < 0 || !onSocket {
				continue
			}
			ret, _, _ := strings.Cut(line[i+len(") = "):], " ")
			n, err := strconv.ParseInt(ret, 10, 64)
			switch {
			case err != nil:
			case call == "recvmsg" && n > 0:
				s.UserspaceBytes += n
				events[conn] = append(events[conn], sockEvent{at, 'r', n})
			case userspaceIO[call] && n > 0:
				s.UserspaceBytes += n
				events[conn] = append(events[conn], sockEvent{at, 'n', n})
			case call == "setsockopt" && n == 0 && strings.HasPrefix(line[len(m[0]):], ", SOL_TLS,"):
				events[conn] = append(events[conn], sockEvent{at, 'k', 0})
			case call == "close":
				events[conn] = append(events[conn], sockEvent{at, 'c', 0})
			}
		}
		f.Close()
		if err := sc.Err(); err != nil {
			return s, err
		}
	}
	s.PreOffloadBytes, s.ControlRecordBytes = offloadSplit(events)
	for name, n := range counts {
		s.Syscalls += n
		s.Top = append(s.Top, count{name, n})
	}
	slices.SortFunc(s.Top, func(a, b count) int { return int(b.Count - a.Count) })
	s.Top = s.Top[:min(len(s.Top), 8)]
	s.Source = straceSource
	return s, nil
}

// spread is min/median/max over a cell's runs; SpreadPct is (max-min)/median.
type spread struct {
	Min       float64 `json:"min"`
	Median    float64 `json:"median"`
	Max       float64 `json:"max"`
	SpreadPct float64 `json:"spread_pct"`
}

func spreadOf(xs []float64) spread {
	if len(xs) == 0 {
		return spread{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	sp := spread{Min: s[0], Median: median(s), Max: s[len(s)-1]}
	if sp.Median != 0 {
		sp.SpreadPct = round((sp.Max-sp.Min)/sp.Median*100, 2)
	}
	return sp
}

// median of sorted xs.
func median(s []float64) float64 {
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// percentile of sorted durations, nearest rank, in microseconds.
func percentile(d []time.Duration, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(d)))) - 1
	return float64(d[max(i, 0)]) / 1e3
}

func round(x float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(x*p) / p
}
