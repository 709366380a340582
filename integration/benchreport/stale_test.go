package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The code a benchmark report measures, as git pathspecs from the
// repository root: the forwarder (Caddy with this module, the mechanisms
// under it) and the harness's driver, which is the gateway and the
// upstream. Tests, test support the binaries do not link, documentation
// and the report renderer are not measured.
var (
	measuredCommon = []string{
		"go.mod", "go.sum", ":(glob)*.go", "ktls", "splice", "forward", "preamble",
		"internal/sockerr", "internal/loopback", "internal/cphttp", "cmd/caddy", "integration/bench",
		"modules/forwarder", "internal/moduleid", "internal/caddymetrics", "internal/offload", "internal/controlplane",
		"internal/l4conn", "internal/logsummary", "internal/caddyfileargs", "internal/cli", "internal/listensock", "internal/adminapi", "integration/internal/benchjson",
		":(exclude,glob)**/*_test.go", ":(exclude)" + unlinkedTestSupport,
	}
	// The gateway modules, which only the gateway chains (l7-l7, l7-l4,
	// l4-l4) run in a Caddy process.
	gatewayCode       = []string{"gateway", "modules/edgegateway"}
	measuredForwarder = append(append([]string{}, measuredCommon...), excludeAll(gatewayCode)...)
	measuredGateway   = append(append([]string{}, measuredCommon...), gatewayCode...)
)

// unlinkedTestSupport is test support under a measured path that no
// measured binary links (TestTestSupportNotLinked).
const unlinkedTestSupport = "forward/forwardtest"

func excludeAll(paths []string) []string {
	var out []string
	for _, p := range paths {
		out = append(out, ":(exclude)"+p)
	}
	return out
}

// benchReports are the committed reports (docs/bench), each with the JSON
// it is rendered from, the code it measures and how to measure it again.
var benchReports = []struct {
	md       []string
	json     []string
	measures []string
	redo     string
}{
	{[]string{"results.md"}, []string{"results-1.json", "results-2.json"}, measuredForwarder, "make bench && make bench-report"},
	{[]string{"bulk-1gib.md"}, []string{"bulk-1gib-1.json", "bulk-1gib-2.json"}, measuredForwarder, "make bench-bulk && make bench-report"},
	{[]string{"small-calls.md"}, []string{"small-calls-1.json", "small-calls-2.json"}, measuredForwarder, "the command in docs/bench/README.md (small shapes rerun)"},
	{[]string{"small-mtls.md"}, []string{"small-mtls-1.json", "small-mtls-2.json"}, measuredForwarder, "the mutual-TLS run's command in docs/bench/README.md"},
	{[]string{"gateway.md", "gateway-results.md"}, []string{"gateway-results-1.json", "gateway-results-2.json"}, measuredGateway, "make bench-gateway && make bench-report"},
	{[]string{"gateway-resumption.md"}, []string{"gateway-resumption.json"}, measuredGateway, "the command in docs/bench/README.md (gateway-resumption.md's rerun)"},
	{[]string{"load.md"}, []string{"load.json"}, measuredForwarder, "make bench-load, or the reduced run's command in docs/bench/README.md"},
	{[]string{"load-10k.md"}, []string{"load-10k.json"}, measuredForwarder, "the 10,000-tunnel reuse run's command in docs/bench/README.md"},
	{[]string{"load-native-percall.md"}, []string{"load-native-percall.json"}, measuredForwarder, "the native load run's commands in docs/bench/overload.md, on a machine with cores to spare"},
	{[]string{"load-native-reuse.md"}, []string{"load-native-reuse.json"}, measuredForwarder, "the native load run's commands in docs/bench/overload.md, on a machine with cores to spare"},
	{[]string{"ttfb.md"}, []string{"ttfb.json"}, measuredGateway, "make bench-ttfb"},
	{[]string{"load-gateway.md"}, []string{"load-gateway.json"}, measuredGateway, "the reduced chain run's command in docs/bench/README.md"},
}

