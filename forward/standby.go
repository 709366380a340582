package forward

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/ktlsingress/caddy-ktls/preamble"
)

// A standby connection is a gateway's connection whose mutual TLS is done
// and whose preamble the gateway has not written yet: it keeps a few ready
// per forwarder (gateway.Config.Standby), so that a new tunnel pays only
// its preamble and the target's dial. While it waits for its first
// preamble byte it is bounded by Config.StandbyTimeout instead of
// PreambleTimeout, for at most Config.MaxStandbyPerClient connections of
// one client certificate at once; the rest of the frame, as any frame,
// within PreambleTimeout of that byte. A binary upgrade moves the waiting
// ones to the other process (Registry.MoveStandby, movestandby.go), where
// the wait goes on until StandbyTimeout after it began here.

// How a standby connection ended without a preamble, as StandbyEndError
// and Registry.Standby name it. (One whose preamble came is a tunnel like
// any other: the forwarder cannot tell a standby connection from a fresh
// one whose preamble is on its way.)
const (
	// StandbyClosed: the gateway closed it before a preamble byte (or,
	// unreachable, a move that failed could not take it back).
	StandbyClosed = "closed"
	// StandbyExpired: StandbyTimeout passed without a preamble byte.
	StandbyExpired = "expired"
	// StandbyMoved: it went on waiting in another process
	// (Registry.MoveStandby).
	StandbyMoved = "moved"
)

// StandbyEnds lists the ends, for metrics to pre-register.
func StandbyEnds() []string { return []string{StandbyClosed, StandbyExpired, StandbyMoved} }

// StandbyEndError is what Serve returns for a standby connection that
// ended before its first preamble byte: no tunnel was asked for, so it is
// no refusal (the Registry counts it under Standby, not RefusedTunnels).
type StandbyEndError struct {
	End string // StandbyClosed, StandbyExpired or StandbyMoved
	Err error
}

func (e *StandbyEndError) Error() string {
	return "standby connection " + e.End + " before a preamble: " + e.Err.Error()
}

func (e *StandbyEndError) Unwrap() error { return e.Err }

// errStandbyMoved is the cause of a StandbyMoved end.
var errStandbyMoved = errors.New("it went on waiting in another process")

// readFrame reads c's preamble frame: under PreambleTimeout, or, for one
// of its client's first MaxStandbyPerClient standby connections, its
// first byte under StandbyTimeout (counted from c.StandbyBegan, which it
// sets when zero) and the rest under PreambleTimeout. A move of the
// standby connection that failed may have replaced c.Conn (and cleared
// c.Unwrap): the caller goes on with c.
func (f *Forwarder) readFrame(c *Gateway) ([]byte, error) {
	max := f.cfg.Verifier.MaxFrameLen()
	if f.cfg.StandbyTimeout > 0 && c.CertificateVerified {
		w := &standbyWait{f: f, c: c, report: make(chan bool, 1), verdict: make(chan standbyVerdict)}
		if leave, ok := f.cfg.Registry.enterStandby(c.Certificate, f.cfg.MaxStandbyPerClient, w); ok {
			if c.StandbyBegan.IsZero() {
				c.StandbyBegan = time.Now()
			}
			first, err := w.firstByte(c.StandbyBegan.Add(f.cfg.StandbyTimeout))
			end := ""
			if err != nil {
				se, ok := errors.AsType[*StandbyEndError](err)
				if !ok {
					se = &StandbyEndError{End: StandbyClosed, Err: err}
					if isTimeout(err) {
						se.End = StandbyExpired
					}
				}
				end, err = se.End, se
			}
			leave(end)
			if err != nil {
				return nil, err
			}
			if err := setDeadline(c.Conn, f.cfg.PreambleTimeout); err != nil {
				return nil, err
			}
			return preamble.ReadFrame(io.MultiReader(bytes.NewReader(first), c.Conn), max)
		}
	}
	if err := setDeadline(c.Conn, f.cfg.PreambleTimeout); err != nil {
		return nil, err
	}
	return preamble.ReadFrame(c.Conn, max)
}

