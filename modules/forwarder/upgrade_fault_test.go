package forwarder

import (
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
)

// Either process of an upgrade dies during the handoff, at a point the
// test chooses: the other serves on with what it holds. The dying one is
// a child process (this test binary in a peer mode), so that its death is
// real: its sockets close and its pidfd says it exited.

func TestMain(m *testing.M) {
	if mode := os.Getenv("FORWARDER_HANDOFF_PEER"); mode != "" {
		os.Exit(handoffPeer(mode, os.Getenv("FORWARDER_HANDOFF_PATH")))
	}
	os.Exit(m.Run())
}

// faultTimeout is the handoff timeout of the fault tests.
const faultTimeout = 2 * time.Second

// handoffPeer is the dying process:
//   - "new-dies-after-state": a new process that adopts the old one's
//     process state and dies before the handoff's end;
//   - "old-dies-after-state": an old process that hands its process state
//     over (written to PATH.state too, for the test) and dies before the
//     end;
//   - "old-dies-before-state": an old process that dies once the new one
//     asked for its tunnels.
func handoffPeer(mode, path string) int {
	cfg := (&Handoff{Timeout: caddy.Duration(faultTimeout)}).config
	if mode == "new-dies-after-state" {
		r, err := handoff.Dial(path, cfg(wantTunnels))
		if err != nil {
			return 2
		}
		it, err := r.Next()
		if err != nil || it.Kind != handoff.KindProcess || it.Adopt() != nil {
			return 2
		}
		os.Exit(3)
	}
	ln, err := handoff.Listen(path)
	if err != nil {
		return 2
	}
	os.WriteFile(path+".ready", nil, 0o600)
	sess, err := handoff.Accept(ln, cfg(""))
	if err != nil {
		return 2
	}
	if mode == "old-dies-before-state" {
		os.Exit(3)
	}
	reg := forward.NewRegistry()
	tun, _, err := reg.Open("sbx-fault", "10.9.0.1:80", forward.Origin{}, 0)
	if err != nil {
		return 2
	}
	tun.AddToSandbox(1234)
	tun.Close()
	st, _, err := reg.HandOff()
	if err != nil {
		return 2
	}
	state, _ := json.Marshal(processState{Version: processStateVersion, Reports: st})
	if os.WriteFile(path+".state", state, 0o600) != nil {
		return 2
	}
	if fate, _ := sess.Move(handoff.KindProcess, state); fate != handoff.Moved {
		return 2
	}
	os.Exit(3)
	return 0
}

// startPeer runs handoffPeer(mode) with its socket at path.
func startPeer(t *testing.T, mode, path string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FORWARDER_HANDOFF_PEER="+mode, "FORWARDER_HANDOFF_PATH="+path)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd
}

// exitedWith waits for the peer and fails t unless it died where its mode
// says (exit status 3).
func exitedWith(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	cmd.Wait()
	if cmd.ProcessState.ExitCode() != 3 {
		t.Fatalf("the peer exited %v: it did not die where the test says", cmd.ProcessState)
	}
}

// freshRegistry gives the test a registry of its own as the process's.
func freshRegistry(t *testing.T) {
	saved := tunnels
	tunnels = forward.NewRegistry()
	t.Cleanup(func() { tunnels = saved })
}

