package caddyktls

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// The real binary (bin/caddy) as a child process: start, signal, exit,
// and its file descriptors.

// caddyBinary is the Caddy built by `make build` (override: KTLS_CADDY_BIN).
// A kernel test fails without it: the VM harness builds it first.
func caddyBinary(t *testing.T) string {
	t.Helper()
	return builtBinary(t, "KTLS_CADDY_BIN", "caddy", "build")
}

// builtBinary finds bin/<name>, which `make <target>` builds, or the file
// the environment variable env names instead; a test fails without it.
func builtBinary(t *testing.T, env, name, target string) string {
	t.Helper()
	file := os.Getenv(env)
	if file == "" {
		file = filepath.Join("bin", name)
	}
	path, err := exec.LookPath(file)
	if err != nil {
		t.Fatalf("%s is missing (run `make %s`, or set %s): %v", file, target, env, err)
	}
	return path
}

// caddyProcess is the real binary running a sandboxEnv's configuration.
type caddyProcess struct {
	cmd     *exec.Cmd
	exited  chan struct{} // closed when the process has exited (exitErr)
	exitErr error
}

// exitedAfterDrain waits for the process to exit 0 after a drain that
// closed forced tunnels when its grace period ran out, as one log line says.
func (p *caddyProcess) exitedAfterDrain(t *testing.T, e *sandboxEnv, forced int) {
	t.Helper()
	select {
	case <-p.exited:
		if p.exitErr != nil {
			t.Errorf("caddy exited with %v", p.exitErr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("caddy did not exit after the drain")
	}
	lines := e.logLines(t, "closed tunnels still open after the drain grace period")
	if len(lines) != 1 || lines[0]["tunnels"] != float64(forced) {
		t.Errorf("drain log lines %v, want one that closed %d tunnels", lines, forced)
	}
	// The drain said at its start how many tunnels it waits for (at least
	// those it closed) and for how long.
	started := e.logLines(t, drainStartLine)
	if len(started) != 1 || started[0]["level"] != "info" || started[0]["tunnels"].(float64) < float64(forced) || started[0]["grace_period"] == nil {
		t.Errorf("drain start log lines %v, want one at INFO with tunnels >= %d and the grace period", started, forced)
	}
}

const drainStartLine = "draining open tunnels at exit: new tunnels are refused, open ones may finish until the grace period ends"

// startCaddy runs bin/caddy with e's configuration, after the shell
// commands in prelude (e.g. "ulimit -n 64"), waits until the layer4
// listener accepts, and kills the process at cleanup if it still runs.
func startCaddy(t *testing.T, e *sandboxEnv, prelude string) *caddyProcess {
	t.Helper()
	return runCaddy(t, prelude, e.addr, e.logFile, "--config", e.configFile(t))
}

// configFile writes e's configuration to a file and returns its path.
func (e *sandboxEnv) configFile(t *testing.T) string {
	t.Helper()
	cfg, err := json.Marshal(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfgFile := filepath.Join(t.TempDir(), "caddy.json")
	if err := os.WriteFile(cfgFile, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	return cfgFile
}

// failedLogDir is where a failed test keeps its Caddy processes' whole
// logs: the VM's results directory, which comes back to the host
// (integration/vm.sh's VM_OUT). Elsewhere the logs stay in the test's
// temporary directory, which the test removes.
const failedLogDir = "/run/vm-out"

// keepLog copies a failed test's Caddy log to failedLogDir, where that
// exists, and says where; a log's tail alone can miss its start.
func keepLog(t *testing.T, logFile string, log []byte) string {
	if len(log) == 0 {
		return ""
	}
	if fi, err := os.Stat(failedLogDir); err != nil || !fi.IsDir() {
		return ""
	}
	name := strings.NewReplacer("/", "_", " ", "_").Replace(t.Name()) + "-" + filepath.Base(filepath.Dir(logFile)) + "-" + filepath.Base(logFile)
	kept := filepath.Join(failedLogDir, name)
	if err := os.WriteFile(kept, log, 0o644); err != nil {
		return fmt.Sprintf("\n(the whole log could not be kept: %v)", err)
	}
	return fmt.Sprintf("\n(the whole log, %d bytes: %s; integration/vmtest.sh brings it back as integration/.build/vm-KERNEL/%s)", len(log), kept, name)
}

// runCaddy runs `bin/caddy run` with args (the configuration) after the
// shell commands in prelude, waits until addr accepts TCP connections, and
// kills the process at cleanup if it still runs. When t fails, the
// process's output and the tail of logFile (its configured log) are logged.
func runCaddy(t *testing.T, prelude, addr, logFile string, args ...string) *caddyProcess {
	t.Helper()
	caddyBin := builtCaddy(t)
	output := new(syncBuffer)
	cmd := exec.Command("/bin/sh", append([]string{"-c", prelude + `
exec "$0" run "$@"`, caddyBin}, args...)...)
	cmd.Stdout, cmd.Stderr = output, output
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &caddyProcess{cmd: cmd, exited: make(chan struct{})}
	go func() {
		p.exitErr = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			log, _ := os.ReadFile(logFile)
			t.Logf("caddy output:\n%s\ncaddy log (tail):\n%s%s", output.String(), tail(log, 64<<10), keepLog(t, logFile, log))
		}
	})
	// A liveness bound: the real binary's start (module init, the first
	// config, certificates) took over 15 s in a VM beside a loaded host,
	// and over 2 minutes beside a process carrying 1,000 tunnels.
	deadline := time.Now().Add(5 * time.Minute)
	for !connectable(addr) {
		if time.Now().After(deadline) {
			t.Fatal("caddy never listened")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return p
}

// connectable reports whether a TCP listener accepts at addr.
func connectable(addr string) bool {
	// The dial's own bound is long: on a VM's one CPU busy with 1,000
	// tunnels, the dialing goroutine may run seconds after the kernel
	// completed the connection. A listener that is not there refuses at
	// once.
	c, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// settledFDs waits until the number of the process's descriptors below
// limit holds still for 100 ms (connections being closed are gone) and
// returns it.
func (p *caddyProcess) settledFDs(t *testing.T, limit int) int {
	t.Helper()
	return heldStill(func() int { return p.fdsBelow(t, limit) }, 20*time.Millisecond, 5, 5*time.Second)
}

// heldStill reads read every interval until it returns the same value
// reads times in a row after the first, or until within has passed, and
// returns the last value.
func heldStill[N comparable](read func() N, interval time.Duration, reads int, within time.Duration) N {
	n, still := read(), 0
	for deadline := time.Now().Add(within); still < reads && time.Now().Before(deadline); {
		time.Sleep(interval)
		if m := read(); m == n {
			still++
		} else {
			n, still = m, 0
		}
	}
	return n
}

// openFDs counts the process's open file descriptors, and those of them
// that are pipe ends.
func (p *caddyProcess) openFDs(t *testing.T) (fds, pipes int) {
	t.Helper()
	targets, err := p.fdTargets()
	if err != nil {
		t.Fatalf("count caddy's fds: %v", err)
	}
	for _, target := range targets {
		if strings.HasPrefix(target, "pipe:") {
			pipes++
		}
	}
	return len(targets), pipes
}

// fdSummary lists the process's open descriptors by what they are (socket,
// pipe, anon_inode:[eventpoll], a file's path), for failure messages.
func (p *caddyProcess) fdSummary() string {
	targets, err := p.fdTargets()
	if err != nil {
		return err.Error()
	}
	kinds := map[string]int{}
	for _, target := range targets {
		kind, _, _ := strings.Cut(target, ":[")
		kinds[kind]++
	}
	return fmt.Sprint(kinds)
}

// fdTargets returns what each of the process's open descriptors refers to
// ("socket:[123]", "pipe:[456]", a path).
func (p *caddyProcess) fdTargets() ([]string, error) {
	dir := fmt.Sprintf("/proc/%d/fd", p.cmd.Process.Pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var targets []string
	for _, e := range ents {
		// A descriptor closed since ReadDir is left out.
		if target, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil {
			targets = append(targets, target)
		}
	}
	return targets, nil
}

// fdsBelow counts the process's open descriptors numbered below limit: the
// room RLIMIT_NOFILE leaves is limit minus this count.
func (p *caddyProcess) fdsBelow(t *testing.T, limit int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.cmd.Process.Pid))
	if err != nil {
		t.Fatalf("count caddy's fds: %v", err)
	}
	n := 0
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd < limit {
			n++
		}
	}
	return n
}

// syncBuffer is an io.Writer for a subprocess's output that the test may
// read while the process still writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// tail returns the last n bytes of b.
func tail(b []byte, n int) []byte {
	return b[max(len(b)-n, 0):]
}

// builtCaddy returns the real Caddy binary for subprocess tests:
// KTLS_CADDY_BIN when set, else bin/caddy rebuilt from this tree (`go
// build` relinks only when a source changed: seconds once built); in the
// VM, bin/caddy as the harness built it.
func builtCaddy(t *testing.T) string {
	t.Helper()
	// In the VM (KTLS_REQUIRE=1) the checkout is read-only and the harness
	// has built bin/caddy on the host (make vmtest depends on make build).
	if os.Getenv("KTLS_CADDY_BIN") == "" && !kerneltest.Required() {
		goTool, err := exec.LookPath("go")
		if err != nil {
			t.Fatalf("building bin/caddy needs the go command (or set KTLS_CADDY_BIN): %v", err)
		}
		// Built beside it and renamed over it: a VM that runs bin/caddy
		// from this checkout (9p) keeps the file it started, never a
		// half-written one.
		tmp := filepath.Join("bin", fmt.Sprintf(".caddy.%d", os.Getpid()))
		args := []string{goTool, "build", "-o", tmp, "./cmd/caddy"}
		if nice, err := exec.LookPath("nice"); err == nil {
			args = append([]string{nice, "-n", "10"}, args...)
		}
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("go build ./cmd/caddy: %v\n%s", err, out)
		}
		if err := os.Rename(tmp, filepath.Join("bin", "caddy")); err != nil {
			t.Fatal(err)
		}
	}
	return caddyBinary(t)
}
