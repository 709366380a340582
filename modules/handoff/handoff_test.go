package handoff

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
)

// A process is refused when it moves state in other encodings, whatever
// its version; one that agrees on them is taken, whatever its version.
func TestHandoffCompatible(t *testing.T) {
	for _, tc := range []struct {
		build string
		ok    bool
	}{
		{"caddy-ktls/v1.2.3; states: " + stateVersions(), true},
		{"caddy-ktls/(devel); states: " + stateVersions(), true},
		{"caddy-ktls/v1.2.3; states: tunnel 2, report 1, process 1, ktls 1", false},
		{"caddy-ktls/v1.2.3", false},
		{"", false},
	} {
		err := compatible(handoff.Hello{Protocol: handoff.Protocol, Build: tc.build, PID: 42})
		if (err == nil) != tc.ok {
			t.Errorf("build %q: %v, want accepted %v", tc.build, err, tc.ok)
		}
		if err != nil && (!strings.Contains(err.Error(), stateVersions()) || !strings.Contains(err.Error(), "restart")) {
			t.Errorf("build %q: %q does not name this build's encodings and the way out", tc.build, err)
		}
	}
}

// The Caddyfile option: the socket's path, a timeout; anything else is a
// clear error.
func TestHandoffCaddyfile(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"sandbox_handoff", "needs the socket's path"},
		{"sandbox_handoff /run/a.sock /run/b.sock", "wrong argument count"},
		{"sandbox_handoff /run/a.sock {\n\ttimeout soon\n}", `timeout: "soon" is not a positive duration`},
		{"sandbox_handoff /run/a.sock {\n\tgrace 5s\n}", `unknown sandbox_handoff option "grace"`},
	} {
		_, err := parseHandoffOption(caddyfile.NewTestDispenser(tc.in), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error with %q", tc.in, err, tc.want)
		}
	}
}

// Provision refuses a missing or relative socket and a negative timeout,
// and defaults the timeout.
func TestHandoffProvisionChecks(t *testing.T) {
	upgrading.mu.Lock()
	upgrading.provisioned = true // no dial: this checks the configuration only
	upgrading.mu.Unlock()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	defer cancel()
	for _, tc := range []struct {
		h    Handoff
		want string
	}{
		{Handoff{}, "socket is required"},
		{Handoff{Socket: "run/handoff.sock"}, "must be an absolute path"},
		{Handoff{Socket: "/run/handoff.sock", Timeout: caddy.Duration(-time.Second)}, "must not be negative"},
	} {
		if err := tc.h.Provision(ctx); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error with %q", tc.h, err, tc.want)
		}
	}
	h := Handoff{Socket: "/run/handoff.sock"}
	if err := h.Provision(ctx); err != nil || time.Duration(h.Timeout) != DefaultHandoffTimeout {
		t.Errorf("defaults: %v, timeout %v; want %v", err, time.Duration(h.Timeout), DefaultHandoffTimeout)
	}
}

// POST /sandbox/upgrade without a sandbox_handoff app starts nothing and
// says what is missing; another method is refused.
func TestUpgradeEndpointRefusals(t *testing.T) {
	for _, tc := range []struct {
		method string
		status int
		want   string
	}{
		{http.MethodGet, http.StatusMethodNotAllowed, ""},
		{http.MethodPost, http.StatusConflict, "no sandbox_handoff app"},
	} {
		err := serveUpgrade(httptest.NewRecorder(), httptest.NewRequest(tc.method, "/sandbox/upgrade", nil))
		apiErr, ok := err.(caddy.APIError)
		if !ok || apiErr.HTTPStatus != tc.status || !strings.Contains(apiErr.Err.Error(), tc.want) {
			t.Errorf("%s: %v, want %d with %q", tc.method, err, tc.status, tc.want)
		}
	}
}

// Only one POST /sandbox/upgrade waits at a time; an outcome reaches the
// one that waits, and none is lost or blocks when nobody does.
func TestUpgradeWaiter(t *testing.T) {
	var u upgradeWaiter
	select {
	case <-u.publish(UpgradeResponse{Moved: 1}):
	default:
		t.Fatal("with nobody waiting, publish must not wait for an answer")
	}
	ch, ok := u.wait()
	if !ok {
		t.Fatal("the first waiter was refused")
	}
	if _, ok := u.wait(); ok {
		t.Fatal("a second waiter was taken")
	}
	acked := u.publish(UpgradeResponse{PID: 7, Moved: 3})
	o := <-ch
	if o.PID != 7 || o.Moved != 3 {
		t.Errorf("outcome %+v, want pid 7, 3 moved", o.UpgradeResponse)
	}
	select {
	case <-acked:
		t.Fatal("acknowledged before the waiter answered")
	default:
	}
	close(o.ack)
	<-acked
	u.done()
	if _, ok := u.wait(); !ok {
		t.Fatal("a waiter after the first one ended was refused")
	}
}
