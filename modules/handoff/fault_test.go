package handoff

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
)

// Either process of an upgrade dies during the handoff, at a point the
// test chooses: the other serves on with what it holds. The dying one is
// a child process (this test binary in a peer mode), so that its death is
// real: its sockets close and its pidfd says it exited. The process state
// and the objects are the test's (fake), registered as a forwarder
// registers its own: the app's part is what it does with them.

func TestMain(m *testing.M) {
	upgrade.RegisterState(upgrade.State{
		Versions: "test 1",
		Settle:   func(time.Time) (bool, []zap.Field) { return true, nil },
		Export:   fake.export,
		Adopt:    fake.adopt,
		Ended:    fake.ended,
	})
	upgrade.Register(upgrade.Participant{
		Name: upgrade.NameSandbox, Kind: handoff.KindTunnel, Tunnels: true, Noun: "tunnel",
		StayMessage: "test tunnel stays", StayKey: "id", MovedField: "moved", StayedField: "stayed", AdoptedField: "tunnels",
		Move: func(context.Context, handoff.Mover) handoff.MoveResult[string] {
			var res handoff.MoveResult[string]
			res.Stay(handoff.Stay[string]{Object: "7", Why: handoff.StayNotMovable})
			return res
		},
		Adopt: func([]byte, []*os.File) (func(), func(), error) { return func() {}, func() {}, nil },
	})
	if mode := os.Getenv("FORWARDER_HANDOFF_PEER"); mode != "" {
		os.Exit(handoffPeer(mode, os.Getenv("FORWARDER_HANDOFF_PATH")))
	}
	os.Exit(m.Run())
}

// fakeState is the test's process state: what it exported and adopted,
// and each done and Ended call.
type fakeState struct {
	mu      sync.Mutex
	dones   []bool
	adopted []string
	ends    int
}

var fake fakeState

// peerState is the state the dying old process hands over.
const peerState = "state of the old process"

func (f *fakeState) export() ([]byte, func(bool), error) {
	return []byte("state of this process"), func(moved bool) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.dones = append(f.dones, moved)
	}, nil
}

func (f *fakeState) adopt(state []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.adopted = append(f.adopted, string(state))
	return nil
}

func (f *fakeState) ended() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ends++
}

// reset forgets every call so far.
func (f *fakeState) reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dones, f.adopted, f.ends = nil, nil, 0
}

func (f *fakeState) calls() (dones []bool, adopted []string, ended int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.dones), slices.Clone(f.adopted), f.ends
}

// faultTimeout is the handoff timeout of the fault tests.
const faultTimeout = 2 * time.Second

// handoffPeer is the dying process:
//   - "new-dies-after-state": a new process that adopts the old one's
//     process state and dies before the handoff's end;
//   - "old-dies-after-state": an old process that hands its process state
//     (peerState) over and dies before the end;
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
	if fate, _ := sess.Move(handoff.KindProcess, []byte(peerState)); fate != handoff.Moved {
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

// The new process dies after it adopted the process state, before the
// handoff's end: the old process takes its state back (done(false), once)
// and serves on; its answer names the death and what stayed.
func TestHandoffNewProcessDiesAfterState(t *testing.T) {
	fake.reset()
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
	if dones, _, _ := fake.calls(); !slices.Equal(dones, []bool{false}) {
		t.Errorf("the state's done calls %v, want one: false (this process takes it back)", dones)
	}
}

// The old process dies after it handed its process state over, before the
// handoff's end: the new process serves on with the state it adopted, and
// acts on it once the handoff has ended (Ended).
func TestHandoffOldProcessDiesAfterState(t *testing.T) {
	fake.reset()
	path := filepath.Join(t.TempDir(), "handoff.sock")
	peer := startPeer(t, "old-dies-after-state", path)
	waitFile(t, path+".ready")
	before := counterValue(handoffs.WithLabelValues("new", "done"))
	h := &Handoff{Socket: path, Timeout: caddy.Duration(faultTimeout), logger: zap.NewNop()}
	h.takeTunnels(&handoff.Hello{PID: peer.Process.Pid})
	exitedWith(t, peer)
	if got := counterValue(handoffs.WithLabelValues("new", "done")) - before; got != 1 {
		t.Errorf("handoffs{new,done} %+v, want +1: the state moved", got)
	}
	if _, adopted, ended := fake.calls(); !slices.Equal(adopted, []string{peerState}) || ended != 1 {
		t.Errorf("adopted %q, Ended %d times; want the old process's state once, then Ended once", adopted, ended)
	}
}

// The old process dies once asked for its tunnels, before its state
// moved: the new process serves as after a restart, with nothing adopted.
func TestHandoffOldProcessDiesBeforeState(t *testing.T) {
	fake.reset()
	path := filepath.Join(t.TempDir(), "handoff.sock")
	peer := startPeer(t, "old-dies-before-state", path)
	waitFile(t, path+".ready")
	takeAlone(t, path, peer.Process.Pid)
	exitedWith(t, peer)
}

// A new process whose running process is gone (nobody at the socket, its
// PID exited) serves as after a restart.
func TestHandoffOldProcessGone(t *testing.T) {
	fake.reset()
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
	takeAlone(t, path, gone.Process.Pid)
}

// takeAlone runs a new process's ask for the tunnels of the process pid
// at path, which must end as after a restart: it returns (the process
// does not exit), counts the handoff as peer_died and adopts nothing.
func takeAlone(t *testing.T, path string, pid int) {
	t.Helper()
	before := counterValue(handoffs.WithLabelValues("new", "peer_died"))
	h := &Handoff{Socket: path, Timeout: caddy.Duration(faultTimeout), logger: zap.NewNop()}
	h.takeTunnels(&handoff.Hello{PID: pid})
	if got := counterValue(handoffs.WithLabelValues("new", "peer_died")) - before; got != 1 {
		t.Errorf("handoffs{new,peer_died} %+v, want +1", got)
	}
	if _, adopted, ended := fake.calls(); len(adopted) != 0 || ended != 0 {
		t.Errorf("adopted %q, Ended %d times; want nothing", adopted, ended)
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
