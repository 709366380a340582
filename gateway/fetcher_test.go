package gateway

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// fakeFetcher answers from a table, counting the fetches of each sandbox;
// with hold set, every fetch waits for it to be closed.
type fakeFetcher struct {
	mu      sync.Mutex
	answers map[string]fakeAnswer
	calls   map[string]int
	hold    chan struct{}
}

type fakeAnswer struct {
	loc Location
	ttl time.Duration
	err error
}

func newFakeFetcher() *fakeFetcher {
	return &fakeFetcher{answers: map[string]fakeAnswer{}, calls: map[string]int{}}
}

func (f *fakeFetcher) Fetch(ctx context.Context, sandbox string) (Location, time.Duration, error) {
	f.mu.Lock()
	f.calls[sandbox]++
	a, ok := f.answers[sandbox]
	hold := f.hold
	f.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return Location{}, 0, ctx.Err()
		}
	}
	if !ok {
		return Location{}, 0, &LookupError{Sandbox: sandbox, Reason: LookupNotFound, Err: errors.New("not in the table")}
	}
	return a.loc, a.ttl, a.err
}

func (f *fakeFetcher) set(sandbox string, a fakeAnswer) {
	f.mu.Lock()
	f.answers[sandbox] = a
	f.mu.Unlock()
}

func (f *fakeFetcher) count(sandbox string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[sandbox]
}

func fakeLookup(t *testing.T, f Fetcher, mod func(*LookupConfig)) (*Lookup, *time.Time) {
	t.Helper()
	return newLookupAt(t, LookupConfig{Fetcher: f}, mod)
}

func loc(sandbox string) Location {
	return Location{Sandbox: sandbox, Forwarder: "10.0.0.5:8443", Target: netip.MustParseAddrPort("10.1.0.7:8080")}
}

// A Lookup of any Fetcher caches an answer for LookupConfig.TTL, for the
// answer's own TTL when shorter, never for longer, and not at all for a
// zero TTL; the fetcher is asked exactly when the cache cannot answer.
func TestFetcherCached(t *testing.T) {
	f := newFakeFetcher()
	f.set("sbx-default", fakeAnswer{loc: loc("sbx-default"), ttl: -1})
	f.set("sbx-short", fakeAnswer{loc: loc("sbx-short"), ttl: 5 * time.Second})
	f.set("sbx-long", fakeAnswer{loc: loc("sbx-long"), ttl: time.Hour})
	f.set("sbx-zero", fakeAnswer{loc: loc("sbx-zero"), ttl: 0})
	l, now := fakeLookup(t, f, func(c *LookupConfig) { c.TTL = 30 * time.Second })
	resolve := func(sandbox string, want Source) {
		t.Helper()
		got, src, err := l.Resolve(context.Background(), sandbox)
		if canonical := strings.ToLower(sandbox); err != nil || got != loc(canonical) || src != want {
			t.Fatalf("Resolve(%s) = %+v, %s, %v; want %+v from %s", sandbox, got, src, err, loc(canonical), want)
		}
	}
	for _, s := range []string{"sbx-default", "sbx-short", "sbx-long", "sbx-zero"} {
		resolve(s, SourceControlPlane)
	}
	resolve("SBX-Default", SourceCache) // case-insensitive: one sandbox
	resolve("sbx-short", SourceCache)
	resolve("sbx-long", SourceCache)
	resolve("sbx-zero", SourceControlPlane)
	*now = now.Add(6 * time.Second)
	resolve("sbx-default", SourceCache)
	resolve("sbx-short", SourceControlPlane)
	resolve("sbx-long", SourceCache)
	*now = now.Add(25 * time.Second)
	resolve("sbx-default", SourceControlPlane)
	resolve("sbx-long", SourceControlPlane) // bounded by LookupConfig.TTL
	for s, want := range map[string]int{"sbx-default": 2, "sbx-short": 2, "sbx-long": 2, "sbx-zero": 2} {
		if got := f.count(s); got != want {
			t.Errorf("%s fetched %d times, want %d", s, got, want)
		}
	}
	if n := l.Len(); n != 3 {
		t.Errorf("%d cache entries, want 3 (a zero TTL is not cached)", n)
	}
}

