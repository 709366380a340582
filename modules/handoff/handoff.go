// Package handoff is the `sandbox_handoff` app: a binary upgrade without
// dropping a tunnel, and POST /sandbox/upgrade (admin.api.sandbox_handoff),
// which starts one. It moves what the features register with
// internal/upgrade: the process state, then every participant's objects.
package handoff

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/controlplane"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/listensock"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
)

// A binary upgrade without dropping a tunnel. The running process (old)
// listens on the handoff socket; a new process started with the same
// configuration connects to it twice:
//
//  1. As its first configuration starts, before it listens on any
//     tcp-handoff address, it asks for the listening sockets (tcp-handoff
//     listeners, internal/listensock): its servers then accept from the
//     same sockets as the old process, never beside them. The old process
//     goes on accepting. A configuration that is only validated (caddy
//     validate) starts nothing and asks for nothing.
//  2. Once its configuration runs, it asks for the rest. The old process
//     stops accepting (connections wait in the kernel's queue for the new
//     one), lets the connections it accepted finish their handshake and
//     open their tunnel (upgrade.State's Settle), moves the process state
//     (the forwarder's: its activity-report stream with every sandbox's
//     counters, the preamble replay caches, Close's refusals, the
//     bandwidth buckets), then the objects of every participant
//     (upgrade.Participant: the forwarder's standby connections and
//     tunnels, an edge gateway's tunnels), each one it can.
//
// The handoff ends when the new process answers the old one's DONE
// (handoff.Sender.Finish); the old process then names the new one the
// service's main process and exits as on SIGTERM: the tunnels that could
// not move (userspace TLS, still opening) drain there for
// drain_grace_period. Whatever fails, each listener, tunnel and report
// stream is served by exactly one process: a failure before the process
// state moved leaves everything with the old process, which accepts
// again. If the new process dies before the end, the old one takes the
// report stream back (the new one takes no report before the end) and
// serves on; the tunnels that had moved ended with the new process. If
// the old process dies, the new one serves on with what it took (as after
// a restart when that was nothing).

func init() {
	caddy.RegisterModule(new(Handoff))
}

// Handoff is the `sandbox_handoff` app: the socket over which a new
// process of this forwarder or gateway takes over from the running one.
// With it, a configuration loads only if every listener that serves a
// sandbox or sandbox_proxy handler is a tcp-handoff/ address
// (upgrade.CheckListeners).
type Handoff struct {
	// Socket is the path of the Unix socket the running process listens
	// on and a new process connects to. Only this process's user (and
	// root) can connect: the socket is made mode 0600 and the peer's
	// credentials are checked, as the state it carries holds the tunnels'
	// traffic secrets. Its directory must exist and be private to the
	// service (e.g. /run/caddy). Required.
	Socket string `json:"socket,omitempty"`
	// Timeout bounds each wait for the other process: its hello, and its
	// answer for each listener, state and tunnel offered. Default: 5s.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	ctx    caddy.Context
	logger *zap.Logger
	held   bool // this instance holds a reference to senders[Socket]
}

// CaddyModule returns the Caddy module information.
func (*Handoff) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxHandoff, New: func() caddy.Module { return new(Handoff) }}
}

// DefaultHandoffTimeout is Handoff.Timeout's default.
const DefaultHandoffTimeout = 5 * time.Second

// What a new process asks for (handoff.Hello.Want).
const (
	wantListeners = "listeners"
	wantTunnels   = "tunnels"
)

// Provision checks the configuration; a process's first configuration
// takes the listening sockets of the process running at Socket, if any,
// as it starts (listensock.BeforeFirstListen, Start).
func (h *Handoff) Provision(ctx caddy.Context) error {
	h.ctx, h.logger = ctx, ctx.Logger(h)
	if h.Socket == "" {
		return errors.New("sandbox_handoff: socket is required: the path of a Unix socket in a directory private to the service, e.g. /run/caddy/sandbox-handoff.sock")
	}
	if !filepath.IsAbs(h.Socket) {
		return fmt.Errorf("sandbox_handoff: socket %q must be an absolute path", h.Socket)
	}
	if h.Timeout < 0 {
		return fmt.Errorf("sandbox_handoff: timeout %v must not be negative: give a duration such as 5s, or leave it out (5s)", time.Duration(h.Timeout))
	}
	if h.Timeout == 0 {
		h.Timeout = caddy.Duration(DefaultHandoffTimeout)
	}
	if _, ok := upgrade.ProcessState(); !ok {
		return errors.New("sandbox_handoff: this build has no process state to hand over (no sandbox forwarder module)")
	}
	upgrading.mu.Lock()
	first := !upgrading.provisioned
	upgrading.provisioned = true
	upgrading.mu.Unlock()
	if first {
		listensock.BeforeFirstListen(h.takeListeners)
	}
	return nil
}

// upgrading is the process's part in an upgrade.
var upgrading struct {
	mu          sync.Mutex
	provisioned bool           // a sandbox_handoff app was provisioned in this process
	from        *handoff.Hello // the process whose listeners this one took, until it takes its tunnels
}

// senders are the handoff sockets this process listens on, by path,
// shared by the configurations that name them (a reload keeps the socket).
var senders = caddy.NewUsagePool()

// stateVersions names the encodings this build moves
// (upgrade.Encodings); two builds hand over only when they agree on all
// of them.
func stateVersions() string { return upgrade.Encodings() }

