package forward

import (
	"bytes"
	"errors"
	"io"
	"net"
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
// within PreambleTimeout of that byte.

// How a standby connection ended without a preamble, as StandbyEndError
// and Registry.Standby name it. (One whose preamble came is a tunnel like
// any other: the forwarder cannot tell a standby connection from a fresh
// one whose preamble is on its way.)
const (
	// StandbyClosed: the gateway closed it before a preamble byte.
	StandbyClosed = "closed"
	// StandbyExpired: StandbyTimeout passed without a preamble byte.
	StandbyExpired = "expired"
)

// StandbyEnds lists the ends, for metrics to pre-register.
func StandbyEnds() []string { return []string{StandbyClosed, StandbyExpired} }

// StandbyEndError is what Serve returns for a standby connection that
// ended before its first preamble byte: no tunnel was asked for, so it is
// no refusal (the Registry counts it under Standby, not RefusedTunnels).
type StandbyEndError struct {
	End string // StandbyClosed or StandbyExpired
	Err error
}

func (e *StandbyEndError) Error() string {
	return "standby connection " + e.End + " before a preamble: " + e.Err.Error()
}

func (e *StandbyEndError) Unwrap() error { return e.Err }

// readFrame reads c's preamble frame: under PreambleTimeout, or, for one
// of its client's first MaxStandbyPerClient standby connections, its
// first byte under StandbyTimeout and the rest under PreambleTimeout.
func (f *Forwarder) readFrame(c Gateway) ([]byte, error) {
	max := f.cfg.Verifier.MaxFrameLen()
	if f.cfg.StandbyTimeout > 0 && c.CertificateVerified {
		if leave, ok := f.cfg.Registry.enterStandby(c.Certificate, f.cfg.MaxStandbyPerClient); ok {
			first, err := readFirstByte(c.Conn, f.cfg.StandbyTimeout)
			end := ""
			if err != nil {
				end = StandbyClosed
				if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
					end = StandbyExpired
				}
				err = &StandbyEndError{End: end, Err: err}
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

// readFirstByte reads one byte of c within d.
func readFirstByte(c net.Conn, d time.Duration) ([]byte, error) {
	if err := setDeadline(c, d); err != nil {
		return nil, err
	}
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return nil, err
	}
	return b[:], nil
}

func setDeadline(c net.Conn, d time.Duration) error {
	if err := c.SetReadDeadline(time.Now().Add(d)); err != nil {
		return &preamble.Error{Reason: preamble.ReasonReadFailed, Detail: "set preamble deadline", Err: err}
	}
	return nil
}
