package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

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
		return benchjson.ClassCorrupt, "wrong bytes"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
		return benchjson.ClassTimeout, "generator deadline"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return benchjson.ClassReset, "reset in " + phase
	case errors.Is(err, syscall.ECONNREFUSED):
		return benchjson.ClassRefused, "connection refused"
	case errors.As(err, &op) && op.Op == "remote error":
		// A TLS alert from the peer: access_denied is the forwarder's
		// overload refusal, before the handshake (max_handshakes) or on
		// the first read after the preamble (max_pending_dials).
		alert := op.Err.Error()
		if alert == "tls: access denied" && (phase == phaseConnect || phase == phasePreamble || phase == phaseFirstRead) {
			return benchjson.ClassRefused, "overloaded"
		}
		if phase == phaseConnect {
			return benchjson.ClassRefused, alert
		}
		return benchjson.ClassOther, "alert in " + phase + ": " + alert
	case errors.As(err, &st):
		switch st.code {
		case 502:
			return benchjson.ClassTarget, "HTTP 502"
		case 503:
			return benchjson.ClassRefused, "HTTP 503"
		case 504:
			return benchjson.ClassOther, "HTTP 504 (proxy timeout)"
		}
		return benchjson.ClassOther, st.Error()
	case phase == phaseConnect && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)):
		return benchjson.ClassRefused, "closed before the handshake"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return benchjson.ClassOther, "closed in " + phase
	}
	msg := err.Error()
	if len(msg) > 120 {
		msg = msg[:120]
	}
	return benchjson.ClassOther, msg
}
