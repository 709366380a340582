package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// controlPlane answers lookups from a table; it counts requests per
// sandbox and can hold answers until released.
type controlPlane struct {
	srv      *httptest.Server
	mu       sync.Mutex
	answers  map[string]func(w http.ResponseWriter)
	requests map[string]int
	auth     atomic.Value // the last Authorization header
	hold     chan struct{}
}

func newControlPlane(t *testing.T) *controlPlane {
	cp := &controlPlane{answers: map[string]func(http.ResponseWriter){}, requests: map[string]int{}}
	cp.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/v1/sandboxes/"), "/route")
		cp.auth.Store(r.Header.Get("Authorization"))
		cp.mu.Lock()
		cp.requests[id]++
		answer, hold := cp.answers[id], cp.hold
		cp.mu.Unlock()
		if hold != nil {
			<-hold
		}
		if answer == nil {
			http.NotFound(w, r)
			return
		}
		answer(w)
	}))
	t.Cleanup(cp.srv.Close)
	return cp
}

func (cp *controlPlane) set(id string, answer func(w http.ResponseWriter)) {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	cp.answers[id] = answer
}

func (cp *controlPlane) count(id string) int {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.requests[id]
}

func jsonAnswer(body string) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) { w.Header().Set("Content-Type", "application/json"); fmt.Fprint(w, body) }
}

func (cp *controlPlane) lookup(t *testing.T, mod func(*LookupConfig)) (*Lookup, *time.Time) {
	t.Helper()
	return newLookupAt(t, LookupConfig{URL: cp.srv.URL + "/v1/sandboxes/{sandbox}/route", Header: http.Header{"Authorization": {"Bearer s3cret"}}}, mod)
}

