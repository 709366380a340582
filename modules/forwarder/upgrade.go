package forwarder

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/controlplane"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/listensock"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
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
//     open their tunnel (settle), moves its process state (the activity-report stream with
//     every sandbox's counters, the preamble replay caches, Close's
//     refusals, the bandwidth buckets), then every tunnel it can: those
//     whose gateway session runs in kernel TLS, paused at a safe point.
//     A tunnel still opening is offered again until it is open or
//     movePassesFor has passed.
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
// process of this forwarder takes over from the running one. With it, a
// configuration loads only if every listener that serves a sandbox
// handler is a tcp-handoff/ address (checkHandoffListeners).
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

// movePassesFor bounds how long the old process offers again the tunnels
// that were still opening (handshake, preamble, dial) when it offered them.
const movePassesFor = 2 * time.Second

// processStateVersion is processState.Version as this build writes it.
const processStateVersion = 1

// processState is what moves before the tunnels.
type processState struct {
	Version int                 `json:"version"`
	Reports forward.ReportState `json:"reports"`
	Replay  []replayState       `json:"replay,omitempty"`
}

// replayState is one replay cache's nonces (preamble.ReplayState's binary
// encoding).
type replayState struct {
	Size   int           `json:"size"`
	Window time.Duration `json:"window"`
	Nonces []byte        `json:"nonces"`
}

// stateVersions names the encodings this build moves; two builds hand
// over only when they agree on all of them.
var stateVersions = fmt.Sprintf("tunnel %d, standby %d, report %d, process %d, ktls %d",
	forward.MovedTunnelVersion, forward.MovedStandbyVersion, forward.ReportStateVersion, processStateVersion, ktls.HandoffVersion)

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

func (h *Handoff) config(want string) handoff.Config {
	return handoff.Config{
		Build:      controlplane.UserAgent() + "; states: " + stateVersions,
		Compatible: compatible,
		Timeout:    time.Duration(h.Timeout),
		Want:       want,
	}
}

