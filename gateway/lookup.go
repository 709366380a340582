package gateway

import (
	"container/list"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/cphttp"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Defaults for the zero values of LookupConfig.
const (
	DefaultLookupTimeout     = 5 * time.Second
	DefaultLookupTTL         = 30 * time.Second
	DefaultLookupNegativeTTL = 5 * time.Second
	DefaultLookupMaxEntries  = 65536
	// maxLookupAnswer bounds a control plane's answer.
	maxLookupAnswer = 64 << 10
)

// Location is where a sandbox is: the forwarder on its host and its app's
// private address.
type Location struct {
	// Sandbox is the sandbox ID the location is for, in its canonical,
	// lowercase form (preamble.CanonicalSandboxID).
	Sandbox   string
	Forwarder string
	Target    netip.AddrPort
}

// Fetcher is a source of sandbox locations: it answers one sandbox
// without caching. Lookup caches, bounds and coalesces what it answers,
// so a new source is one type. HTTPFetcher asks a control plane.
type Fetcher interface {
	// Fetch returns where sandbox (a canonical sandbox ID) is, and how
	// long the answer holds: the Lookup keeps it for at most
	// LookupConfig.TTL, and for less when ttl is shorter; a negative ttl
	// says nothing (LookupConfig.TTL applies), zero: not cached. An error
	// is a *LookupError whose Reason says why (LookupNotFound is
	// remembered for LookupConfig.NegativeTTL); any other error is
	// LookupUnavailable. ctx bounds the fetch (LookupConfig.Timeout).
	Fetch(ctx context.Context, sandbox string) (loc Location, ttl time.Duration, err error)
}

// LookupConfig configures a Lookup.
type LookupConfig struct {
	// Fetcher is where sandboxes are looked up. Nil: an HTTPFetcher of
	// URL, Header and Client.
	Fetcher Fetcher
	// URL is the control plane's endpoint, with "{sandbox}" where the
	// sandbox ID goes (lowercase and path-escaped: never "." or ".."), e.g.
	// https://cp.internal/v1/sandboxes/{sandbox}/route. Required. The
	// answer to a GET is 200 with {"forwarder": "host:port", "target":
	// "ip:port", "ttl": seconds (optional, at most TTL)}; 404 means there
	// is no such sandbox; anything else is an error (docs/gateway.md).
	URL string
	// Header is sent with every request (e.g. Authorization).
	Header http.Header
	// Client makes the requests; nil means a client of its own. It never
	// follows a redirect: a 3xx answer fails the lookup (LookupRedirect).
	Client *http.Client
	// Timeout bounds one fetch. Zero means DefaultLookupTimeout.
	Timeout time.Duration
	// TTL is how long an answer is used; an answer's own "ttl" may only
	// shorten it. Zero means DefaultLookupTTL.
	TTL time.Duration
	// NegativeTTL is how long "no such sandbox" (404) is remembered. Zero
	// means DefaultLookupNegativeTTL; negative: never.
	NegativeTTL time.Duration
	// MaxEntries bounds the cache (answers and negative answers); the
	// least recently used goes first. Zero means DefaultLookupMaxEntries.
	MaxEntries int
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Lookup finds sandboxes through a Fetcher (a control plane): cached for
// a TTL, "not found" remembered for a shorter one, concurrent lookups of
// one sandbox coalesced into one fetch, the cache bounded. It is safe for
// concurrent use.
type Lookup struct {
	cfg      LookupConfig
	mu       sync.Mutex
	entries  map[string]*list.Element // of *lookupEntry
	lru      *list.List
	inflight map[string]*lookupCall
}

type lookupEntry struct {
	sandbox string
	loc     Location
	missing bool // a negative entry: no such sandbox
	expires time.Time
}

type lookupCall struct {
	done chan struct{}
	loc  Location
	err  error
}

// Where a Resolve's answer came from.
type Source string

const (
	SourceCache        Source = "cache"         // a cached answer or negative answer
	SourceControlPlane Source = "control-plane" // a fetch this Resolve made
	SourceCoalesced    Source = "coalesced"     // another Resolve's fetch for the same sandbox
)

// The LookupError reasons.
const (
	LookupNotFound    = "not-found"   // the control plane knows no such sandbox (404)
	LookupUnavailable = "unavailable" // no answer: a network error, a timeout, a status other than 200, 404 and 3xx
	LookupBadAnswer   = "bad-answer"  // an answer that is not a valid location
	LookupBadSandbox  = "bad-sandbox" // the sandbox ID itself cannot be in a preamble
	// LookupRedirect: the control plane answered with a redirect, which is
	// not followed (the Err is a *cphttp.RedirectError naming the status
	// and the Location).
	LookupRedirect = "redirect"
)

// LookupReasons are every LookupError reason.
func LookupReasons() []string {
	return []string{LookupNotFound, LookupUnavailable, LookupBadAnswer, LookupBadSandbox, LookupRedirect}
}

// LookupError is a sandbox that could not be found; Reason says why.
type LookupError struct {
	Sandbox string
	Reason  string
	Err     error
}

func (e *LookupError) Error() string {
	return fmt.Sprintf("gateway: lookup of sandbox %q: %s: %v", e.Sandbox, e.Reason, e.Err)
}

func (e *LookupError) Unwrap() error { return e.Err }

// NewLookup returns a Lookup for cfg.
func NewLookup(cfg LookupConfig) (*Lookup, error) {
	if cfg.Fetcher == nil {
		f, err := NewHTTPFetcher(cfg.URL, cfg.Header, cfg.Client)
		if err != nil {
			return nil, err
		}
		cfg.Fetcher = f
	}
	if cfg.Timeout < 0 || cfg.TTL < 0 || cfg.MaxEntries < 0 {
		return nil, errors.New("gateway: negative lookup timeout, TTL or size")
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultLookupTimeout
	}
	if cfg.TTL == 0 {
		cfg.TTL = DefaultLookupTTL
	}
	if cfg.NegativeTTL == 0 {
		cfg.NegativeTTL = DefaultLookupNegativeTTL
	}
	if cfg.MaxEntries == 0 {
		cfg.MaxEntries = DefaultLookupMaxEntries
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Lookup{cfg: cfg, entries: map[string]*list.Element{}, lru: list.New(), inflight: map[string]*lookupCall{}}, nil
}

// Resolve returns where sandbox is, and where the answer came from. Every
// error is a *LookupError. The sandbox ID is case-insensitive: it is
// looked up, cached and answered (Location.Sandbox) in its lowercase form,
// and one that is not a valid sandbox ID even lowercased (such as "..")
// fails LookupBadSandbox without a fetch. ctx bounds this caller's wait
// only: a fetch that others wait on too runs to its own timeout.
func (l *Lookup) Resolve(ctx context.Context, sandbox string) (Location, Source, error) {
	canonical, err := preamble.CanonicalSandboxID(sandbox)
	if err != nil {
		return Location{}, "", &LookupError{Sandbox: sandbox, Reason: LookupBadSandbox, Err: err}
	}
	sandbox = canonical
	now := l.cfg.Now()
	l.mu.Lock()
	if e, ok := l.entries[sandbox]; ok {
		ent := e.Value.(*lookupEntry)
		if now.Before(ent.expires) {
			l.lru.MoveToFront(e)
			l.mu.Unlock()
			if ent.missing {
				return Location{}, SourceCache, &LookupError{Sandbox: sandbox, Reason: LookupNotFound, Err: errors.New("no such sandbox (remembered)")}
			}
			return ent.loc, SourceCache, nil
		}
		l.lru.Remove(e)
		delete(l.entries, sandbox)
	}
	call, coalesced := l.inflight[sandbox]
	if !coalesced {
		call = &lookupCall{done: make(chan struct{})}
		l.inflight[sandbox] = call
		go l.fetch(sandbox, call)
	}
	l.mu.Unlock()
	source := SourceControlPlane
	if coalesced {
		source = SourceCoalesced
	}
	select {
	case <-call.done:
		return call.loc, source, call.err
	case <-ctx.Done():
		return Location{}, source, &LookupError{Sandbox: sandbox, Reason: LookupUnavailable, Err: ctx.Err()}
	}
}

// fetch asks the Fetcher and caches what it says.
func (l *Lookup) fetch(sandbox string, call *lookupCall) {
	loc, ttl, err := l.ask(sandbox)
	call.loc, call.err = loc, err
	l.mu.Lock()
	delete(l.inflight, sandbox)
	var le *LookupError
	switch {
	case err == nil && ttl > 0:
		l.store(&lookupEntry{sandbox: sandbox, loc: loc, expires: l.cfg.Now().Add(ttl)})
	case errors.As(err, &le) && le.Reason == LookupNotFound && l.cfg.NegativeTTL > 0:
		l.store(&lookupEntry{sandbox: sandbox, missing: true, expires: l.cfg.Now().Add(l.cfg.NegativeTTL)})
	}
	l.mu.Unlock()
	close(call.done)
}

// store adds e, dropping the least recently used entries beyond the
// bound. l.mu is held.
func (l *Lookup) store(e *lookupEntry) {
	l.entries[e.sandbox] = l.lru.PushFront(e)
	for l.lru.Len() > l.cfg.MaxEntries {
		old := l.lru.Remove(l.lru.Back()).(*lookupEntry)
		delete(l.entries, old.sandbox)
	}
}

// ask fetches sandbox: every error a *LookupError, the location checked
// (a valid forwarder and target, for sandbox) and the TTL bounded.
func (l *Lookup) ask(sandbox string) (Location, time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.Timeout)
	defer cancel()
	loc, ttl, err := l.cfg.Fetcher.Fetch(ctx, sandbox)
	if err != nil {
		var le *LookupError
		if !errors.As(err, &le) {
			err = &LookupError{Sandbox: sandbox, Reason: LookupUnavailable, Err: err}
		}
		return Location{}, 0, err
	}
	if loc.Sandbox != sandbox {
		return Location{}, 0, &LookupError{Sandbox: sandbox, Reason: LookupBadAnswer, Err: fmt.Errorf("an answer for sandbox %q", loc.Sandbox)}
	}
	r, err := ParseRoute(loc.Forwarder, sandbox, loc.Target.String())
	if err != nil {
		return Location{}, 0, &LookupError{Sandbox: sandbox, Reason: LookupBadAnswer, Err: err}
	}
	if ttl < 0 {
		ttl = l.cfg.TTL
	}
	return Location{Sandbox: r.Sandbox, Forwarder: r.Forwarder, Target: r.Target}, min(ttl, l.cfg.TTL), nil
}

// HTTPFetcher asks a control plane over HTTP: a GET of its URL with the
// sandbox ID in it, answered 200 with {"forwarder": "host:port", "target":
// "ip:port", "ttl": seconds (optional)}, 404 for no such sandbox, and
// anything else an error (docs/gateway.md). It never follows a redirect: a
// 3xx answer fails the fetch (LookupRedirect).
type HTTPFetcher struct {
	url    string
	header http.Header
	client *http.Client
}

// NewHTTPFetcher returns an HTTPFetcher of rawURL, with "{sandbox}" where
// the sandbox ID goes (lowercase and path-escaped: never "." or ".."),
// e.g. https://cp.internal/v1/sandboxes/{sandbox}/route. header is sent
// with every request (e.g. Authorization); client makes them (nil: a
// client of its own; redirects are never followed).
func NewHTTPFetcher(rawURL string, header http.Header, client *http.Client) (*HTTPFetcher, error) {
	if !strings.Contains(rawURL, "{sandbox}") {
		return nil, errors.New("gateway: lookup URL has no {sandbox} where the sandbox ID goes")
	}
	u, err := url.Parse(strings.ReplaceAll(rawURL, "{sandbox}", "x"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("gateway: lookup URL %q: want http(s)://host/...{sandbox}...", rawURL)
	}
	return &HTTPFetcher{url: rawURL, header: header, client: cphttp.NoRedirects(client)}, nil
}

// lookupAnswer is the control plane's 200 answer.
type lookupAnswer struct {
	Forwarder string `json:"forwarder"`
	Target    string `json:"target"`
	TTL       *int64 `json:"ttl"`
}

// Fetch asks the control plane where sandbox is.
func (f *HTTPFetcher) Fetch(ctx context.Context, sandbox string) (Location, time.Duration, error) {
	fail := func(reason string, err error) (Location, time.Duration, error) {
		return Location{}, 0, &LookupError{Sandbox: sandbox, Reason: reason, Err: err}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.ReplaceAll(f.url, "{sandbox}", sandboxPath(sandbox)), nil)
	if err != nil {
		return fail(LookupUnavailable, err)
	}
	for k, v := range f.header {
		req.Header[k] = v
	}
	req.Header.Set("Accept", "application/json")
	resp, body, err := cphttp.Do(f.client, req, maxLookupAnswer)
	if _, redirected := errors.AsType[*cphttp.RedirectError](err); redirected {
		return fail(LookupRedirect, err)
	}
	if resp == nil {
		return fail(LookupUnavailable, err)
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return fail(LookupNotFound, errors.New("the control plane knows no such sandbox (404)"))
	case resp.StatusCode != http.StatusOK:
		return fail(LookupUnavailable, fmt.Errorf("the control plane answered %s", resp.Status))
	case err != nil:
		return fail(LookupUnavailable, fmt.Errorf("reading the answer: %w", err))
	case len(body) > maxLookupAnswer:
		return fail(LookupBadAnswer, fmt.Errorf("an answer over %d bytes", maxLookupAnswer))
	}
	var a lookupAnswer
	if err := json.Unmarshal(body, &a); err != nil {
		return fail(LookupBadAnswer, fmt.Errorf("not the JSON of a location: %w", err))
	}
	r, err := ParseRoute(a.Forwarder, sandbox, a.Target)
	if err != nil {
		return fail(LookupBadAnswer, err)
	}
	ttl := time.Duration(-1) // none given
	if a.TTL != nil {
		if *a.TTL < 0 {
			return fail(LookupBadAnswer, fmt.Errorf("ttl %d", *a.TTL))
		}
		ttl = time.Duration(*a.TTL) * time.Second
	}
	return Location{Sandbox: r.Sandbox, Forwarder: r.Forwarder, Target: r.Target}, ttl, nil
}

// sandboxPath is a sandbox ID as one segment of the lookup URL's path:
// path-escaped, and a segment made only of dots, which a valid ID never
// is, spelled %2E so that no client or server takes it for "this" or "the
// parent" directory.
func sandboxPath(id string) string {
	esc := url.PathEscape(id)
	if strings.Trim(esc, ".") == "" {
		return strings.ReplaceAll(esc, ".", "%2E")
	}
	return esc
}

// Len is how many entries (answers and negative answers) the cache holds.
func (l *Lookup) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lru.Len()
}