// The new process dies after it adopted the process state, before the
// handoff's end: the old process takes its report stream back (the same
// stream, every byte, nothing reported twice) and serves on.
func TestHandoffNewProcessDiesAfterState(t *testing.T) {
	freshRegistry(t)
	tun, _, err := tunnels.Open("sbx-stays", "10.9.0.2:80", forward.Origin{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer tun.Close()
	tun.AddFromSandbox(777)
	started := tunnels.Started()
	before := counterValue(handoffs.WithLabelValues("old", "peer_died"))

	path := filepath.Join(t.TempDir(), "handoff.sock")
	ln, err := handoff.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	peer := startPeer(t, "new-dies-after-state", path)
	sess, err := handoff.Accept(ln, (&Handoff{Timeout: caddy.Duration(faultTimeout)}).config(""))
	if err != nil {
		t.Fatal(err)
	}
	s := &sender{logger: zap.NewNop()}
	out := s.sendTunnels(sess)
	exitedWith(t, peer)
	if !strings.Contains(out.Error, "the new process died during the handoff") || out.Moved != 0 || out.Stayed[handoff.StayNotMovable] != 1 {
		t.Errorf("the old process's answer: %+v; want the new process's death, 0 moved, the tunnel (not movable here) stayed", out)
	}
	if got := counterValue(handoffs.WithLabelValues("old", "peer_died")) - before; got != 1 {
		t.Errorf("handoffs{old,peer_died} %+v, want +1", got)
	}
	rep, ok := tunnels.TakeReport("fwd")
	if !ok || rep.Sequence != 1 || !rep.ProcessStart.Equal(started.UTC()) {
		t.Fatalf("the old process's report after the failed handoff: ok %v, %+v; want sequence 1 of its own stream (started %v)", ok, rep.ReportID, started)
	}
	if len(rep.Sandboxes) != 1 || rep.Sandboxes[0].Sandbox != "sbx-stays" || rep.Sandboxes[0].BytesFromSandbox != 777 {
		t.Errorf("the old process's report after the failed handoff: %+v; want sbx-stays' 777 bytes", rep.Sandboxes)
	}
	if _, _, err := tunnels.HandOff(); err != nil {
		t.Errorf("the next handoff: %v", err)
	}
}

// The old process dies after it handed its process state over, before the
// handoff's end: the new process serves on with the adopted stream, and
// reports it (it took no report during the handoff).
func TestHandoffOldProcessDiesAfterState(t *testing.T) {
	freshRegistry(t)
	path := filepath.Join(t.TempDir(), "handoff.sock")
	peer := startPeer(t, "old-dies-after-state", path)
	waitFile(t, path+".ready")
	before := counterValue(handoffs.WithLabelValues("new", "done"))
	h := &Handoff{Socket: path, Timeout: caddy.Duration(faultTimeout), logger: zap.NewNop()}
	h.takeTunnels(&handoff.Hello{PID: peer.Process.Pid})
	exitedWith(t, peer)
	var ps processState
	b, err := os.ReadFile(path + ".state")
	if err != nil || json.Unmarshal(b, &ps) != nil {
		t.Fatalf("the old process's state: %v", err)
	}
	if got := counterValue(handoffs.WithLabelValues("new", "done")) - before; got != 1 {
		t.Errorf("handoffs{new,done} %+v, want +1: the state moved", got)
	}
	rep, ok := tunnels.TakeReport("fwd")
	if !ok || rep.Sequence != 1 || !rep.ProcessStart.Equal(ps.Reports.Started.UTC()) {
		t.Fatalf("the new process's report: ok %v, %+v; want sequence 1 of the adopted stream (started %v)", ok, rep.ReportID, ps.Reports.Started)
	}
	if len(rep.Sandboxes) != 1 || rep.Sandboxes[0].BytesToSandbox != 1234 || rep.Sandboxes[0].TotalBytesToSandbox != 1234 {
		t.Errorf("the new process's report: %+v; want sbx-fault's 1234 bytes", rep.Sandboxes)
	}
}

// The old process dies once asked for its tunnels, before its state
// moved: the new process serves as after a restart, a stream of its own.
func TestHandoffOldProcessDiesBeforeState(t *testing.T) {
	freshRegistry(t)
	started := tunnels.Started()
	path := filepath.Join(t.TempDir(), "handoff.sock")
	peer := startPeer(t, "old-dies-before-state", path)
	waitFile(t, path+".ready")
	before := counterValue(handoffs.WithLabelValues("new", "peer_died"))
	h := &Handoff{Socket: path, Timeout: caddy.Duration(faultTimeout), logger: zap.NewNop()}
	h.takeTunnels(&handoff.Hello{PID: peer.Process.Pid}) // returns: it does not exit
	exitedWith(t, peer)
	if got := counterValue(handoffs.WithLabelValues("new", "peer_died")) - before; got != 1 {
		t.Errorf("handoffs{new,peer_died} %+v, want +1", got)
	}
	tun, _, err := tunnels.Open("sbx-new", "10.9.0.3:80", forward.Origin{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	tun.AddToSandbox(5)
	tun.Close()
	rep, ok := tunnels.TakeReport("fwd")
	if !ok || rep.Sequence != 1 || !rep.ProcessStart.Equal(started.UTC()) {
		t.Fatalf("the new process's report: ok %v, %+v; want sequence 1 of its own stream", ok, rep.ReportID)
	}
}

// A new process whose running process is gone (nobody at the socket, its
// PID exited) serves as after a restart.
func TestHandoffOldProcessGone(t *testing.T) {
	freshRegistry(t)
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "handoff.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close() // the socket file stays, nobody listens: ECONNREFUSED
	before := counterValue(handoffs.WithLabelValues("new", "peer_died"))
	h := &Handoff{Socket: path, Timeout: caddy.Duration(faultTimeout), logger: zap.NewNop()}
	h.takeTunnels(&handoff.Hello{PID: gone.Process.Pid})
	if got := counterValue(handoffs.WithLabelValues("new", "peer_died")) - before; got != 1 {
		t.Errorf("handoffs{new,peer_died} %+v, want +1", got)
	}
}

func waitFile(t *testing.T, path string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never appeared", path)
		}
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	c.Write(&m)
	return m.GetCounter().GetValue()
}