// Concurrent lookups of one sandbox wait on one fetch: its answer, or its
// error, reaches them all; a caller that gives up leaves the others to it.
func TestFetcherCoalesced(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeFetcher()
		f.set("sbx-1", fakeAnswer{loc: loc("sbx-1"), ttl: -1})
		f.hold = make(chan struct{})
		// Not-found answers are not remembered: each fetch is seen.
		l, _ := fakeLookup(t, f, func(c *LookupConfig) { c.NegativeTTL = -1 })
		for _, sandbox := range []string{"sbx-1", "sbx-missing"} {
			const callers = 10
			var wg sync.WaitGroup
			sources := make(chan Source, callers)
			errs := make(chan error, callers)
			for range callers {
				wg.Go(func() {
					got, src, err := l.Resolve(context.Background(), sandbox)
					if err == nil && got != loc(sandbox) {
						t.Errorf("Resolve(%s) = %+v", sandbox, got)
					}
					sources <- src
					errs <- err
				})
			}
			impatient, cancel := context.WithCancel(context.Background())
			gaveUp := make(chan error, 1)
			go func() {
				_, _, err := l.Resolve(impatient, sandbox)
				gaveUp <- err
			}()
			synctest.Wait() // every caller waits: one on the fetch, the rest on it
			cancel()
			if err := <-gaveUp; reasonOf(err) != LookupUnavailable || !errors.Is(err, context.Canceled) {
				t.Errorf("%s: the caller that gave up: %v", sandbox, err)
			}
			close(f.hold)
			wg.Wait()
			close(sources)
			close(errs)
			count := map[Source]int{}
			for s := range sources {
				count[s]++
			}
			reasons := map[string]int{}
			for err := range errs {
				reasons[reasonOf(err)]++
			}
			wantReason := ""
			if sandbox == "sbx-missing" {
				wantReason = LookupNotFound
			}
			if n := f.count(sandbox); n != 1 || count[SourceControlPlane]+count[SourceCoalesced] != callers || count[SourceControlPlane] > 1 || reasons[wantReason] != callers {
				t.Errorf("%s: %d fetches, sources %v, reasons %v: want 1 fetch for %d callers, each answered %q", sandbox, n, count, reasons, callers, wantReason)
			}
			f.hold = make(chan struct{})
		}
		// The impatient caller may have been the one that asked: then
		// the other ten were all coalesced. Either way one fetch each.
		close(f.hold)
		if _, _, err := l.Resolve(context.Background(), "sbx-missing"); reasonOf(err) != LookupNotFound {
			t.Errorf("sbx-missing again: %v", err)
		}
		if n := f.count("sbx-missing"); n != 2 {
			t.Errorf("sbx-missing fetched %d times, want 2 (not-found is not remembered here)", n)
		}
	})
}

// A fetcher's errors: LookupNotFound is remembered for NegativeTTL; any
// other reason, an error that is no *LookupError (LookupUnavailable) and
// an answer that is not a valid location (LookupBadAnswer) are not
// cached; an invalid sandbox ID is never fetched.
func TestFetcherErrors(t *testing.T) {
	f := newFakeFetcher()
	f.set("sbx-down", fakeAnswer{err: errors.New("connection refused")})
	f.set("sbx-redirect", fakeAnswer{err: &LookupError{Sandbox: "sbx-redirect", Reason: LookupRedirect, Err: errors.New("302")}})
	f.set("sbx-other", fakeAnswer{loc: loc("sbx-someone-else"), ttl: -1})
	f.set("sbx-hostname", fakeAnswer{loc: Location{Sandbox: "sbx-hostname", Forwarder: "fwd.internal", Target: netip.MustParseAddrPort("10.1.0.7:8080")}, ttl: -1})
	f.set("sbx-notarget", fakeAnswer{loc: Location{Sandbox: "sbx-notarget", Forwarder: "10.0.0.5:8443"}, ttl: -1})
	l, now := fakeLookup(t, f, func(c *LookupConfig) { c.NegativeTTL = 5 * time.Second })
	for _, c := range []struct {
		sandbox, reason string
		fetches         int
	}{
		{"sbx-down", LookupUnavailable, 2},
		{"sbx-redirect", LookupRedirect, 2},
		{"sbx-other", LookupBadAnswer, 2},
		{"sbx-hostname", LookupBadAnswer, 2},
		{"sbx-notarget", LookupBadAnswer, 2},
		{"sbx-missing", LookupNotFound, 1},
		{"..", LookupBadSandbox, 0},
	} {
		for i := range 2 {
			_, src, err := l.Resolve(context.Background(), c.sandbox)
			if reasonOf(err) != c.reason {
				t.Errorf("Resolve(%s) #%d: %v (from %s), want %s", c.sandbox, i, err, src, c.reason)
			}
		}
		if n := f.count(c.sandbox); n != c.fetches {
			t.Errorf("%s fetched %d times for 2 lookups, want %d", c.sandbox, n, c.fetches)
		}
	}
	*now = now.Add(6 * time.Second)
	if _, src, err := l.Resolve(context.Background(), "sbx-missing"); reasonOf(err) != LookupNotFound || src != SourceControlPlane {
		t.Errorf("sbx-missing after NegativeTTL: %v from %s, want not-found, fetched", err, src)
	}
	if n := f.count("sbx-missing"); n != 2 {
		t.Errorf("sbx-missing fetched %d times, want 2", n)
	}
	if n := l.Len(); n != 1 {
		t.Errorf("%d cache entries, want 1 (the negative answer)", n)
	}
}