// standbyWait is a standby connection waiting for its first preamble
// byte (firstByte), registered in the Registry while it waits so that
// MoveStandby can interrupt the wait and move the connection.
//
// The rules, all under mu: the waiter sets its deadline before it says
// waitReading, so an interruption (waitInterrupted, a deadline in the
// past) always comes after and its Read returns; after its Read returns,
// the waiter decides under mu what the read was, and holds mu until its
// next deadline is set: a byte read makes it a tunnel's (never given up),
// an end of the connection ends it, the end of its standby time expires
// it, and only an interrupted read that found nothing parks it. Each
// interruption gets exactly one report: parked (true) or no standby
// connection any more (false).
type standbyWait struct {
	f *Forwarder
	// c is Serve's Gateway. MoveStandby reads it only while the wait is
	// parked, or its Conn under mu; the waiter replaces Conn under mu.
	c *Gateway

	mu     sync.Mutex
	state  waitState
	report chan bool // buffered: the waiter never blocks on it
	// verdict is what became of a parked wait's connection.
	verdict chan standbyVerdict
}

type waitState int

const (
	waitStarting    waitState = iota // registered, its first deadline not set yet
	waitReading                      // in Read, or about to be, under its standby deadline
	waitInterrupted                  // MoveStandby set a deadline in the past and waits for the report
	waitAbandoned                    // MoveStandby gave up waiting (its ctx ended): no report, the wait resumes
	waitParked                       // MoveStandby has the connection; the waiter waits for the verdict
	waitDone                         // a byte came, or the wait ended
)

// standbyVerdict is what MoveStandby tells a parked wait.
type standbyVerdict struct {
	moved bool
	conn  net.Conn // the connection adopted back after a move that failed; nil: the same one
	err   error    // the connection was lost: it could not be adopted back
}

// firstByte reads the first preamble byte of w's connection by end; see
// standbyWait for the rules. A move that failed resumes the wait, on the
// connection adopted back, until the same end, as if nothing happened; a
// move that succeeded ends it with a StandbyEndError (StandbyMoved).
func (w *standbyWait) firstByte(end time.Time) ([]byte, error) {
	var b [1]byte
	w.mu.Lock()
	for {
		if w.state == waitInterrupted {
			// Interrupted before its first read: nothing was read.
			if err := w.park(); err != nil {
				return nil, err
			}
			continue
		}
		if err := w.c.Conn.SetReadDeadline(end); err != nil {
			w.state = waitDone
			w.mu.Unlock()
			return nil, &preamble.Error{Reason: preamble.ReasonReadFailed, Detail: "set standby deadline", Err: err}
		}
		w.state = waitReading
		w.mu.Unlock()
		n, err := w.c.Conn.Read(b[:])
		w.mu.Lock()
		interrupted := w.state == waitInterrupted
		switch {
		case n > 0:
			err = nil
		case err != nil && !isTimeout(err):
			// The connection ended (or failed).
		case !time.Now().Before(end):
			if err == nil {
				err = os.ErrDeadlineExceeded
			}
		case interrupted:
			if err := w.park(); err != nil {
				return nil, err
			}
			continue
		default:
			// Nothing yet: a control record handled (ktls: (0, nil)),
			// or the deadline of an interruption given up.
			continue
		}
		w.state = waitDone
		if interrupted {
			w.report <- false
		}
		w.mu.Unlock()
		if n > 0 {
			return b[:], nil
		}
		return nil, err
	}
}

// park hands the connection to the interrupting MoveStandby and waits for
// its verdict; it is called and, unless the wait ended (err), returns with
// mu held.
func (w *standbyWait) park() error {
	w.state = waitParked
	w.report <- true
	w.mu.Unlock()
	v := <-w.verdict
	switch {
	case v.moved:
		return &StandbyEndError{End: StandbyMoved, Err: errStandbyMoved}
	case v.err != nil:
		return &StandbyEndError{End: StandbyClosed, Err: v.err}
	}
	w.mu.Lock()
	if v.conn != nil {
		w.c.Conn, w.c.Unwrap = v.conn, nil
	}
	return nil
}

func isTimeout(err error) bool {
	ne, ok := errors.AsType[net.Error](err)
	return ok && ne.Timeout()
}

func setDeadline(c net.Conn, d time.Duration) error {
	if err := c.SetReadDeadline(time.Now().Add(d)); err != nil {
		return &preamble.Error{Reason: preamble.ReasonReadFailed, Detail: "set preamble deadline", Err: err}
	}
	return nil
}
