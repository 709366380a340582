// Package deploy_test checks the operator kit in this directory with the
// tools that will read it: systemd-analyze for the systemd unit, promtool
// for the Prometheus rules. (That the dashboard's and the rules' queries
// name metrics the binary exports is checked in the module's own package:
// deploy_metrics_test.go.) integration/setup-host.sh installs both tools,
// so in CI neither test skips.
package deploy_test

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

const unitFile = "systemd/caddy-ktls.service"

// tool returns the path of a checker, or skips t saying how to get it.
func tool(t *testing.T, name, pkg string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("%s not found: this check of the operator kit did not run (apt-get install %s, or integration/setup-host.sh)", name, pkg)
	}
	return path
}

// verifyUnit runs `systemd-analyze verify` on the unit text, as the file
// caddy-ktls.service, and returns its output and error. verify checks that
// the commands exist, so the unit's /usr/bin/caddy becomes a stub in the
// temporary directory, in the Exec lines only; nothing else changes.
func verifyUnit(t *testing.T, analyze, unit string) (string, error) {
	t.Helper()
	dir := t.TempDir()
	stub := filepath.Join(dir, "caddy")
	if err := os.WriteFile(stub, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(unit, "\n")
	replaced := 0
	for i, l := range lines {
		if strings.HasPrefix(l, "Exec") && strings.Contains(l, "=/usr/bin/caddy ") {
			lines[i] = strings.Replace(l, "=/usr/bin/caddy ", "="+stub+" ", 1)
			replaced++
		}
	}
	if replaced != 2 {
		t.Fatalf("%s: %d Exec lines run /usr/bin/caddy; want 2 (ExecStart, ExecReload)", unitFile, replaced)
	}
	path := filepath.Join(dir, "caddy-ktls.service")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	// --man=no: the Documentation= URLs are not man pages to look up.
	out, err := exec.Command(analyze, "verify", "--man=no", path).CombinedOutput()
	return string(out), err
}

// TestSystemdUnitVerifies runs `systemd-analyze verify` on the unit and
// fails on any output: verify exits 0 on an unknown key (a typo such as
// LimitNOFIL= is a warning, "Unknown key ... ignoring"), so a clean unit is
// one it has nothing to say about. The second subtest shows that such a
// typo is caught.
func TestSystemdUnitVerifies(t *testing.T) {
	analyze := tool(t, "systemd-analyze", "systemd")
	raw, err := os.ReadFile(unitFile)
	if err != nil {
		t.Fatal(err)
	}
	unit := string(raw)
	t.Run("clean", func(t *testing.T) {
		out, err := verifyUnit(t, analyze, unit)
		if err != nil || strings.TrimSpace(out) != "" {
			t.Errorf("systemd-analyze verify %s: %v\n%s", unitFile, err, out)
		}
	})
	t.Run("typo caught", func(t *testing.T) {
		typo := strings.Replace(unit, "\nLimitNOFILE=", "\nLimitNOFIL=", 1)
		if typo == unit {
			t.Fatalf("%s has no LimitNOFILE= line", unitFile)
		}
		out, err := verifyUnit(t, analyze, typo)
		if !strings.Contains(out, "LimitNOFIL") {
			t.Errorf("systemd-analyze verify said nothing of LimitNOFIL= (%v): %q", err, out)
		}
	})
}

// unitSettings reads the unit's key=value lines (no comments), by key.
func unitSettings(t *testing.T) map[string][]string {
	t.Helper()
	f, err := os.Open(unitFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == ';' || line[0] == '[' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: %q is not key=value", unitFile, line)
		}
		out[k] = append(out[k], v)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// one returns the single value of key.
func one(t *testing.T, s map[string][]string, key string) string {
	t.Helper()
	if len(s[key]) != 1 {
		t.Fatalf("%s: %s= set %d times, want once", unitFile, key, len(s[key]))
	}
	return s[key][0]
}

// drainGraceDefault reads the sandbox handler's documented default
// drain_grace_period from the field's doc comment in modules/forwarder/handler.go
// ("Default: 30s."), which is also its JSON documentation.
func drainGraceDefault(t *testing.T) time.Duration {
	t.Helper()
	src, err := os.ReadFile("../modules/forwarder/handler.go")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`// Default: (\S+)\.\n\s*DrainGracePeriod caddy\.Duration`).FindSubmatch(src)
	if m == nil {
		t.Fatal(`modules/forwarder/handler.go: no "// Default: <d>." right above the DrainGracePeriod field; update this test with where the default is now`)
	}
	d, err := time.ParseDuration(string(m[1]))
	if err != nil {
		t.Fatalf("modules/forwarder/handler.go: drain_grace_period default %q: %v", m[1], err)
	}
	return d
}

// TestSystemdUnitSettings checks what the unit promises in its comments:
// ordered after the module is loaded, a stop timeout above the drain, the
// signal Caddy drains on, descriptors for tunnels, one capability.
func TestSystemdUnitSettings(t *testing.T) {
	s := unitSettings(t)
	for _, key := range []string{"After", "Wants"} {
		if !strings.Contains(" "+one(t, s, key)+" ", " systemd-modules-load.service ") {
			t.Errorf("%s=%s: want systemd-modules-load.service (the tls module is loaded there)", key, one(t, s, key))
		}
	}
	// Caddy drains on SIGTERM (and on a first SIGINT): caddy/v2's
	// sigtrap_posix.go; SIGQUIT would exit at once.
	if got := one(t, s, "KillSignal"); got != "SIGTERM" {
		t.Errorf("KillSignal=%s, want SIGTERM", got)
	}
	stop, err := time.ParseDuration(one(t, s, "TimeoutStopSec"))
	if err != nil {
		t.Fatalf("TimeoutStopSec: %v", err)
	}
	// The drain, plus the 5 s each activity pusher may take to flush
	// before it (forwarder.Handler.Cleanup), plus room for the HTTP app.
	if grace := drainGraceDefault(t); stop < grace+5*time.Second+10*time.Second {
		t.Errorf("TimeoutStopSec=%v: want at least drain_grace_period's default %v + 5s of activity flush + 10s", stop, grace)
	}
	nofile, err := strconv.Atoi(one(t, s, "LimitNOFILE"))
	if err != nil {
		t.Fatalf("LimitNOFILE: %v", err)
	}
	// Up to 6 descriptors per tunnel (2 sockets, 2 pipes); at most the
	// kernel's default fs.nr_open, above which the unit does not start.
	if nofile < 100000*6 || nofile > 1<<20 {
		t.Errorf("LimitNOFILE=%d: want room for 100,000 busy tunnels (6 descriptors each) and at most 1048576 (fs.nr_open)", nofile)
	}
	for _, key := range []string{"AmbientCapabilities", "CapabilityBoundingSet"} {
		if got := one(t, s, key); got != "CAP_NET_BIND_SERVICE" {
			t.Errorf("%s=%s, want CAP_NET_BIND_SERVICE only", key, got)
		}
	}
	if got := one(t, s, "Type"); got != "notify" {
		t.Errorf("Type=%s, want notify (caddy run sends READY=1)", got)
	}
	if got := one(t, s, "ExecReload"); !strings.HasPrefix(got, "/usr/bin/caddy reload ") {
		t.Errorf("ExecReload=%s, want caddy reload", got)
	}
	if !strings.Contains(one(t, s, "RestrictAddressFamilies"), "AF_NETLINK") {
		t.Error("RestrictAddressFamilies without AF_NETLINK: sock_diag and the target policy's interface addresses need it")
	}
}

// TestModulesLoad checks the modules-load.d file: it loads the tls module
// and nothing else.
func TestModulesLoad(t *testing.T) {
	raw, err := os.ReadFile("modules-load.d/ktls.conf")
	if err != nil {
		t.Fatal(err)
	}
	var modules []string
	for l := range strings.Lines(string(raw)) {
		l = strings.TrimSpace(l)
		if l != "" && l[0] != '#' && l[0] != ';' {
			modules = append(modules, l)
		}
	}
	if len(modules) != 1 || modules[0] != "tls" {
		t.Errorf("modules-load.d/ktls.conf loads %q, want [tls]", modules)
	}
}

// TestPrometheusRules runs `promtool check rules` on the alerts and `promtool
// test rules` on their unit tests (prometheus/caddy-ktls.rules.test.yml:
// each alert fires for a forwarder with its cause and stays quiet for a
// healthy, busy one).
func TestPrometheusRules(t *testing.T) {
	promtool := tool(t, "promtool", "prometheus")
	for _, args := range [][]string{
		{"check", "rules", "caddy-ktls.rules.yml"},
		{"test", "rules", "caddy-ktls.rules.test.yml"},
	} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "prometheus"
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "SUCCESS") {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		} else {
			t.Logf("promtool %s: %s", strings.Join(args, " "), strings.Join(strings.Fields(string(out)), " "))
		}
	}
}
