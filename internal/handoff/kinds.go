package handoff

import "syscall"

// The kinds of object a session carries: one table for every side that
// offers or adopts them, so that one session carries them all and the
// receiver dispatches on the kind alone.
const (
	KindTunnel        uint16 = 1 // a forwarder's sandbox tunnel (forward.MovedTunnel)
	KindListener      uint16 = 2 // a listening socket (modules/forwarder)
	KindProcess       uint16 = 3 // a forwarder's process state (modules/forwarder)
	KindStandby       uint16 = 4 // a gateway's standby connection waiting at a forwarder (forward.MovedStandby)
	KindGatewayTunnel uint16 = 5 // an edge gateway's tunnel (gateway.MovedTunnel)
)

// Mover moves one object to another process: kind and state are the
// object's, files its descriptors (the caller's still: an *os.File, a
// *net.TCPConn, anything fdpass.Send takes). moved reports
// whether the other process took it; when it did not, err says why. The
// mechanisms that move objects (forward, gateway) take a Mover; a Sender
// is one through SenderMover.
type Mover interface {
	Move(kind uint16, state []byte, files ...syscall.Conn) (moved bool, err error)
	// Window is how many Move calls may run at once, at least 1.
	Window() int
}

// SenderMover is s as a Mover: moved once the receiver adopted the object
// and was told so (Sender.Move's Moved); its window is the session's.
func SenderMover(s *Sender) Mover { return senderMover{s} }

type senderMover struct{ s *Sender }

func (m senderMover) Move(kind uint16, state []byte, files ...syscall.Conn) (bool, error) {
	fate, err := m.s.Move(kind, state, files...)
	return fate == Moved, err
}

func (m senderMover) Window() int { return m.s.Window() }

// Why an object stays in the process that offered it (Stay.Why).
const (
	StayNotMovable = "not-movable" // nothing here can hand it off: its state, or its holder's configuration
	StayPause      = "pause"       // its relay would not pause (splice.PauseReason in the error: the copy path, opening or ending), or its wait was not interrupted in time
	StayConn       = "conn"        // a connection could not give up its session (ktls.HandoffReason in the error: userspace TLS, say)
	StayRefused    = "refused"     // the other process refused it, or the session failed
)