// The changes of 2026-12-05 that every report measured before them misses.
const (
	sinceGoneForwarder = "ktls.Conn.Gone and the forwarder's gateway-gone check before each target dial (one getsockopt(TCP_INFO) per tunnel), and, on no tunnel's path, an upgrade's old process serving the connections it accepted before the switch, a handoff's block of tunnel IDs and its holding the Go collector off while tunnels move, and a Pause that lands on a half-close waiting for it (the half-close through one more call)"
	// sinceHandoffPackage: the sandbox_handoff app moved into a package of
	// its own, after the last measurements of 2026-12-06.
	sinceHandoffPackage = "the sandbox_handoff app moved from modules/forwarder into modules/handoff, the forwarder registering its state and objects with internal/upgrade (the upgrade's path only: no tunnel's or handshake's path changed)"
	// sinceAdoption: the changes of 2026-12-06 to a tunnel's move and
	// adoption in an upgrade (sinceMove) and to the bench's port picks,
	// after every report but bulk-1gib.md was measured.
	sinceAdoption = sinceMove + "; and the bench's contenders listening on ports below the ephemeral range (integration/bench: a port race of bench-smoke; no contender's or measurement's path changed)"
	// sinceDiag: sinceAdoption and the changes of the session after it
	// (b49cf70..c545768), one of them on every kernel TLS handshake's path.
	sinceDiag = sinceAdoption + "; and every kernel TLS install's sock_diag query reading into a pooled buffer and asking capget(2) only of an answer without TLS details (one 16 KiB allocation less per handshake, and with kTLS one system call: measured alone by ktls's BenchmarkReadULPInfo), and, on the upgrade's path only, the new process building moved tunnels at once, a handoff session's socket type checked once and an adopted socket's options left as net.FileConn set them where they already were"
	// sinceOwnSockets: the change of 720f1d2.
	sinceOwnSockets = "on the upgrade's path only, the old process sending a moved tunnel's sockets as it holds them, not duplicated (ktls.Conn.Handoff returning the Conn's own socket, fdpass.Send taking any syscall.Conn): no tunnel's or handshake's path changed"
	// sinceDiagAndOwnSockets: both, for the reports measured before
	// sinceDiag.
	sinceDiagAndOwnSockets = sinceDiag + "; and " + sinceOwnSockets
	sinceMove              = "an adopted tunnel's sockets keeping their keepalive and Nagle settings (internal/tcpfile), the moved states in a binary encoding decoded once (internal/wire) and an adopted session's peer certificates parsed once per process (the upgrade's move and adoption only: no tunnel's or handshake's path changed); measured before them"
)

// sinceChainBounds: the bench's -max-handshakes and -max-scheduling-delay
// reaching an l4-l4 gateway's ktls handler too, after every report was
// measured.
const sinceChainBounds = "the bench's -max-handshakes and -max-scheduling-delay reaching an l4-l4 gateway's ktls handler as well as the forwarder's (integration/bench; neither is set in any committed run, so no contender's configuration changed)"

// sinceAdoptKey: the changes after sinceChainBounds to a moved kernel TLS
// session's adoption.
const sinceAdoptKey = "on the upgrade's path only, ktls.Adopt checking a direction's key alone (not its IV) and taking the offload modes from the handed-off state (HandoffState version 4) instead of a sock_diag query; on the handshake's path trafficKeys derives the same key and IV through one more function: no tunnel's or handshake's work changed"

// sinceSuiteOnce: c48ffcf, after the reports measured on 2026-12-07.
const sinceSuiteOnce = "trafficKeys (every kernel TLS handshake, both directions) looking its suite up and checking the secret once instead of twice (since e8e50f6 and 6bfb2ad): measured on code that did one suite lookup and length check more per direction, a few table reads against a handshake's milliseconds"

// sinceSettleAfter: the load run's changes after the reports measured on
// 2026-12-07 (the closing tallies read once the contender has settled;
// failed_behind and shape_counters).
const sinceSettleAfter = "the load run waiting, after a shape, for its contender to settle before it reads the shape's closing counters and tls_stat, and a chain's key-install check counting the handshakes failed behind its gateway (integration/bench; the other modes, every measurement's path and every contender's configuration unchanged)"

