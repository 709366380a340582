package handoff

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/internal/adminapi"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// AdminAPI is the admin API module `admin.api.sandbox_handoff`:
//
//   - POST /sandbox/upgrade: starts the binary now installed at this
//     process's path, with its arguments, which takes the listening
//     sockets and the tunnels over (sandbox_handoff), and answers what
//     moved (UpgradeResponse); this process then exits.
type AdminAPI struct{}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.AdminHandoff, New: func() caddy.Module { return new(AdminAPI) }}
}

// Routes returns the admin routes.
func (AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{adminapi.Route("/sandbox/upgrade", serveUpgrade)}
}

// UpgradeResponse is the answer of POST /sandbox/upgrade: what the new
// process took over, or why it did not.
type UpgradeResponse struct {
	// PID and Build are the new process's.
	PID   int    `json:"pid"`
	Build string `json:"build,omitempty"`
	// Moved counts the tunnels that moved; Stayed those that stay in this
	// process (until they end, or its drain ends them), by why:
	// "conn" (userspace TLS), "pause", "not-movable" (still opening),
	// "refused".
	Moved  int            `json:"moved"`
	Stayed map[string]int `json:"stayed,omitempty"`
	// StandbyMoved counts the gateways' standby connections (mutual TLS
	// done, no preamble yet) that moved; StandbyStayed those that stay, by
	// why, as Stayed.
	StandbyMoved  int            `json:"standby_moved"`
	StandbyStayed map[string]int `json:"standby_stayed,omitempty"`
	// Others counts the other features' objects (internal/upgrade's
	// participants) that moved and stayed, by feature: "gateway", an edge
	// gateway's sandbox_proxy tunnels.
	Others map[string]MovedCounts `json:"others,omitempty"`
	// Duration is the handoff's, from the new process's ask for the
	// tunnels; PauseP99 and PauseMax the moved tunnels' pauses.
	Duration caddy.Duration `json:"duration,omitempty"`
	PauseP99 caddy.Duration `json:"pause_p99,omitempty"`
	PauseMax caddy.Duration `json:"pause_max,omitempty"`
	// Error says why no handoff happened: this process serves on. Moved
	// then counts the tunnels that had moved to a new process that died
	// during the handoff (they ended with it).
	Error string `json:"error,omitempty"`
}

// count sets what moved of each participant's objects: the forwarder's
// tunnels and standby connections in the answer's own fields, the others'
// under their names.
func (out *UpgradeResponse) count(moved []participantMoved) {
	for _, m := range moved {
		switch m.p.Name {
		case upgrade.NameSandbox:
			out.Moved, out.Stayed = m.res.Moved, m.res.Stayed
		case upgrade.NameStandby:
			out.StandbyMoved, out.StandbyStayed = m.res.Moved, m.res.Stayed
		default:
			if out.Others == nil {
				out.Others = map[string]MovedCounts{}
			}
			out.Others[m.p.Name] = MovedCounts{Moved: m.res.Moved, Stayed: m.res.Stayed}
		}
	}
}

// MovedCounts is what moved of one feature's objects, and what stayed by
// why (as UpgradeResponse's Moved and Stayed).
type MovedCounts struct {
	Moved  int            `json:"moved"`
	Stayed map[string]int `json:"stayed,omitempty"`
}

// upgrades passes the outcome of a handoff to a POST /sandbox/upgrade
// waiting for it.
var upgrades upgradeWaiter

type upgradeWaiter struct {
	mu     sync.Mutex
	waiter chan upgradeOutcome // nil: nobody waits
}

type upgradeOutcome struct {
	UpgradeResponse
	ack chan struct{} // closed once the answer is written
}

// wait registers the caller as the waiter; false: another one waits.
func (u *upgradeWaiter) wait() (<-chan upgradeOutcome, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.waiter != nil {
		return nil, false
	}
	u.waiter = make(chan upgradeOutcome, 1)
	return u.waiter, true
}

func (u *upgradeWaiter) done() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.waiter = nil
}

// publish hands out to the waiter, if any; the channel closes once the
// waiter answered (at once when nobody waits).
func (u *upgradeWaiter) publish(out UpgradeResponse) <-chan struct{} {
	ack := make(chan struct{})
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.waiter == nil {
		close(ack)
		return ack
	}
	select {
	case u.waiter <- upgradeOutcome{out, ack}:
	default:
		close(ack)
	}
	return ack
}

// upgradeTimeout bounds POST /sandbox/upgrade's wait for the new process.
const upgradeTimeout = 5 * time.Minute

// serveUpgrade is POST /sandbox/upgrade: the new process is this one's
// executable as installed now (os.Executable names the path, not the
// running file), started with this one's arguments and environment, as
// its child: under systemd it runs in the service's cgroup, and this
// process names it the main process once it holds the state.
func serveUpgrade(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPost {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: errMethod}
	}
	serving := false
	senders.Range(func(_, _ any) bool { serving = true; return false })
	if !serving {
		return caddy.APIError{HTTPStatus: http.StatusConflict,
			Err: errors.New("no sandbox_handoff app in the running configuration: add one (its socket) to upgrade without dropping tunnels")}
	}
	outcomes, ok := upgrades.wait()
	if !ok {
		return caddy.APIError{HTTPStatus: http.StatusConflict, Err: errors.New("an upgrade is in progress")}
	}
	defer upgrades.done()
	exe, err := os.Executable()
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusInternalServerError, Err: fmt.Errorf("the executable's path: %w", err)}
	}
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Stdout, cmd.Stderr, cmd.Env = os.Stdout, os.Stderr, os.Environ()
	if err := cmd.Start(); err != nil {
		return caddy.APIError{HTTPStatus: http.StatusInternalServerError, Err: fmt.Errorf("starting the new process: %w", err)}
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case o := <-outcomes:
		defer close(o.ack)
		if o.Error != "" {
			return caddy.APIError{HTTPStatus: http.StatusBadGateway, Err: fmt.Errorf("the new process (pid %d) did not take over: %s", cmd.Process.Pid, o.Error)}
		}
		return writeJSON(w, o.UpgradeResponse)
	case err := <-exited:
		return caddy.APIError{HTTPStatus: http.StatusBadGateway,
			Err: fmt.Errorf("the new process (%s, pid %d) exited before it took over (%v): its log says why; this process serves on", exe, cmd.Process.Pid, err)}
	case <-time.After(upgradeTimeout):
		return caddy.APIError{HTTPStatus: http.StatusGatewayTimeout,
			Err: fmt.Errorf("the new process (pid %d) did not take over within %v; this process serves on", cmd.Process.Pid, upgradeTimeout)}
	}
}

var errMethod = errors.New("method not allowed: use POST")

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// Interface guard.
var _ caddy.AdminRouter = AdminAPI{}