// compatible refuses a peer that moves state in other encodings.
func compatible(peer handoff.Hello) error {
	_, theirs, _ := strings.Cut(peer.Build, "; states: ")
	if theirs != stateVersions {
		return fmt.Errorf("the other process (%s) moves state this build cannot read (its encodings: %q; this build's: %q): replace it by a restart, which drains its tunnels", peer.Build, theirs, stateVersions)
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

// sender serves the handoff socket in the old process, one session at a
// time.
type sender struct {
	ln     *net.UnixListener
	logger *zap.Logger
	cfg    atomic.Pointer[handoff.Config] // the latest configuration's
	done   chan struct{}
}

func (s *sender) Destruct() error {
	err := s.ln.Close()
	<-s.done
	return err
}

func (s *sender) loop() {
	defer close(s.done)
	for {
		sess, err := handoff.Accept(s.ln, *s.cfg.Load())
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			s.logger.Warn("refused a process that asked to take over", zap.Error(err))
			handoffs.WithLabelValues("old", "failed").Inc()
			upgrades.publish(UpgradeResponse{Error: "refused the new process: " + err.Error()})
			continue
		}
		peer := sess.Peer()
		switch peer.Want {
		case wantListeners:
			s.sendListeners(sess)
		case wantTunnels:
			out := s.sendTunnels(sess)
			acked := upgrades.publish(out)
			if out.Error == "" {
				// The answer to POST /sandbox/upgrade goes out before
				// this process begins to exit.
				select {
				case <-acked:
				case <-time.After(2 * time.Second):
				}
				s.exit(peer)
				return
			}
		default:
			sess.Close()
			s.logger.Warn("refused a process that asked to take over: it asked for nothing this build hands over", zap.Int("pid", peer.PID), zap.String("want", peer.Want))
		}
	}
}

// sendListeners offers a duplicate of every tcp-handoff listening socket;
// this process goes on accepting from them.
func (s *sender) sendListeners(sess *handoff.Sender) {
	defer sess.Close()
	peer := sess.Peer()
	exported, err := listensock.Export()
	if err != nil {
		s.logger.Error("cannot hand the listening sockets over", zap.Int("pid", peer.PID), zap.Error(err))
		return
	}
	var moved []string
	for i, e := range exported {
		fate, err := sess.Move(handoff.KindListener, []byte(e.Address), e.File)
		e.File.Close()
		if fate != handoff.Moved {
			s.logger.Warn("the new process did not take a listening socket", zap.Int("pid", peer.PID), zap.String("address", e.Address), zap.Error(err))
			if !errors.As(err, new(*handoff.RefusedError)) {
				for _, rest := range exported[i+1:] {
					rest.File.Close()
				}
				return
			}
			continue
		}
		moved = append(moved, e.Address)
	}
	s.logger.Info("a new process shares the listening sockets; this process goes on accepting until it takes the tunnels over",
		zap.Int("pid", peer.PID), zap.String("build", peer.Build), zap.Strings("listeners", moved))
}

// sendTunnels is step 2 on the old side. Its answer has no Error when the
// process state moved: the new process serves from then on.
func (s *sender) sendTunnels(sess *handoff.Sender) UpgradeResponse {
	defer sess.Close()
	peer := sess.Peer()
	start := time.Now()
	out := UpgradeResponse{PID: peer.PID, Build: peer.Build}
	s.logger.Info("the new process asks for the tunnels: this process stops accepting, then hands its state and tunnels over",
		zap.Int("pid", peer.PID), zap.String("build", peer.Build))
	listensock.StopAccepting()
	if !settle(time.Now().Add(settleFor)) {
		s.logger.Warn("connections accepted before this process stopped accepting are still in their handshake or preamble; they stay here",
			zap.Duration("waited", settleFor), zap.Int64("handshakes", offload.HandshakesInProgress.Load()), zap.Int64("opening", tunnels.Opening()))
	}
	// No collection while the state and the tunnels move (a collection
	// stops every relay behind it), up to a memory limit.
	defer handoff.HoldCollection(handoff.CollectionHeadroom)()
	result := "failed"
	giveUp := func(msg string, err error) UpgradeResponse {
		listensock.ResumeAccepting()
		s.logger.Error(msg+": this process goes on serving every tunnel it holds and accepting", zap.Int("pid", peer.PID), zap.Error(err))
		handoffs.WithLabelValues("old", result).Inc()
		out.Error = fmt.Sprintf("%s: %v", msg, err)
		return out
	}
	reports, done, err := tunnels.HandOff()
	if err != nil {
		return giveUp("cannot hand the activity reports over", err)
	}
	replay, err := replayStates(time.Now())
	if err != nil {
		done(false)
		return giveUp("cannot encode the replay caches", err)
	}
	state, err := json.Marshal(processState{Version: processStateVersion, Reports: reports, Replay: replay})
	if err != nil {
		done(false)
		return giveUp("cannot encode the process state", err)
	}
	if fate, err := sess.Move(handoff.KindProcess, state); fate != handoff.Moved {
		done(false)
		return giveUp("the new process did not take the process state over", err)
	}
	// Standby connections first: one whose first preamble byte arrives as
	// it moves opens its tunnel here, which the passes of moveTunnels then
	// offer.
	standby := tunnels.MoveStandby(context.Background(), handoff.SenderMover(sess))
	res := moveTunnels(sess)
	// Then the other features' objects (upgrade.Register): an edge
	// gateway's sandbox_proxy tunnels.
	others := moveParticipants(sess)
	othersMoved := 0
	for _, o := range others {
		othersMoved += o.res.Moved
	}
	out.StandbyMoved, out.StandbyStayed = standby.Moved, standby.Stayed
	if err := sess.Finish(); err != nil && sess.PeerDied() {
		// The new process died with what it took: the tunnels that moved
		// ended with it; it reported nothing (a process takes reports of
		// an adopted stream only once the handoff ended), so this process
		// takes the stream back, and serves on.
		done(false)
		out.Moved, out.Stayed, result = res.Moved, res.Stayed, "peer_died"
		out.Others = othersResponse(others)
		return giveUp(fmt.Sprintf("the new process died during the handoff; the %d tunnels it had taken ended with it", res.Moved+othersMoved), err)
	}
	// The new process is the service's from now on: under systemd, the
	// main process says so (NotifyAccess=main takes it from no other),
	// and its own exit, and STOPPING=1, concern the service no more.
	notifyMainPID(s.logger, peer.PID)
	done(true)
	upgrade.HandedOver()
	handoffs.WithLabelValues("old", "done").Inc()
	pauses := slices.Clone(res.Pauses)
	stayed := len(res.Stays)
	for _, o := range others {
		pauses = append(pauses, o.res.Pauses...)
		stayed += len(o.res.Stays)
	}
	handoffTunnels.WithLabelValues("moved").Add(float64(res.Moved + othersMoved))
	handoffTunnels.WithLabelValues("stayed").Add(float64(stayed))
	for _, p := range pauses {
		handoffPause.Observe(p.Seconds())
	}
	out.Moved, out.Stayed, out.Duration = res.Moved, res.Stayed, caddy.Duration(time.Since(start))
	out.Others = othersResponse(others)
	slices.Sort(pauses)
	fields := []zap.Field{zap.Int("pid", peer.PID), zap.String("build", peer.Build), zap.Int("moved", res.Moved),
		zap.Any("stayed", res.Stayed), zap.Duration("duration", time.Since(start))}
	if n := len(pauses); n > 0 {
		p50, p99, pmax := pauses[n/2], pauses[(n*99)/100], pauses[n-1]
		out.PauseP99, out.PauseMax = caddy.Duration(p99), caddy.Duration(pmax)
		fields = append(fields, zap.Duration("pause_p50", p50), zap.Duration("pause_p99", p99), zap.Duration("pause_max", pmax))
	}
	fields = append(fields, zap.Int("standby_moved", standby.Moved), zap.Any("standby_stayed", standby.Stayed))
	for _, o := range others {
		fields = append(fields, zap.Int(o.name+"_moved", o.res.Moved), zap.Any(o.name+"_stayed", o.res.Stayed))
	}
	s.logger.Info("handed the tunnels over to the new process", fields...)
	for _, st := range res.Stays {
		s.logger.Info("sandbox tunnel stays in this process until it ends or the drain ends it", zap.Uint64("id", st.Object),
			zap.String("why", st.Why), zap.Error(st.Err))
	}
	for _, st := range standby.Stays {
		s.logger.Info("sandbox standby connection stays in this process until its preamble, its standby_timeout or the drain", zap.String("peer", st.Object),
			zap.String("why", st.Why), zap.Error(st.Err))
	}
	for _, o := range others {
		for _, st := range o.res.Stays {
			s.logger.Info(o.name+" tunnel stays in this process until it ends or the drain ends it", zap.String("tunnel", st.Object),
				zap.String("why", st.Why), zap.Error(st.Err))
		}
	}
	return out
}

// participantMoved is what a registered participant's Move did.
type participantMoved struct {
	name string
	res  handoff.MoveResult[string]
}

// moveParticipants offers every registered participant's objects.
func moveParticipants(sess *handoff.Sender) []participantMoved {
	var out []participantMoved
	for _, p := range upgrade.Participants() {
		out = append(out, participantMoved{p.Name, p.Move(context.Background(), handoff.SenderMover(sess))})
	}
	return out
}

func othersResponse(others []participantMoved) map[string]MovedCounts {
	if len(others) == 0 {
		return nil
	}
	m := make(map[string]MovedCounts, len(others))
	for _, o := range others {
		m[o.name] = MovedCounts{Moved: o.res.Moved, Stayed: o.res.Stayed}
	}
	return m
}

// settleFor bounds the old process's wait for the connections it accepted
// before it stopped accepting to finish their handshake and open their
// tunnel (handshake_timeout and preamble_timeout bound each).
const settleFor = 10 * time.Second

// settle waits until no connection of this process is in its TLS
// handshake or between it and its tunnel, but for the standby connections
// waiting for their first preamble byte, or until deadline; it reports
// whether they settled. A tunnel that opens after the report stream moved
// would not belong to it: it could not move.
func settle(deadline time.Time) bool {
	for {
		waiting, _ := tunnels.Standby()
		if offload.HandshakesInProgress.Load() == 0 && tunnels.Opening() <= int64(waiting) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// moveTunnels offers every open tunnel, then again those still opening,
// until none is left or movePassesFor has passed.
func moveTunnels(sess *handoff.Sender) handoff.MoveResult[uint64] {
	var total handoff.MoveResult[uint64]
	deadline := time.Now().Add(movePassesFor)
	for {
		res := tunnels.MoveTunnels(context.Background(), handoff.SenderMover(sess))
		total.Moved += res.Moved
		total.Pauses = append(total.Pauses, res.Pauses...)
		total.Stayed, total.Stays = res.Stayed, res.Stays
		if res.Stayed[handoff.StayNotMovable] == 0 || res.Stayed[handoff.StayRefused] > 0 || time.Now().After(deadline) {
			return total
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// replayStates exports every replay cache in use; a cache left out would
// let its nonces be replayed in the new process, so any failure fails all.
func replayStates(now time.Time) ([]replayState, error) {
	var out []replayState
	var err error
	replayCaches.Range(func(k, v any) bool {
		key := k.(replayCacheKey)
		var b []byte
		if b, err = v.(replayCacheEntry).State(now).MarshalBinary(); err != nil {
			return false
		}
		out = append(out, replayState{Size: key.size, Window: key.window, Nonces: b})
		return true
	})
	return out, err
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

// exit ends the old process as SIGTERM does, once the tunnels moved: the
// ones that stayed drain for drain_grace_period.
func (s *sender) exit(peer handoff.Hello) {
	s.logger.Info("exiting: the new process serves from now on", zap.Int("pid", peer.PID))
	syscall.Kill(os.Getpid(), syscall.SIGTERM)
}

// takeTunnels is step 2 of a new process; from is the process whose
// listeners it took.
func (h *Handoff) takeTunnels(from *handoff.Hello) {
	// Until the process state moved, a failure leaves everything with the
	// running process; this one shares its listening sockets and would
	// serve beside it, with a report stream of its own: it exits.
	failed := func(msg string, err error) {
		handoffs.WithLabelValues("new", "failed").Inc()
		h.logger.Error(msg+"; the upgrade failed: exiting, the running process serves on", zap.Error(err))
		os.Exit(1)
	}
	// A running process that died before its state moved took its
	// tunnels and state with it: this one serves as after a restart.
	alone := func(msg string, err error) {
		handoffs.WithLabelValues("new", "peer_died").Inc()
		h.logger.Error(msg+": this process serves as after a restart (a report stream of its own, empty replay caches); the tunnels of the process that died ended with it",
			zap.Int("pid", from.PID), zap.Error(err))
		listensock.ResumeAccepting()
	}
	r, err := handoff.Dial(h.Socket, h.config(wantTunnels))
	if noProcessAt(err) && syscall.Kill(from.PID, 0) == syscall.ESRCH {
		alone("the running process is gone", err)
		return
	}
	if err != nil {
		failed("cannot ask the running process for its tunnels", err)
	}
	defer r.Close()
	peer := r.Peer()
	start := time.Now()
	it, err := r.Next()
	if err != nil {
		if r.PeerDied() {
			alone(fmt.Sprintf("the running process (pid %d) died before it handed its state over", peer.PID), err)
			return
		}
		failed(fmt.Sprintf("the running process (pid %d) sent no state", peer.PID), err)
	}
	if err := adoptProcess(it); err != nil {
		it.Refuse(err.Error())
		failed(fmt.Sprintf("refused the state of the running process (pid %d)", peer.PID), err)
	}
	if err := it.Adopt(); err != nil {
		// This process holds a copy of a report stream the old one goes
		// on with: it must not report, so it must not run.
		failed(fmt.Sprintf("the running process (pid %d) kept its state after this one took it", peer.PID), err)
	}
	// The stream reports once the handoff has ended: until then the
	// running process takes it back if this one dies.
	defer tunnels.ResumeReports()
	handoffs.WithLabelValues("new", "done").Inc()
	listensock.ResumeAccepting()
	// As in the running process (sendTunnels), no collection while the
	// tunnels arrive.
	defer handoff.HoldCollection(handoff.CollectionHeadroom)()
	moved, refused, standbys := 0, 0, 0
	others := map[string]int{}
	for _, p := range upgrade.Participants() {
		others[p.Name] = 0
	}
	for {
		it, err := r.Next()
		if errors.Is(err, handoff.ErrDone) {
			break
		}
		if err != nil {
			if r.PeerDied() {
				h.logger.Error("the running process died during the handoff: the tunnels it had not sent ended with it; this process serves on", zap.Int("pid", peer.PID), zap.Error(err))
			} else {
				h.logger.Error("the handoff ended early: the running process keeps the tunnels it did not send", zap.Int("pid", peer.PID), zap.Error(err))
			}
			break
		}
		// Each object is adopted without waiting for its verdict, which
		// a later Next acts on (AdoptThen): the running process has
		// several in flight at once. By the end of the loop every one has
		// had its verdict.
		kept := func() { refused++ }
		switch p, ok := upgrade.ForKind(it.Kind); {
		case it.Kind == handoff.KindStandby:
			adoptStandby(it, func() { standbys++ }, kept)
		case ok:
			adoptOther(h.logger, p, it, func() { others[p.Name]++ }, kept)
		case it.Kind != handoff.KindTunnel:
			it.Refuse(fmt.Sprintf("object kind %d offered where tunnels were asked for", it.Kind))
			refused++
		default:
			hd, a, err := adoptTunnel(it)
			it.Close() // the adopted tunnel holds duplicates
			if err != nil {
				it.Refuse(err.Error())
				refused++
				h.logger.Warn("refused a tunnel of the running process; it stays there", zap.Error(err))
				continue
			}
			run := func() {
				moved++
				go func() {
					res, err := a.Run()
					hd.tunnelEnded(res, err)
				}()
			}
			adoptThen(it, run, a.Discard, kept)
		}
	}
	fields := []zap.Field{zap.Int("pid", peer.PID), zap.String("build", peer.Build),
		zap.Int("tunnels", moved), zap.Int("standby", standbys), zap.Int("refused", refused), zap.Duration("duration", time.Since(start))}
	adopted := moved
	for _, name := range slices.Sorted(maps.Keys(others)) {
		adopted += others[name]
		fields = append(fields, zap.Int(name+"_tunnels", others[name]))
	}
	handoffTunnels.WithLabelValues("adopted").Add(float64(adopted))
	handoffTunnels.WithLabelValues("refused").Add(float64(refused))
	h.logger.Info("took the running process's tunnels over", fields...)
}

// adoptThen adopts it, built as an object that start runs and discard
// drops: start once the running process released it; discard, then kept,
// once it kept it or never heard of the adoption.
func adoptThen(it *handoff.Item, start, discard func(), kept func()) {
	drop := func() { discard(); kept() }
	if err := it.AdoptThen(start, drop); err != nil {
		drop()
	}
}

// adoptOther takes an object of a registered participant over and runs it
// once released (moved counts it); a refusal, or the object kept, calls
// kept.
func adoptOther(logger *zap.Logger, p upgrade.Participant, it *handoff.Item, moved, kept func()) {
	defer it.Close() // the adopted object holds duplicates
	run, discard, err := p.Adopt(it.State, it.Files)
	if err != nil {
		it.Refuse(err.Error())
		logger.Warn("refused a "+p.Name+" tunnel of the running process; it stays there", zap.Error(err))
		kept()
		return
	}
	adoptThen(it, func() { moved(); go run() }, discard, kept)
}

// adoptStandby takes a gateway's standby connection over and serves it
// once released (moved counts it), in the sandbox handler configured as
// the one it waited in (moveNameOf), else in the configuration's only one.
// A standby connection names no key that would choose a handler: where
// neither exists, it stays in the old process, until its preamble, its
// standby_timeout or that process's drain. A refusal, or the connection
// kept, calls kept.
func adoptStandby(it *handoff.Item, moved, kept func()) {
	defer it.Close() // the adopted connection holds a duplicate
	refuse := func(reason string) {
		it.Refuse(reason)
		kept()
	}
	var ms forward.MovedStandby
	if err := json.Unmarshal(it.State, &ms); err != nil {
		refuse(fmt.Sprintf("moved standby connection: %v", err))
		return
	}
	clear(ms.Conn) // the session's secrets: AdoptStandby decodes its own copy
	hd := keyrings.named(ms.Forwarder)
	if hd == nil {
		var n int
		if hd, n = keyrings.only(); hd == nil {
			refuse(fmt.Sprintf("%d sandbox handlers in this configuration, none configured as the one the standby connection waited in: before its preamble, it names no key to choose one by", n))
			return
		}
	}
	a, err := hd.fwd.AdoptStandby(it.State, it.Files)
	if err != nil {
		hd.logger.Warn("refused a standby connection of the running process; it stays there", zap.Error(err))
		refuse(err.Error())
		return
	}
	adoptThen(it, func() { moved(); go hd.serveAdopted(a) }, a.Discard, kept)
}

// adoptProcess takes the old process's state: its replay caches' nonces
// into every cache this configuration uses, then its report stream.
func adoptProcess(it *handoff.Item) error {
	if it.Kind != handoff.KindProcess {
		return fmt.Errorf("object kind %d offered where the process state was expected", it.Kind)
	}
	var ps processState
	if err := json.Unmarshal(it.State, &ps); err != nil {
		return fmt.Errorf("process state: %w", err)
	}
	if ps.Version != processStateVersion {
		return fmt.Errorf("process state version %d, this build takes %d", ps.Version, processStateVersion)
	}
	now := time.Now()
	for _, rs := range ps.Replay {
		var st preamble.ReplayState
		if err := st.UnmarshalBinary(rs.Nonces); err != nil {
			return fmt.Errorf("replay cache (%d nonces, window %v): %w", rs.Size, rs.Window, err)
		}
		var rerr error
		replayCaches.Range(func(_, v any) bool {
			rerr = v.(replayCacheEntry).Restore(st, now)
			return rerr == nil
		})
		if rerr != nil {
			return fmt.Errorf("replay cache (%d nonces, window %v): %w", rs.Size, rs.Window, rerr)
		}
	}
	if err := tunnels.AdoptReports(ps.Reports); err != nil {
		return fmt.Errorf("%w (a listener of this configuration that is no tcp-handoff/ address accepts tunnels before the state is here: listen on tcp-handoff/ addresses only)", err)
	}
	return nil
}

// adoptTunnel builds a moved tunnel in the sandbox handler that trusts the
// key that signed its preamble.
func adoptTunnel(it *handoff.Item) (*Handler, *forward.AdoptedTunnel, error) {
	var mt forward.MovedTunnel
	if err := json.Unmarshal(it.State, &mt); err != nil {
		return nil, nil, fmt.Errorf("moved tunnel: %w", err)
	}
	hd := keyrings.handlerTrusting(mt.Tunnel.KeyID, mt.Tunnel.Key)
	if hd == nil {
		return nil, nil, fmt.Errorf("moved tunnel %d: no sandbox handler of this configuration trusts its key %q", mt.Tunnel.ID, mt.Tunnel.KeyID)
	}
	a, err := hd.fwd.Adopt(it.State, it.Files)
	if err != nil {
		return nil, nil, err
	}
	return hd, a, nil
}

// notifyMainPID tells systemd, when it supervises this process
// (NOTIFY_SOCKET), that pid is the service's main process now.
func notifyMainPID(logger *zap.Logger, pid int) {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return
	}
	if strings.HasPrefix(path, "@") {
		path = "\x00" + path[1:]
	}
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err == nil {
		_, err = fmt.Fprintf(c, "MAINPID=%d", pid)
		c.Close()
	}
	if err != nil {
		logger.Warn("cannot tell systemd that the new process is the service's main process (NOTIFY_SOCKET): its exit will stop the service", zap.Int("pid", pid), zap.Error(err))
	}
}

// Interface guards.
var (
	_ caddy.App          = (*Handoff)(nil)
	_ caddy.Provisioner  = (*Handoff)(nil)
	_ caddy.CleanerUpper = (*Handoff)(nil)
)

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