// newLookupAt makes a Lookup of cfg, changed by mod when set, whose clock
// stands at the returned time until a test moves it.
func newLookupAt(t *testing.T, cfg LookupConfig, mod func(*LookupConfig)) (*Lookup, *time.Time) {
	t.Helper()
	now := time.Unix(1_800_000_000, 0)
	cfg.Now = func() time.Time { return now }
	if mod != nil {
		mod(&cfg)
	}
	l, err := NewLookup(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l, &now
}

func reasonOf(err error) string {
	var le *LookupError
	if errors.As(err, &le) {
		return le.Reason
	}
	return ""
}

// Answers are cached for their TTL (the answer's own, when shorter),
// then asked again; the control plane sees the configured headers.
func TestLookupCachesForTTL(t *testing.T) {
	cp := newControlPlane(t)
	cp.set("sbx-1", jsonAnswer(`{"forwarder":"10.0.0.5:8443","target":"10.1.0.7:8080"}`))
	cp.set("sbx-2", jsonAnswer(`{"forwarder":"10.0.0.6:8443","target":"[fd00::9]:80","ttl":2}`))
	l, now := cp.lookup(t, nil)
	ctx := context.Background()
	want := Location{Sandbox: "sbx-1", Forwarder: "10.0.0.5:8443", Target: netip.MustParseAddrPort("10.1.0.7:8080")}
	for i, wantSource := range []Source{SourceControlPlane, SourceCache, SourceCache} {
		loc, src, err := l.Resolve(ctx, "sbx-1")
		if err != nil || loc != want || src != wantSource {
			t.Fatalf("resolve %d: %+v from %s, %v; want %+v from %s", i, loc, src, err, want, wantSource)
		}
	}
	if n := cp.count("sbx-1"); n != 1 {
		t.Errorf("control plane asked %d times within the TTL, want 1", n)
	}
	if a := cp.auth.Load(); a != "Bearer s3cret" {
		t.Errorf("Authorization %q", a)
	}
	*now = now.Add(DefaultLookupTTL)
	if _, src, _ := l.Resolve(ctx, "sbx-1"); src != SourceControlPlane || cp.count("sbx-1") != 2 {
		t.Errorf("after the TTL: from %s, %d requests; want a new request", src, cp.count("sbx-1"))
	}
	l.Resolve(ctx, "sbx-2")
	*now = now.Add(2 * time.Second)
	if _, src, _ := l.Resolve(ctx, "sbx-2"); src != SourceControlPlane {
		t.Errorf("after the answer's own ttl of 2s: from %s, want the control plane", src)
	}
}

// "No such sandbox" is remembered for the negative TTL only; errors of
// the control plane are not remembered at all.
func TestLookupNegativeAndErrors(t *testing.T) {
	cp := newControlPlane(t)
	l, now := cp.lookup(t, nil)
	ctx := context.Background()
	for range 3 {
		if _, _, err := l.Resolve(ctx, "sbx-gone"); reasonOf(err) != LookupNotFound {
			t.Fatalf("unknown sandbox: %v, want %s", err, LookupNotFound)
		}
	}
	if n := cp.count("sbx-gone"); n != 1 {
		t.Errorf("control plane asked %d times for a missing sandbox within the negative TTL, want 1", n)
	}
	*now = now.Add(DefaultLookupNegativeTTL)
	cp.set("sbx-gone", jsonAnswer(`{"forwarder":"10.0.0.5:8443","target":"10.1.0.7:8080"}`))
	if _, _, err := l.Resolve(ctx, "sbx-gone"); err != nil {
		t.Errorf("after the negative TTL, a sandbox that appeared: %v", err)
	}

	for _, c := range []struct {
		name, reason string
		answer       func(http.ResponseWriter)
	}{
		{"500", LookupUnavailable, func(w http.ResponseWriter) { http.Error(w, "boom", 500) }},
		{"garbage", LookupBadAnswer, jsonAnswer(`<html>`)},
		{"host name target", LookupBadAnswer, jsonAnswer(`{"forwarder":"10.0.0.5:8443","target":"app.internal:80"}`)},
		{"no forwarder port", LookupBadAnswer, jsonAnswer(`{"forwarder":"10.0.0.5","target":"10.1.0.7:80"}`)},
		{"negative ttl", LookupBadAnswer, jsonAnswer(`{"forwarder":"10.0.0.5:1","target":"10.1.0.7:80","ttl":-1}`)},
		{"huge", LookupBadAnswer, jsonAnswer(`{"forwarder":"` + strings.Repeat("a", maxLookupAnswer) + `"}`)},
	} {
		id := "sbx-" + strings.ReplaceAll(c.name, " ", "-")
		cp.set(id, c.answer)
		for range 2 {
			_, _, err := l.Resolve(ctx, id)
			if reasonOf(err) != c.reason {
				t.Errorf("%s: %v, want %s", c.name, err, c.reason)
			}
		}
		if n := cp.count(id); n != 2 {
			t.Errorf("%s: asked %d times for 2 lookups, want 2 (errors are not cached)", c.name, n)
		}
	}
	if _, _, err := l.Resolve(ctx, "bad/id"); reasonOf(err) != LookupBadSandbox {
		t.Errorf("bad sandbox ID: %v", err)
	}
}

// Concurrent lookups of one sandbox make one request; a caller that gives
// up does not cancel it for the others.
func TestLookupCoalesces(t *testing.T) {
	cp := newControlPlane(t)
	cp.hold = make(chan struct{})
	cp.set("sbx-1", jsonAnswer(`{"forwarder":"10.0.0.5:8443","target":"10.1.0.7:8080"}`))
	l, _ := cp.lookup(t, nil)
	impatient, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	sources := make(chan Source, 11)
	for range 10 {
		wg.Go(func() {
			_, src, err := l.Resolve(context.Background(), "sbx-1")
			if err != nil {
				t.Error(err)
			}
			sources <- src
		})
	}
	gaveUp := make(chan error, 1)
	go func() {
		_, src, err := l.Resolve(impatient, "sbx-1")
		sources <- src
		gaveUp <- err
	}()
	waitFor(t, "the control plane to be asked for sbx-1", func() bool { return cp.count("sbx-1") == 1 })
	time.Sleep(20 * time.Millisecond) // let every caller join the request
	cancel()
	if err := <-gaveUp; reasonOf(err) != LookupUnavailable || !errors.Is(err, context.Canceled) {
		t.Errorf("the caller that gave up: %v", err)
	}
	close(cp.hold)
	wg.Wait()
	close(sources)
	count := map[Source]int{}
	for s := range sources {
		count[s]++
	}
	// Whichever of the 11 came first asked (the impatient one included).
	if n := cp.count("sbx-1"); n != 1 || count[SourceControlPlane] != 1 || count[SourceCoalesced] != 10 {
		t.Errorf("%d requests, sources %v: want 1 request, 1 caller asking and 10 coalesced", n, count)
	}
}

// The cache holds at most MaxEntries; the least recently used goes.
func TestLookupBounded(t *testing.T) {
	cp := newControlPlane(t)
	for i := range 5 {
		cp.set(fmt.Sprintf("sbx-%d", i), jsonAnswer(`{"forwarder":"10.0.0.5:8443","target":"10.1.0.7:8080"}`))
	}
	l, _ := cp.lookup(t, func(c *LookupConfig) { c.MaxEntries = 3 })
	ctx := context.Background()
	for i := range 5 {
		l.Resolve(ctx, fmt.Sprintf("sbx-%d", i))
		l.Resolve(ctx, "sbx-0") // keep sbx-0 recent
	}
	if n := l.Len(); n != 3 {
		t.Errorf("cache holds %d entries, want 3", n)
	}
	if _, src, _ := l.Resolve(ctx, "sbx-0"); src != SourceCache {
		t.Errorf("the most recently used entry was evicted")
	}
	if _, src, _ := l.Resolve(ctx, "sbx-1"); src != SourceControlPlane {
		t.Errorf("the least recently used entry was kept")
	}
}

func TestNewLookupRejectsBadConfig(t *testing.T) {
	for _, u := range []string{"https://cp/v1/sandboxes", "ftp://cp/{sandbox}", "/v1/{sandbox}", "http:///{sandbox}"} {
		if _, err := NewLookup(LookupConfig{URL: u}); err == nil {
			t.Errorf("NewLookup(%q) accepted", u)
		}
	}
}
