package gateway

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// pathRecorder is a control plane that records the exact request target
// of every request and answers every sandbox with one location.
type pathRecorder struct {
	srv  *httptest.Server
	mu   sync.Mutex
	uris []string
}

func newPathRecorder(t *testing.T) *pathRecorder {
	pr := &pathRecorder{}
	pr.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pr.mu.Lock()
		pr.uris = append(pr.uris, r.RequestURI)
		pr.mu.Unlock()
		fmt.Fprint(w, `{"forwarder":"10.0.0.5:8443","target":"10.1.0.7:8080"}`)
	}))
	t.Cleanup(pr.srv.Close)
	return pr
}

func (pr *pathRecorder) requests() []string {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return append([]string(nil), pr.uris...)
}

// A sandbox ID is case-insensitive: every spelling is one lookup, asked
// once, in lowercase, cached under one entry, and answered with the
// lowercase ID.
func TestLookupSandboxIDCase(t *testing.T) {
	pr := newPathRecorder(t)
	l, err := NewLookup(LookupConfig{URL: pr.srv.URL + "/v1/sandboxes/{sandbox}/route"})
	if err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"SBX-R2", "sbx-r2", "Sbx-R2"} {
		loc, src, err := l.Resolve(context.Background(), id)
		wantSrc := SourceCache
		if i == 0 {
			wantSrc = SourceControlPlane
		}
		if err != nil || loc.Sandbox != "sbx-r2" || src != wantSrc {
			t.Errorf("Resolve(%q) = %+v from %s, %v; want sandbox sbx-r2 from %s", id, loc, src, err, wantSrc)
		}
	}
	if got := pr.requests(); len(got) != 1 || got[0] != "/v1/sandboxes/sbx-r2/route" {
		t.Errorf("the control plane saw %q, want one request for /v1/sandboxes/sbx-r2/route", got)
	}
	if n := l.Len(); n != 1 {
		t.Errorf("the cache holds %d entries for three spellings of one sandbox, want 1", n)
	}
}

// An ID of dots, or one that starts with a dot, never becomes part of a
// lookup URL: it is refused (bad-sandbox) before the control plane is
// asked, with the rule in the error.
func TestLookupRefusesDotIDs(t *testing.T) {
	pr := newPathRecorder(t)
	l, err := NewLookup(LookupConfig{URL: pr.srv.URL + "/lookup/{sandbox}"})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{".", "..", ".a", "../admin", "-a", "%2e%2e"} {
		_, _, err := l.Resolve(context.Background(), id)
		var le *LookupError
		if !errors.As(err, &le) || le.Reason != LookupBadSandbox || preamble.ReasonOf(err) != string(preamble.ReasonBadSandboxID) {
			t.Errorf("Resolve(%q) = %v, want a %s *LookupError (bad-sandbox-id)", id, err, LookupBadSandbox)
		}
	}
	if got := pr.requests(); len(got) != 0 {
		t.Errorf("the control plane saw %q, want no request", got)
	}
	// Were such an ID ever to reach the URL, it would not be a dot segment.
	for id, want := range map[string]string{".": "%2E", "..": "%2E%2E", "a..": "a..", "a/b": "a%2Fb", "sbx-1": "sbx-1"} {
		if got := sandboxPath(id); got != want {
			t.Errorf("sandboxPath(%q) = %q, want %q", id, got, want)
		}
	}
}

// ParseRoute lowercases the sandbox ID, so routes (and the pools keyed by
// them) of two spellings are one; an ID that is not valid even lowercased
// is a RouteError on the sandbox that names the rule.
func TestParseRouteSandboxID(t *testing.T) {
	a, errA := ParseRoute("f:1", "SBX-LIM2", "10.0.0.7:80")
	b, errB := ParseRoute("f:1", "sbx-lim2", "10.0.0.7:80")
	if errA != nil || errB != nil || a != b || a.Sandbox != "sbx-lim2" {
		t.Errorf("ParseRoute of SBX-LIM2 and sbx-lim2: %+v (%v), %+v (%v); want one route for sbx-lim2", a, errA, b, errB)
	}
	for _, id := range []string{".", "..", ".a", "_a", "\u212a"} {
		_, err := ParseRoute("f:1", id, "10.0.0.7:80")
		var re *RouteError
		if !errors.As(err, &re) || re.Field != "sandbox" || !strings.Contains(err.Error(), "the first a letter or a digit") && !strings.Contains(err.Error(), "[a-z0-9._-]") {
			t.Errorf("ParseRoute sandbox %q: %v, want a RouteError on the sandbox that names the rule", id, err)
		}
	}
}

// Dial refuses a Route whose sandbox ID is not canonical before it
// connects: nothing reaches the forwarder.
func TestDialRefusesNonCanonicalSandbox(t *testing.T) {
	p := newPKI(t)
	d := newDialer(t, p, forwardtest.NewGateway(t, "gw-1"))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan struct{}, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- struct{}{}
			c.Close()
		}
	}()
	for _, id := range []string{"SBX-1", "..", ".a"} {
		_, err := d.Dial(context.Background(), Route{Forwarder: ln.Addr().String(), Sandbox: id, Target: netip.MustParseAddrPort("10.0.0.7:8080")})
		var de *DialError
		if !errors.As(err, &de) || de.Step != StepPreamble || preamble.ReasonOf(err) != string(preamble.ReasonBadSandboxID) {
			t.Errorf("Dial with sandbox %q: %v, want a *DialError at %s (bad-sandbox-id)", id, err, StepPreamble)
		}
	}
	ln.Close()
	if len(accepted) != 0 {
		t.Errorf("the forwarder accepted %d connections, want none", len(accepted))
	}
}
