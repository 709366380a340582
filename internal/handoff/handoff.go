// Package handoff moves live objects (a tunnel's sockets and state, a
// listening socket, a process's tables) from a running process to the one
// that replaces it, so that each is in exactly one process whatever fails:
// either process dying, the socket breaking, or the new process refusing
// an object.
//
// The old process accepts one connection on a Unix socket (Listen,
// Accept: a Sender); the new one dials it (Dial: a Receiver). Both say
// hello first (protocol version, build), and each may refuse the other.
// Then, per object:
//
//	sender                           receiver
//	ITEM (state, descriptors)  --->  builds the object, does not start it
//	                           <---  ADOPTED (or REFUSED: the sender keeps it)
//	RELEASED                   --->  starts it
//	...
//	DONE                       --->  owns what it started
//	                           <---  DONE
//
// The sender stops using its copy only once RELEASED was sent; the
// receiver starts its copy only once RELEASED arrived. A sender that waited
// Timeout for the answer, or failed to send RELEASED, keeps the object: it
// sends KEEP (when it still can) and ends the session, and a receiver that
// adopted the object meanwhile reads KEEP and closes its copy. A receiver
// that adopted an object and sees the session end with neither RELEASED
// nor KEEP learns from the sender's pidfd whether the sender died: then it
// starts the object (no other copy is in use); else it closes its copy
// (fail closed: never two copies in use). The receiver dying after ADOPTED
// is a process with objects that dies: the object ends with it, as any
// object of a process that dies.
//
// Several objects are in flight at once, up to the session's window (the
// smaller of both hellos' Window; a receiver that says none takes one at a
// time): the sender offers the next before the last is answered, the
// receiver adopts without waiting for the verdict (Item.AdoptThen) and
// acts on each as it reads it, so that both processes work at once. The
// rules above hold per object; a KEEP or the session's end decides every
// object in flight that has not been released.
//
// The session ends with DONE both ways (Sender.Finish): a receiver that
// read DONE has every object; a sender whose DONE is not answered learns
// from the receiver's pidfd whether it died (PeerDied), so that it can
// take back what the session moved besides its objects' descriptors (the
// caller's state: a receiver acts on it only once the session ended).
//
// The package moves bytes and descriptors (package fdpass); what an object
// is, is the caller's.
package handoff

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/fdpass"
)

// Protocol is the handoff protocol version this package speaks.
const Protocol = 1

// Message kinds (fdpass kinds).
const (
	kindHello    uint16 = 1
	kindItem     uint16 = 2 // u16 object kind, u64 id, state (its tail, after MORE)
	kindMore     uint16 = 3 // a part of the next ITEM's state
	kindAdopted  uint16 = 4 // u64 id
	kindRefused  uint16 = 5 // u64 id, reason
	kindReleased uint16 = 6 // u64 id
	kindKeep     uint16 = 7 // u64 id, reason
	kindDone     uint16 = 8 // the sender has no more objects
	kindAccepted uint16 = 9 // the peer's hello is accepted
)

// chunk is the most state one message carries: a SOCK_SEQPACKET message
// must fit the socket's send buffer (net.core.wmem_default, 208 KiB on
// most systems), so larger states go in parts.
const chunk = 32 << 10

// MaxState bounds one object's state as a Receiver reads it.
const MaxState = 64 << 20

// Hello is what each side says of itself first.
type Hello struct {
	Protocol int    `json:"protocol"`
	Build    string `json:"build"` // the binary's version, for Compatible and the logs
	PID      int    `json:"pid"`
	// Want is what a receiver asks for (the caller's vocabulary); a
	// sender's is empty.
	Want string `json:"want,omitempty"`
	// Window is how many objects a receiver takes in flight at once (a
	// sender's is its own Config.Window, for the logs). A receiver that
	// says none takes one at a time.
	Window int `json:"window,omitempty"`
}

// Config configures either side.
type Config struct {
	// Build names this binary (its module version); the peer's
	// Compatible sees it.
	Build string
	// Compatible, when set, refuses a peer whose Hello it returns an
	// error for; the peer is told why.
	Compatible func(peer Hello) error
	// Timeout bounds each wait for the peer: its hello, and a sender's
	// wait for an object's answer. Zero means DefaultTimeout.
	Timeout time.Duration
	// Want is what a receiver asks the sender for (Hello.Want); a
	// Sender ignores it.
	Want string
	// Window bounds the objects in flight at once: offered and not yet
	// released. A session's is the smaller of both sides'. Zero means
	// DefaultWindow; 1 moves one object at a time.
	Window int
}

// DefaultTimeout is Config.Timeout's default.
const DefaultTimeout = 5 * time.Second

// DefaultWindow is Config.Window's default. With 8 in flight both
// processes work at once: idle tunnels move ×2.1–2.6 faster than one at a
// time, each paused some 3–4 ms at p99; past 8 the CPU is the bound and
// only the pause grows (docs/bench/upgrade.md).
const DefaultWindow = 8

func (c Config) timeout() time.Duration {
	if c.Timeout > 0 {
		return c.Timeout
	}
	return DefaultTimeout
}

func (c Config) window() int {
	if c.Window > 0 {
		return c.Window
	}
	return DefaultWindow
}

// Errors.
var (
	// ErrKept: the sender keeps the object (KEEP, or it ended the session
	// while alive): the receiver's copy must be closed, never started.
	ErrKept = errors.New("handoff: the sending process keeps the object")
	// ErrBroken: an earlier failure ended the session.
	ErrBroken = errors.New("handoff: the session has ended")
)