// sincePartialRecord: the kernel RX readers' bounded wait for a partial
// record (ktls/partial.go), after every report was measured.
const sincePartialRecord = "every read of a kernel TLS receive socket watched for a partial record behind a closed window (ktls/partial.go): two atomic additions around each wait (ktls.Conn.BeginWait and EndWait from the splice relay, which keeps the source's Waiter in its heap state), ktls.Conn.Read calling read(2) through the socket's RawConn instead of net.TCPConn.Read, one sweep every 125 ms over the process's kernel RX sockets, and one SIOCINQ ioctl for each wait that outlasts 250 ms; measured before it"

// sinceAdminDrain: the admin routes' body drain, after the reports
// measured on 2026-12-07.
const sinceAdminDrain = "every admin route of the module reading what its answer left of a request body (internal/adminapi, in modules/forwarder's and modules/handoff's admin routes) and a comment's line breaks in ktls/partial.go: the admin API's path only, no tunnel's or handshake's path changed"

// sinceChainTunnels: the load run's key-install check for the chains,
// after the reports measured on 2026-12-08.
const sinceChainTunnels = "the load run's key-install check counting a chain's tunnels as no more than its gateway's completed handshakes with the hop behind it (integration/bench; benchjson's comment on gateway_tunnels): the other modes, every measurement's path and every contender's configuration unchanged"

// knownStale are reports measured before a change to the code they
// measure and not measured again yet, each with why. The test fails for a
// stale report that is not listed here, and for a listed one that is
// current (remove it once it is measured again).
var knownStale = map[string]string{
	"bulk-1gib.md":           "measured 2026-12-01 (inferred: c4af7b1); 1 GiB each way takes hours in the VM and was not rerun since; since: " + sinceGoneForwarder + "; and " + sinceHandoffPackage + "; and " + sinceDiagAndOwnSockets + "; and " + sinceChainBounds + "; and " + sinceAdoptKey + "; and " + sinceSettleAfter + "; and " + sincePartialRecord + "; and " + sinceAdminDrain + "; and " + sinceChainTunnels,
	"load-native-percall.md": "measured 2026-12-04 on 5bc2ae9 on a lent 16-core machine (no kTLS; the forwarder as ktls-off), which the session could not have again; since: max_handshakes counted over the process (the same with one handler), the refusal-summary table, ktls Handoff/Adopt, the bench's memory fields, the generator closing a failed call's socket without close_notify, ktls-off closing without close_notify after a failed Write and max_scheduling_delay (off by default); rerun with the commands in docs/bench/overload.md on such a machine; since: " + sinceGoneForwarder + "; and " + sinceHandoffPackage + "; and " + sinceDiagAndOwnSockets + "; and " + sinceChainBounds + "; and " + sinceAdoptKey + "; and " + sinceSettleAfter + "; and " + sincePartialRecord + "; and " + sinceAdminDrain + "; and " + sinceChainTunnels,
	"load-native-reuse.md":   "measured 2026-12-04 on 5bc2ae9 on a lent 16-core machine, as load-native-percall.md, with the same changes since; since: " + sinceGoneForwarder + "; and " + sinceHandoffPackage + "; and " + sinceDiagAndOwnSockets + "; and " + sinceChainBounds + "; and " + sinceAdoptKey + "; and " + sinceSettleAfter + "; and " + sincePartialRecord + "; and " + sinceAdminDrain + "; and " + sinceChainTunnels,
	"load.md":                "measured 2026-12-08 on 346a827; since: " + sinceChainTunnels,
	"load-10k.md":            "measured 2026-12-08 on 346a827; since: " + sinceChainTunnels,
	"ttfb.md":                "measured 2026-12-08 on 29d4289; since: " + sinceChainTunnels,
}

// git runs git in the repository root and returns its trimmed output.
func git(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = filepath.Join("..", "..")
	out, err := cmd.Output()
	return strings.TrimSpace(string(out)), err
}

