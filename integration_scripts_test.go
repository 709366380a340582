package caddyktls

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestBenchScriptHelp: integration/bench.sh -h and --help (alone or after
// other flags) print its usage and the driver's flags and exit 0 on this
// host, without installing, building into the VM or booting anything.
func TestBenchScriptHelp(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"--help"}, {"--smoke", "-contenders", "ktls", "-h"}} {
		// A PATH without apt-get, qemu or sudo: the help needs none of them.
		cmd := exec.Command("integration/bench.sh", args...)
		cmd.Env = append(os.Environ(), "KTLS_BUILD_DIR="+t.TempDir(), "BENCH_KERNEL=none")
		start := time.Now()
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("bench.sh %q: %v\n%s", args, err, out)
		}
		for _, want := range []string{"usage: integration/bench.sh [--native] [--smoke]", "--smoke    at a tiny size", "BENCH_SPLIT", "The driver's flags:", "-contenders string", "-gateway-ktls"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("bench.sh %q printed no %q:\n%s", args, want, out)
			}
		}
		for _, unwanted := range []string{"setup-host", "fetch-kernel", "qemu", "vm:"} {
			if strings.Contains(string(out), unwanted+":") {
				t.Errorf("bench.sh %q went past the help (%q):\n%s", args, unwanted, out)
			}
		}
		t.Logf("bench.sh %q: help in %v", args, time.Since(start).Round(time.Millisecond))
	}
}

// aptLockScript runs script in bash with integration/lib.sh sourced and
// APT_LOCK_ROOT at root.
func aptLockScript(root, wait, script string) *exec.Cmd {
	cmd := exec.Command("bash", "-c", ". integration/lib.sh; "+script)
	cmd.Env = append(os.Environ(), "APT_LOCK_ROOT="+root, "APT_LOCK_WAIT="+wait)
	return cmd
}

// TestAptWaitsForLocks: the scripts' apt_get (integration/lib.sh) waits
// while another process holds dpkg's frontend lock (as unattended-upgrades
// does on a fresh cloud VM), saying which lock and who holds it, runs
// apt-get with DPkg::Lock::Timeout once it is free, and gives up after
// APT_LOCK_WAIT seconds with an error that says what to do. The locks are
// fcntl locks, as apt's and dpkg's, on files under a temporary root.
func TestAptWaitsForLocks(t *testing.T) {
	root := t.TempDir()
	lockFile := filepath.Join(root, "var/lib/dpkg/lock-frontend")
	if err := os.MkdirAll(filepath.Dir(lockFile), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(lockFile, os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	lock := func(typ int16) {
		t.Helper()
		if err := syscall.FcntlFlock(f.Fd(), syscall.F_SETLK, &syscall.Flock_t{Type: typ, Whence: 0}); err != nil {
			t.Fatal(err)
		}
	}
	// A fake apt-get first in PATH records its arguments.
	bin := t.TempDir()
	record := filepath.Join(t.TempDir(), "apt-get.args")
	if err := os.WriteFile(filepath.Join(bin, "apt-get"), []byte("#!/bin/sh\necho \"$@\" >"+record+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	path := "PATH=" + bin + ":" + os.Getenv("PATH")
	pid := strconv.Itoa(os.Getpid())
	comm, _ := os.ReadFile("/proc/self/comm")
	holder := lockFile + " (held by process " + pid + ", " + strings.TrimSpace(string(comm)) + ")"

	// Free: apt-get runs at once, silently, with the lock timeout.
	cmd := aptLockScript(root, "5", "apt_get install -y make")
	cmd.Env = append(cmd.Env, path)
	if out, err := cmd.CombinedOutput(); err != nil || len(out) != 0 {
		t.Fatalf("apt_get with no lock held: %v, output %q", err, out)
	}
	if got, _ := os.ReadFile(record); string(got) != "-o DPkg::Lock::Timeout=5 install -y make\n" {
		t.Errorf("apt-get ran with %q", got)
	}
	os.Remove(record)

	// Held for longer than the bound: no apt-get, an error naming the
	// lock, its holder and what to do.
	lock(syscall.F_WRLCK)
	start := time.Now()
	cmd = aptLockScript(root, "2", "apt_get update -qq")
	cmd.Env = append(cmd.Env, path)
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("apt_get ran while %s was locked:\n%s", lockFile, out)
	}
	if d := time.Since(start); d < 2*time.Second || d > 10*time.Second {
		t.Errorf("apt_get gave up after %v, want about APT_LOCK_WAIT=2 s", d)
	}
	want := "apt: waiting up to 2 s for " + holder + ": another apt or dpkg (unattended-upgrades on a fresh machine) is installing\n" +
		"ERROR: apt: " + holder + " is still locked after 2 s: another apt or dpkg is installing; let it finish (or raise APT_LOCK_WAIT=<seconds>) and run this again\n"
	if string(out) != want {
		t.Errorf("apt_get with the lock held printed\n%s\nwant\n%s", out, want)
	}
	if _, err := os.Stat(record); err == nil {
		t.Error("apt-get ran although the lock was never free")
	}

	// Released while it waits: apt-get runs, and the wait said so.
	cmd = aptLockScript(root, "30", "apt_get update -qq")
	cmd.Env = append(cmd.Env, path)
	var buf syncBuffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, func() bool { return strings.Contains(buf.String(), "waiting up to 30 s for "+holder) }, "apt_get says what it waits for")
	lock(syscall.F_UNLCK)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("apt_get after the lock was released: %v\n%s", err, buf.String())
	}
	if !strings.Contains(buf.String(), "apt: the lock is free after ") {
		t.Errorf("apt_get did not say the wait ended:\n%s", buf.String())
	}
	if got, _ := os.ReadFile(record); string(got) != "-o DPkg::Lock::Timeout=30 update -qq\n" {
		t.Errorf("apt-get ran with %q", got)
	}
}

// aptGetCall matches apt-get in a command's position (not in a message).
var aptGetCall = regexp.MustCompile(`(^|[;&|(]|\bthen|\bdo)\s*apt-get\s`)

// TestScriptsUseAptGet: every apt-get that installs or updates the
// system's packages in the scripts goes through apt_get, which waits for
// another apt to finish. (fetch-kernel.sh and build-tls-ko.sh run apt-get
// download and update on private state directories, which no other apt
// locks.)
func TestScriptsUseAptGet(t *testing.T) {
	files, _ := filepath.Glob("integration/*.sh")
	more, _ := filepath.Glob("examples/*.sh")
	files = append(append(files, more...), ".ci/run")
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range strings.Split(string(data), "\n") {
			code, _, _ := strings.Cut(line, "#")
			if !aptGetCall.MatchString(code) || strings.Contains(code, `"${APTO[@]}"`) || strings.Contains(code, `"DPkg::Lock::Timeout=`) {
				continue
			}
			t.Errorf("%s:%d runs apt-get directly: use apt_get (integration/lib.sh), which waits for another apt's lock: %s", file, n+1, strings.TrimSpace(line))
		}
	}
}
