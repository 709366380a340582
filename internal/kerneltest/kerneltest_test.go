package kerneltest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// childEnv makes TestKernelRequire, re-executed in a subprocess, play the kTLS
// test that calls Require.
const childEnv = "KERNELTEST_REQUIRE_CHILD"

// pastRequire is what the child logs once Require let it through.
const pastRequire = "ran past Require"

// runChild runs TestKernelRequire as a child in a subprocess with KTLS_REQUIRE
// set to require ("" removes it) and returns its stdout, stderr and exit
// code.
func runChild(t *testing.T, require string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run", "^TestKernelRequire$", "-test.v", "-test.count=1")
	cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, RequireEnv+"=") })
	cmd.Env = append(cmd.Env, childEnv+"=1")
	if require != "" {
		cmd.Env = append(cmd.Env, RequireEnv+"="+require)
	}
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		code = exit.ExitCode()
	default:
		t.Fatalf("run %s: %v", os.Args[0], err)
	}
	return out.String(), errOut.String(), code
}

// hasLinePrefix reports whether a line of s starts with prefix.
func hasLinePrefix(s, prefix string) bool {
	for line := range strings.Lines(s) {
		if strings.HasPrefix(line, prefix) {
			return true
		}
	}
	return false
}

// TestKernelRequire: without kTLS a kernel test skips loudly (a stderr line
// starting "SKIP: <test>: <reason>", go test's "--- SKIP", never PASS), and
// with KTLS_REQUIRE=1 it fails; with kTLS it runs in both modes. The kernel
// test is this test itself, re-executed as a child.
func TestKernelRequire(t *testing.T) {
	if os.Getenv(childEnv) == "1" {
		Require(t)
		t.Log(pastRequire)
		return
	}
	avail := Available()
	for _, require := range []string{"", "0", "1"} {
		t.Run("KTLS_REQUIRE="+require, func(t *testing.T) {
			stdout, stderr, code := runChild(t, require)
			report := "exit " + strconv.Itoa(code) + "\nstdout:\n" + stdout + "\nstderr:\n" + stderr
			switch {
			case avail == nil:
				if code != 0 || !strings.Contains(stdout, "--- PASS: TestKernelRequire") || !strings.Contains(stdout, pastRequire) ||
					strings.Contains(stdout+stderr, "SKIP") {
					t.Fatalf("kTLS available: want the test to run and pass\n%s", report)
				}
			case require == "1":
				if code != 1 || !strings.Contains(stdout, "--- FAIL: TestKernelRequire") ||
					!strings.Contains(stdout, "FAIL: kTLS required ("+RequireEnv+"=1) but "+avail.Error()) ||
					strings.Contains(stdout, pastRequire) || strings.Contains(stdout, "--- SKIP") {
					t.Fatalf("no kTLS, %s=1: want a failure naming the reason\n%s", RequireEnv, report)
				}
			default:
				if code != 0 || !hasLinePrefix(stderr, "SKIP: TestKernelRequire: "+avail.Error()) ||
					!strings.Contains(stdout, "--- SKIP: TestKernelRequire") || !strings.Contains(stdout, "SKIP: "+avail.Error()) ||
					strings.Contains(stdout, "--- PASS") || strings.Contains(stdout, pastRequire) {
					t.Fatalf("no kTLS, %s=%q: want a loud skip\n%s", RequireEnv, require, report)
				}
			}
		})
	}
}

// fatalRecorder is a testing.TB whose Fatalf records the message instead
// of stopping the test.
type fatalRecorder struct {
	testing.TB
	fatal string
}

func (f *fatalRecorder) Fatalf(format string, args ...any) { f.fatal = fmt.Sprintf(format, args...) }

// namedRecorder is a testing.TB of another name that records its first
// failure and its skip instead of acting on them.
type namedRecorder struct {
	testing.TB
	name          string
	fatal, skip   string
	failed, skips int
}

func (r *namedRecorder) Name() string { return r.name }
func (r *namedRecorder) Fatalf(format string, args ...any) {
	if r.failed++; r.failed == 1 {
		r.fatal = fmt.Sprintf(format, args...)
	}
}
func (r *namedRecorder) Skipf(format string, args ...any) {
	r.skips++
	r.skip = fmt.Sprintf(format, args...)
}

// TestRequireNeedsPrefix: a test that calls Require under a name the VM
// harness does not select fails on every kernel, with or without kTLS; one
// named TestKernel… (or its subtest) gets no such failure.
func TestRequireNeedsPrefix(t *testing.T) {
	for _, name := range []string{"TestSandboxDrain", "TestSandboxDrain/TestKernelX", "BenchmarkKernelRelay", "Testkernel"} {
		r := &namedRecorder{TB: t, name: name}
		Require(r)
		if r.failed == 0 || !strings.Contains(r.fatal, name[:strings.IndexByte(name+"/", '/')]+" calls kerneltest.Require but its name lacks the TestKernel prefix") {
			t.Errorf("Require in %q: first failure %q, want one naming the missing prefix", name, r.fatal)
		}
	}
	for _, name := range []string{"TestKernelDrain", "TestKernelDrain/sub"} {
		r := &namedRecorder{TB: t, name: name}
		Require(r)
		if strings.Contains(r.fatal, "prefix") {
			t.Errorf("Require in %q failed for its name: %q", name, r.fatal)
		}
		// What remains is the kernel's answer: run, skip, or (KTLS_REQUIRE=1) fail.
		if (Available() == nil) != (r.failed == 0 && r.skips == 0) {
			t.Errorf("Require in %q on a kernel where Available() = %v: %d failures (%q), %d skips", name, Available(), r.failed, r.fatal, r.skips)
		}
	}
}

// TestBulkMiB (and PositiveEnv under it): the default when KTLS_TEST_MIB
// is unset, its value when set, and a failure naming it when it is not a
// positive integer.
func TestBulkMiB(t *testing.T) {
	t.Setenv(BulkEnv, "")
	os.Unsetenv(BulkEnv)
	if got := BulkMiB(t, 3); got != 3 {
		t.Fatalf("unset: %d, want the default 3", got)
	}
	t.Setenv(BulkEnv, "64")
	if got := BulkMiB(t, 3); got != 64 {
		t.Fatalf("%s=64: %d", BulkEnv, got)
	}
	for _, bad := range []string{"0", "-1", "1.5", "lots"} {
		t.Setenv(BulkEnv, bad)
		rec := &fatalRecorder{TB: t}
		BulkMiB(rec, 3)
		if !strings.Contains(rec.fatal, BulkEnv+"=\""+bad+"\"") {
			t.Errorf("%s=%q: failure %q, want one naming the variable and value", BulkEnv, bad, rec.fatal)
		}
	}
}