// TestBenchReportsMeasureCurrentCode: every committed report was measured
// on a commit that holds the last change to the code it measures; a report
// older than that names the commits it misses and how to measure it again.
// The commit comes from the JSON ("commit", which bench.sh records), or for
// runs before it was recorded, from the run's date (the last commit before
// it). A stale report listed in knownStale is logged, not failed.
func TestBenchReportsMeasureCurrentCode(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("SKIP: no git: which commit a report measured cannot be checked")
	}
	if inside, err := git(t, "rev-parse", "--is-inside-work-tree"); err != nil || inside != "true" {
		t.Skip("SKIP: not a git checkout (a source archive): which commit a report measured cannot be checked")
	}
	if shallow, _ := git(t, "rev-parse", "--is-shallow-repository"); shallow == "true" {
		t.Skip("SKIP: a shallow clone lacks the history that says whether a report is older than its code: run in a full clone (git fetch --unshallow)")
	}
	for _, rep := range benchReports {
		name := rep.md[0]
		var commits []string
		var inferred bool
		for _, file := range rep.json {
			data, err := os.ReadFile(filepath.Join("..", "..", "docs", "bench", file))
			if err != nil {
				t.Fatal(err)
			}
			var doc struct{ Date, Commit string }
			if err := json.Unmarshal(data, &doc); err != nil {
				t.Fatalf("%s: %v", file, err)
			}
			commit := strings.TrimSuffix(doc.Commit, "-dirty")
			if commit == "" {
				// Recorded before the harness kept the commit: the last one
				// before the run.
				c, err := git(t, "log", "-1", "--format=%H", "--before="+doc.Date, "HEAD")
				if err != nil || c == "" {
					t.Errorf("%s: no commit recorded and none before its date %q: %v", file, doc.Date, err)
					continue
				}
				commit, inferred = c, true
			}
			if _, err := git(t, "cat-file", "-e", commit+"^{commit}"); err != nil {
				t.Errorf("%s names commit %s, which this repository does not have", file, commit)
				continue
			}
			commits = append(commits, commit)
		}
		if len(commits) != len(rep.json) {
			continue
		}
		last, err := git(t, append([]string{"log", "-1", "--format=%H", "HEAD", "--"}, rep.measures...)...)
		if err != nil || last == "" {
			t.Fatalf("git log of the code %s measures: %v", name, err)
		}
		var stale []string
		for _, c := range commits {
			if _, err := git(t, "merge-base", "--is-ancestor", last, c); err != nil {
				missed, _ := git(t, append([]string{"log", "--format=%h %cs %s", c + "..HEAD", "--"}, rep.measures...)...)
				lines := strings.Split(missed, "\n")
				stale = append(stale, c[:12])
				how := "recorded"
				if inferred {
					how = "inferred from the run's date"
				}
				msg := "docs/bench/" + name + " was measured on " + c[:12] + " (" + how + "), but " +
					strings.Join(lines[:min(len(lines), 3)], "; ")
				if len(lines) > 3 {
					msg += " and " + itoa(len(lines)-3) + " more commits"
				}
				msg += " changed the code it measures since: measure it again (" + rep.redo + ")"
				if reason, ok := knownStale[name]; ok {
					t.Logf("KNOWN STALE (%d commits behind): %s; why it stays: %s", len(lines), msg, reason)
				} else {
					t.Error(msg + ", or, if it must stay, list it in knownStale with why")
				}
				break
			}
		}
		if len(stale) == 0 {
			if _, ok := knownStale[name]; ok {
				t.Errorf("docs/bench/%s is current (measured on %s, after the last change to its code): remove it from knownStale", name, commits[0][:12])
			}
		}
	}
	for name := range knownStale {
		found := false
		for _, rep := range benchReports {
			found = found || rep.md[0] == name
		}
		if !found {
			t.Errorf("knownStale lists %s, which is no report of benchReports", name)
		}
	}
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// The test support the measured code leaves out is linked by neither
// measured binary: Caddy with this module and the bench's driver.
func TestTestSupportNotLinked(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("SKIP: no go command: what the binaries link cannot be listed")
	}
	cmd := exec.Command("go", "list", "-deps", "./cmd/caddy", "./integration/bench")
	cmd.Dir = filepath.Join("..", "..")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	pkg := "github.com/ktlsingress/caddy-ktls/" + unlinkedTestSupport
	deps := strings.Fields(string(out))
	if len(deps) < 100 {
		t.Fatalf("go list -deps listed %d packages, want the binaries' whole closure", len(deps))
	}
	for _, d := range deps {
		if d == pkg || strings.HasPrefix(d, pkg+"/") {
			t.Errorf("%s is linked into a measured binary: it is measured code, not test support", d)
		}
	}
}
