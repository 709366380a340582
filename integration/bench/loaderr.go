package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
)

// The classes of a failed load call, each named for who caused it.
const (
	// classRefused: the proxy refused the call: a TLS alert before or
	// during the handshake (access_denied there is the forwarder shedding
	// an overloaded connection), access_denied on the first read after the
	// preamble (the forwarder's bound on pending dials), the peer closing
	// before the handshake completed, a refused TCP connection, or an
	// HTTP 503 (reverse_proxy's own refusal).
	classRefused = "refused"
	// classTarget: the upstream's own failure, as the proxy reports it
	// (HTTP 502).
	classTarget = "target"
	// classTimeout: the generator's own per-call deadline passed (a
	// proxy-side timeout shows as a close or an alert instead).
	classTimeout = "timeout"
	// classReset: a TCP reset (ECONNRESET, EPIPE).
	classReset = "reset"
	// classCorrupt: a response byte that differs from the payload: the
	// call failed, whatever else happened.
	classCorrupt = "corrupt"
	// classOther: anything else, the error's text as its cause.
	classOther = "other"
)

// loadClasses are the classes in the order the reports list them.
var loadClasses = []string{classRefused, classTarget, classTimeout, classReset, classCorrupt, classOther}

// Phases of a load call, in order: where an error happened decides
// what it means.
const (
	phaseConnect   = "connect"    // TCP connect and TLS handshake
	phasePreamble  = "preamble"   // the signed preamble and the header
	phaseFirstRead = "first-read" // the first response of a new tunnel
	phaseCall      = "call"       // a call on an established tunnel
	phaseClose     = "close"      // the tunnel's end after its calls
)

// callError is a load call's failure and the phase it happened in.
type callError struct {
	phase string
	err   error
}

func (e *callError) Error() string { return e.phase + ": " + e.err.Error() }
func (e *callError) Unwrap() error { return e.err }

// errWrongBytes marks a response that differs from the payload.
var errWrongBytes = errors.New("response bytes differ from the payload")

// httpStatusError is a non-200 answer of the HTTP contender.
type httpStatusError struct{ code int }

func (e httpStatusError) Error() string { return fmt.Sprintf("HTTP status %d", e.code) }

// classify names a failed call's class and cause (the cause says what
// exactly: "overloaded", "closed before the handshake", an alert's text).
func classify(err error) (class, cause string) {
	phase := ""
	var ce *callError
	if errors.As(err, &ce) {
		phase = ce.phase
	}
	var op *net.OpError
	var st httpStatusError
	switch {
	case errors.Is(err, errWrongBytes):
		return classCorrupt, "wrong bytes"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return classTimeout, "generator deadline"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return classReset, "reset in " + phase
	case errors.Is(err, syscall.ECONNREFUSED):
		return classRefused, "connection refused"
	case errors.As(err, &op) && op.Op == "remote error":
		// A TLS alert from the peer: access_denied is the forwarder's
		// overload refusal, before the handshake (max_handshakes) or on
		// the first read after the preamble (max_pending_dials).
		alert := op.Err.Error()
		if alert == "tls: access denied" && (phase == phaseConnect || phase == phasePreamble || phase == phaseFirstRead) {
			return classRefused, "overloaded"
		}
		if phase == phaseConnect {
			return classRefused, alert
		}
		return classOther, "alert in " + phase + ": " + alert
	case errors.As(err, &st):
		switch st.code {
		case 502:
			return classTarget, "HTTP 502"
		case 503:
			return classRefused, "HTTP 503"
		case 504:
			return classOther, "HTTP 504 (proxy timeout)"
		}
		return classOther, st.Error()
	case phase == phaseConnect && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)):
		return classRefused, "closed before the handshake"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return classOther, "closed in " + phase
	}
	msg := err.Error()
	if len(msg) > 120 {
		msg = msg[:120]
	}
	return classOther, msg
}