// RefusedError is an object, or a hello, the peer refused.
type RefusedError struct{ Reason string }

func (e *RefusedError) Error() string { return "handoff: refused by the peer: " + e.Reason }

// establish opens a session on c, either side's connection: it checks the
// socket's type once (fdpass.Conn) and the peer's user (checkPeer), then
// says hello. On an error c is closed.
func establish(c *net.UnixConn, cfg Config) (fc *fdpass.Conn, pidfd int, peer Hello, err error) {
	if fc, err = fdpass.NewConn(c); err != nil {
		c.Close()
		return nil, -1, Hello{}, fmt.Errorf("handoff: %w", err)
	}
	if pidfd, err = checkPeer(c); err != nil {
		c.Close()
		return nil, -1, Hello{}, err
	}
	if peer, err = hello(c, fc, cfg); err != nil {
		c.Close()
		unix.Close(pidfd)
		return nil, -1, Hello{}, err
	}
	return fc, pidfd, peer, nil
}

// hello sends ours and reads the peer's, then each side's verdict on the
// other: both know the session is on before either uses it. fc is c.
func hello(c *net.UnixConn, fc *fdpass.Conn, cfg Config) (Hello, error) {
	mine, _ := json.Marshal(Hello{Protocol: Protocol, Build: cfg.Build, PID: os.Getpid(), Want: cfg.Want, Window: cfg.window()})
	if err := fc.Send(kindHello, mine); err != nil {
		return Hello{}, err
	}
	c.SetReadDeadline(time.Now().Add(cfg.timeout()))
	defer c.SetReadDeadline(time.Time{})
	m, err := receiveBare(fc)
	if err != nil {
		return Hello{}, fmt.Errorf("handoff: the peer's hello: %w", err)
	}
	var peer Hello
	if m.Kind != kindHello || json.Unmarshal(m.Payload, &peer) != nil {
		return Hello{}, fmt.Errorf("handoff: the peer's first message is no hello (kind %d)", m.Kind)
	}
	var why error
	if peer.Protocol != Protocol {
		why = fmt.Errorf("handoff protocol %d, this process speaks %d (builds %q and %q)", peer.Protocol, Protocol, peer.Build, cfg.Build)
	} else if cfg.Compatible != nil {
		why = cfg.Compatible(peer)
	}
	if why != nil {
		fc.Send(kindRefused, idPayload(0, why.Error()))
		// The peer's verdict is read before the caller closes: a socket
		// closed with a message unread resets its peer, whose read would
		// then fail before it reaches the refusal.
		receiveBare(fc)
		return peer, fmt.Errorf("handoff: refused the peer (pid %d, build %q): %w", peer.PID, peer.Build, why)
	}
	// A peer that refused this one has sent why and closed: the send
	// fails, and the refusal waits to be read.
	serr := fc.Send(kindAccepted, nil)
	if m, err = receiveBare(fc); err != nil {
		return peer, fmt.Errorf("handoff: the peer's verdict: %w", errors.Join(err, serr))
	}
	switch m.Kind {
	case kindAccepted:
		return peer, nil
	case kindRefused:
		_, reason, _ := payloadID(m.Payload)
		return peer, &RefusedError{Reason: reason}
	}
	return peer, fmt.Errorf("handoff: the peer's verdict is a message of kind %d", m.Kind)
}

// receiveBare receives a message that carries no descriptors (any that
// came are closed).
func receiveBare(fc *fdpass.Conn) (*fdpass.Message, error) {
	m, err := fc.Receive(fdpass.Limits{})
	if err == nil {
		m.Close()
	}
	return m, err
}

func idPayload(id uint64, tail string) []byte {
	return append(binary.BigEndian.AppendUint64(nil, id), tail...)
}

func payloadID(p []byte) (uint64, string, bool) {
	if len(p) < 8 {
		return 0, "", false
	}
	return binary.BigEndian.Uint64(p), string(p[8:]), true
}

// Listen makes the Unix socket a Sender accepts on at path, reachable by
// this process's user only (mode 0600; an old file at path is replaced).
func Listen(path string) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("handoff: %w", err)
	}
	old := unix.Umask(0o177)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	unix.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("handoff: %w", err)
	}
	return ln, nil
}

// checkPeer refuses a peer of another user (root excepted), and returns a
// pidfd of the peer's process: from the connection on, so a recycled PID
// is never mistaken for it.
func checkPeer(c *net.UnixConn) (pidfd int, err error) {
	cred, err := fdpass.PeerCredentials(c)
	if err != nil {
		return -1, err
	}
	if me := os.Getuid(); int(cred.Uid) != me && cred.Uid != 0 {
		return -1, fmt.Errorf("handoff: the peer (pid %d) runs as uid %d, this process as %d", cred.Pid, cred.Uid, me)
	}
	pidfd, err = unix.PidfdOpen(int(cred.Pid), 0)
	if err != nil {
		return -1, fmt.Errorf("handoff: pidfd of the peer (pid %d): %w", cred.Pid, err)
	}
	return pidfd, nil
}

// peerDied reports whether the process of pidfd has exited, waiting up to
// timeout for it: a process's sockets close while it exits, a moment
// before its pidfd says so.
func peerDied(pidfd int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		wait := time.Until(deadline)
		n, err := unix.Poll(fds, int(max(wait, 0)/time.Millisecond))
		if err == unix.EINTR {
			continue
		}
		return err == nil && n == 1
	}
}
