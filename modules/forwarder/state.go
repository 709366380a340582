package forwarder

import (
	"crypto/ed25519"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Process-level state: what outlives a configuration load. Caddy provisions
// a reload's modules before it cleans up the old ones, and every module
// instance is new, so whatever must carry across a reload lives here, in
// package variables, never in a module: the open tunnels and their counters
// (a reload must not end or reset them), the gateway keys of every loaded
// configuration (a reload that stops trusting a key ends that key's
// tunnels), the replay caches (a nonce accepted before a reload stays
// spent), the activity pushers' counts and the close API's counts (metrics
// never go backwards). The forwarder's families (metrics.go) read all of it
// at scrape time.

// tunnels is the process-level tunnel registry: every configuration loaded
// over the process's lifetime shares it, so tunnels and their counters
// survive reloads (only process exit drains; a reload ends only the tunnels
// of keys it revoked, see keyrings).
var tunnels = forward.NewRegistry()

// keyrings holds the gateway keys of every provisioned sandbox handler, of
// every loaded configuration: when a reload retires a handler, the open
// tunnels signed by a key that none of the others trusts (removed, or its
// ID given to another key) are ended (Cleanup).
var keyrings = &keyringSet{live: map[*Handler]map[string]ed25519.PublicKey{}}

type keyringSet struct {
	mu   sync.Mutex
	live map[*Handler]map[string]ed25519.PublicKey
}

func (s *keyringSet) add(h *Handler, keys map[string]ed25519.PublicKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.live[h] = keys
}

func (s *keyringSet) remove(h *Handler) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.live, h)
}

// trusts reports whether a live handler holds key under id.
func (s *keyringSet) trusts(id string, key ed25519.PublicKey) bool {
	return s.handlerTrusting(id, key) != nil
}

// handlerTrusting returns a live handler that holds key under id, or nil.
func (s *keyringSet) handlerTrusting(id string, key ed25519.PublicKey) *Handler {
	s.mu.Lock()
	defer s.mu.Unlock()
	for h, keys := range s.live {
		if k, ok := keys[id]; ok && k.Equal(key) {
			return h
		}
	}
	return nil
}

// named returns a live handler whose moveName is name, or nil.
func (s *keyringSet) named(name string) *Handler {
	s.mu.Lock()
	defer s.mu.Unlock()
	for h := range s.live {
		if name != "" && h.moveName == name {
			return h
		}
	}
	return nil
}

// only returns the one live handler, or nil when there are none or
// several, and how many there are.
func (s *keyringSet) only() (*Handler, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for h := range s.live {
		if len(s.live) == 1 {
			return h, 1
		}
	}
	return nil, len(s.live)
}

// replayCaches holds the preamble replay caches in use, one per distinct
// (size, window): the verifier of every configuration is new, but its
// nonces must not be: a preamble accepted just before a reload would
// otherwise be accepted again right after it, within its TTL. A reload
// provisions the new configuration before it cleans up the old one, so
// the reference count never drops to zero and the cache carries over.
// Changing replay_cache_size, max_preamble_ttl or max_clock_skew selects
// another cache: that reload starts with no nonces remembered.
var replayCaches = caddy.NewUsagePool()

type replayCacheKey struct {
	size   int
	window time.Duration
}

// replayCacheEntry makes a ReplayCache a caddy.Destructor; it holds only
// memory, so there is nothing to release.
type replayCacheEntry struct{ *preamble.ReplayCache }

func (replayCacheEntry) Destruct() error { return nil }

// pusherSet tracks the activity pushers of all loaded configurations, and
// keeps the counts of retired ones so the metrics never go backwards across
// a reload.
type pusherSet struct {
	mu      sync.Mutex
	live    map[*forward.Pusher]struct{}
	retired forward.PusherStats
}

var pushers = &pusherSet{live: map[*forward.Pusher]struct{}{}}

func (s *pusherSet) add(p *forward.Pusher) {
	s.mu.Lock()
	s.live[p] = struct{}{}
	s.mu.Unlock()
}

// remove retires a stopped pusher.
func (s *pusherSet) remove(p *forward.Pusher) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.live[p]; !ok {
		return
	}
	delete(s.live, p)
	st := p.Stats()
	s.retired.Sent += st.Sent
	s.retired.Retries += st.Retries
	s.retired.Dropped += st.Dropped
	s.retired.Redirected += st.Redirected
}

func (s *pusherSet) Stats() forward.PusherStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.retired
	for p := range s.live {
		st := p.Stats()
		t.Sent += st.Sent
		t.Retries += st.Retries
		t.Dropped += st.Dropped
		t.Redirected += st.Redirected
	}
	return t
}

// ActivityReports is what the activity pushers of every configuration
// loaded so far have done (caddy_ktls_activity_reports_total).
func ActivityReports() forward.PusherStats { return pushers.Stats() }

// Tunnels is the process's tunnel registry (tunnels).
func Tunnels() *forward.Registry { return tunnels }

// ReplayCacheReferences says how many loaded sandbox handlers share the
// replay cache of size and window, and whether there is one.
func ReplayCacheReferences(size int, window time.Duration) (int, bool) {
	return replayCaches.References(replayCacheKey{size: size, window: window})
}

// closeRefusals counts the refused POST /sandbox/close by reason.
var closeRefusals = caddymetrics.NewSeriesCounts("caddy_ktls_sandbox_close_refused_total", []string{
	closeRefusedMethod, closeRefusedContentType, closeRefusedTooLarge, closeRefusedBadRequest, closeRefusedFull})

// closeRequests counts the served POST /sandbox/close by mode.
var closeRequests = caddymetrics.NewSeriesCounts("caddy_ktls_sandbox_close_requests_total", []string{closeModeFail, closeModeGraceful})