func (h *Handoff) config(want string) handoff.Config {
	return handoff.Config{
		Build:      controlplane.UserAgent() + "; states: " + stateVersions(),
		Compatible: compatible,
		Timeout:    time.Duration(h.Timeout),
		Want:       want,
	}
}

// compatible refuses a peer that moves state in other encodings.
func compatible(peer handoff.Hello) error {
	_, theirs, _ := strings.Cut(peer.Build, "; states: ")
	if ours := stateVersions(); theirs != ours {
		return fmt.Errorf("the other process (%s) moves state this build cannot read (its encodings: %q; this build's: %q): replace it by a restart, which drains its tunnels", peer.Build, theirs, ours)
	}
	return nil
}

// noProcessAt reports whether a dial error means nobody listens at the
// socket: this process is the first.
func noProcessAt(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED)
}

// takeListeners is step 1 of a new process.
func (h *Handoff) takeListeners() error {
	r, err := handoff.Dial(h.Socket, h.config(wantListeners))
	if noProcessAt(err) {
		h.logger.Info("no running process to take over from", zap.String("socket", h.Socket))
		return nil
	}
	if err != nil {
		return fmt.Errorf("sandbox_handoff: taking over from the process at %s: %w", h.Socket, err)
	}
	defer r.Close()
	var addrs []string
	for {
		it, err := r.Next()
		if errors.Is(err, handoff.ErrDone) {
			break
		}
		if err != nil {
			return fmt.Errorf("sandbox_handoff: the listening sockets of the process at %s (pid %d): %w", h.Socket, r.Peer().PID, err)
		}
		addr := string(it.State)
		var aerr error
		switch {
		case it.Kind != handoff.KindListener:
			aerr = fmt.Errorf("object kind %d offered where listening sockets were asked for", it.Kind)
		case len(it.Files) != 1:
			aerr = fmt.Errorf("listening socket %s came with %d descriptors, want 1", addr, len(it.Files))
		default:
			aerr = listensock.Adopt(addr, it.Files[0])
		}
		if aerr != nil {
			it.Refuse(aerr.Error())
			h.logger.Warn("refused a listening socket of the running process; this process binds its own", zap.String("address", addr), zap.Error(aerr))
			continue
		}
		// Both processes accept from the socket until the old one stops:
		// its verdict changes nothing here.
		it.Adopt()
		it.Close()
		addrs = append(addrs, addr)
	}
	// This process's servers accept from the sockets only once it holds
	// the running one's state (takeTunnels): a tunnel opened here before
	// would stand outside the report stream it takes over.
	listensock.PauseAccepting()
	peer := r.Peer()
	upgrading.mu.Lock()
	upgrading.from = &peer
	upgrading.mu.Unlock()
	h.logger.Info("took the listening sockets of the running process; its tunnels follow once this configuration runs",
		zap.Int("pid", peer.PID), zap.String("build", peer.Build), zap.Strings("listeners", addrs))
	return nil
}

// Start listens on the handoff socket. In a process that took listeners
// over, it first takes the tunnels once the configuration runs (step 2).
func (h *Handoff) Start() error {
	// Step 1 now, unless a server listened first, which took it.
	if err := listensock.TakeOver(); err != nil {
		return err
	}
	upgrading.mu.Lock()
	from := upgrading.from
	upgrading.from = nil
	upgrading.mu.Unlock()
	if from == nil {
		return h.serve()
	}
	go func() {
		if !h.waitRunning() {
			h.logger.Warn("this configuration stopped before it ran: the tunnels stay with the process that runs them", zap.Int("pid", from.PID))
			return
		}
		h.takeTunnels(from)
		if err := h.serve(); err != nil {
			h.logger.Error("cannot listen for the next upgrade", zap.Error(err))
		}
	}()
	return nil
}

// waitRunning waits until h's configuration is the one Caddy runs (every
// app started), or reports false once it is stopped.
func (h *Handoff) waitRunning() bool {
	for {
		if a, _ := caddy.ActiveContext().AppIfConfigured(moduleid.SandboxHandoff); a == any(h) {
			return true
		}
		select {
		case <-h.ctx.Done():
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// serve listens on Socket for the next process, for as long as a loaded
// configuration names it.
func (h *Handoff) serve() error {
	v, _, err := senders.LoadOrNew(h.Socket, func() (caddy.Destructor, error) {
		ln, err := handoff.Listen(h.Socket)
		if err != nil {
			return nil, err
		}
		s := &sender{ln: ln, logger: h.logger, done: make(chan struct{})}
		s.cfg.Store(new(h.config("")))
		go s.loop()
		return s, nil
	})
	if err != nil {
		return fmt.Errorf("sandbox_handoff: %w", err)
	}
	h.held = true
	// A reload's configuration sets the timeout of the next handoff.
	v.(*sender).cfg.Store(new(h.config("")))
	return nil
}

// Stop does nothing: the socket outlives a reload (Cleanup).
func (h *Handoff) Stop() error { return nil }

// Cleanup releases this configuration's use of the socket.
func (h *Handoff) Cleanup() error {
	if h.held {
		h.held = false
		senders.Delete(h.Socket)
	}
	return nil
}

// Interface guards.
var (
	_ caddy.App          = (*Handoff)(nil)
	_ caddy.Provisioner  = (*Handoff)(nil)
	_ caddy.CleanerUpper = (*Handoff)(nil)
)
