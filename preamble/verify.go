package preamble

import (
	"bytes"
	"crypto/ed25519"
	"crypto/subtle"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Verifier defaults, used where a VerifierConfig field is zero.
const (
	DefaultMaxSkew         = 30 * time.Second
	DefaultMaxTTL          = 2 * time.Minute
	DefaultReplayCacheSize = 1 << 16
	// replayBuckets is the number of expiry-time buckets of the replay cache.
	replayBuckets = 16
)

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	// Keys maps key IDs to Ed25519 public keys. Several keys at once let a
	// gateway fleet rotate without downtime: add the new key, move the
	// gateways over, then drop the old key.
	Keys map[string]ed25519.PublicKey
	// MaxFrameLen caps a frame (header included); zero means MaxFrameLen,
	// larger values are refused.
	MaxFrameLen int
	// MaxSkew is the clock difference tolerated in both directions between
	// gateway and forwarder. Zero means DefaultMaxSkew; negative is refused.
	MaxSkew time.Duration
	// MaxTTL is the longest validity window (ExpiresAt - IssuedAt) accepted.
	// Zero means DefaultMaxTTL.
	MaxTTL time.Duration
	// ReplayCacheSize is the most nonces remembered at once. A nonce is
	// remembered for MaxTTL + 2*MaxSkew after its frame was accepted (see
	// ReplayCache), plus up to one bucket of 1/14 of that and a second; when
	// no slot is free the verifier rejects with ReasonReplayCacheFull rather
	// than forget a nonce that could still be replayed. Size it above the
	// peak rate of accepted frames times W + W/14 + 1s, W = MaxTTL +
	// 2*MaxSkew (193 s with the defaults). Memory is proportional to it
	// (tens of bytes per slot, see docs/preamble.md).
	// Zero means DefaultReplayCacheSize. Must be zero when ReplayCache is set.
	ReplayCacheSize int
	// ReplayCache, when set, is used instead of a cache of the Verifier's
	// own. Share one between the Verifiers of successive configurations so
	// that a reload does not forget nonces that are still live. Its window
	// must cover MaxTTL + 2*MaxSkew.
	ReplayCache *ReplayCache
	// RequireBinding rejects frames without a channel binding.
	RequireBinding bool
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Verifier checks preambles. It is safe for concurrent use; its replay cache
// is shared by all connections that use it.
type Verifier struct {
	keys           map[string]keyringEntry
	maxFrameLen    int
	maxSkew        int64 // seconds
	maxTTL         int64 // seconds
	requireBinding bool
	now            func() time.Time
	replay         *ReplayCache
}

// keyringEntry keeps the key ID string next to its key so that Verify can
// return it without allocating or aliasing the frame.
type keyringEntry struct {
	id  string
	key ed25519.PublicKey
}

// NewVerifier validates cfg and returns a Verifier.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	if len(cfg.Keys) == 0 {
		return nil, errors.New("preamble: verifier needs at least one key")
	}
	for id, k := range cfg.Keys {
		if len(id) == 0 || len(id) > MaxKeyIDLen || !validID([]byte(id)) {
			return nil, fmt.Errorf("preamble: key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", id, MaxKeyIDLen)
		}
		if len(k) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("preamble: key %q is %d bytes, want an Ed25519 public key of %d", id, len(k), ed25519.PublicKeySize)
		}
	}
	v := &Verifier{
		keys:           make(map[string]keyringEntry, len(cfg.Keys)),
		maxFrameLen:    cfg.MaxFrameLen,
		requireBinding: cfg.RequireBinding,
		now:            cfg.Now,
	}
	for id, k := range cfg.Keys {
		v.keys[id] = keyringEntry{id: id, key: bytes.Clone(k)}
	}
	switch {
	case v.maxFrameLen == 0:
		v.maxFrameLen = MaxFrameLen
	case v.maxFrameLen < HeaderLen+minBodyLen || v.maxFrameLen > MaxFrameLen:
		return nil, fmt.Errorf("preamble: MaxFrameLen %d outside [%d, %d]", v.maxFrameLen, HeaderLen+minBodyLen, MaxFrameLen)
	}
	skew, ttl := cfg.MaxSkew, cfg.MaxTTL
	if skew == 0 {
		skew = DefaultMaxSkew
	}
	if ttl == 0 {
		ttl = DefaultMaxTTL
	}
	if skew < 0 || ttl < time.Second {
		return nil, fmt.Errorf("preamble: MaxSkew %v must be >= 0 and MaxTTL %v >= 1s", skew, ttl)
	}
	v.maxSkew, v.maxTTL = int64(skew/time.Second), int64(ttl/time.Second)
	if v.now == nil {
		v.now = time.Now
	}
	window := int64(ReplayWindow(ttl, skew) / time.Second)
	if cfg.ReplayCache != nil {
		if cfg.ReplayCacheSize != 0 {
			return nil, errors.New("preamble: set ReplayCacheSize or ReplayCache, not both")
		}
		if cfg.ReplayCache.window < window {
			return nil, fmt.Errorf("preamble: shared replay cache covers %ds, MaxTTL + 2*MaxSkew needs %ds", cfg.ReplayCache.window, window)
		}
		v.replay = cfg.ReplayCache
		return v, nil
	}
	size := cfg.ReplayCacheSize
	if size == 0 {
		size = DefaultReplayCacheSize
	}
	var err error
	if v.replay, err = NewReplayCache(size, time.Duration(window)*time.Second); err != nil {
		return nil, err
	}
	return v, nil
}

// MaxFrameLen returns the frame cap to pass to ReadFrame.
func (v *Verifier) MaxFrameLen() int { return v.maxFrameLen }

// Key returns the public key the keyring holds under id: the one that
// verified a frame whose Claims.KeyID is id.
func (v *Verifier) Key(id string) (ed25519.PublicKey, bool) {
	e, ok := v.keys[id]
	return e.key, ok
}

// Verify checks a whole frame as returned by ReadFrame. binding is this
// connection's ChannelBinding, or nil when it has none (TLS 1.2). Checks run
// cheapest first and the nonce is recorded last, so that only authentic,
// fresh frames take replay-cache space.
//
// The returned Claims alias frame (SandboxID, Binding, extension values):
// do not modify frame while they are in use. This keeps the happy path free
// of allocations.
func (v *Verifier) Verify(frame []byte, binding []byte) (Claims, error) {
	p, err := parse(frame, v.maxFrameLen)
	if err != nil {
		return Claims{}, err
	}
	entry, ok := v.keys[string(p.keyID)]
	if !ok {
		return Claims{}, refuse(ReasonUnknownKey, "no key %q in the keyring", p.keyID)
	}
	if !verifySignature(entry.key, p.signed, p.signature) {
		return Claims{}, refuse(ReasonBadSignature, "signature does not verify with key %q", p.keyID)
	}
	c := p.claims
	c.KeyID = entry.id
	now := v.now().Unix()
	iat, exp := c.IssuedAt.Unix(), c.ExpiresAt.Unix()
	switch {
	case iat > now+v.maxSkew:
		return Claims{}, refuse(ReasonNotYetValid, "issued %ds in the future (skew allowed %ds)", iat-now, v.maxSkew)
	case exp < now-v.maxSkew:
		return Claims{}, refuse(ReasonExpired, "expired %ds ago (skew allowed %ds)", now-exp, v.maxSkew)
	case exp-iat > v.maxTTL:
		return Claims{}, refuse(ReasonTTLTooLong, "validity of %ds exceeds the maximum %ds", exp-iat, v.maxTTL)
	}
	switch {
	case c.Binding != nil && binding == nil:
		return Claims{}, refuse(ReasonBindingMismatch, "frame is bound but this connection has no channel binding (TLS 1.3 needed)")
	case c.Binding != nil && subtle.ConstantTimeCompare(c.Binding, binding) != 1:
		return Claims{}, refuse(ReasonBindingMismatch, "frame is bound to another TLS session")
	case c.Binding == nil && v.requireBinding:
		return Claims{}, refuse(ReasonBindingRequired, "frame carries no channel binding")
	}
	if err := v.replay.add(c.Nonce, now); err != nil {
		return Claims{}, err
	}
	return c, nil
}

// verifySignature checks the Ed25519 signature over SignatureContext||signed.
// The message is assembled in a stack buffer (frames are capped at
// MaxFrameLen) to keep verification allocation-free.
func verifySignature(key ed25519.PublicKey, signed, sig []byte) bool {
	var buf [len(SignatureContext) + MaxFrameLen]byte
	n := copy(buf[:], SignatureContext)
	n += copy(buf[n:], signed)
	return ed25519.Verify(key, buf[:n], sig)
}

// ReplayWindow is how long a verifier of maxTTL and maxSkew (zero: their
// defaults) remembers a nonce it accepted: MaxTTL + 2*MaxSkew, in the whole
// seconds it checks, and at least 1s. A ReplayCache shared by verifiers
// must cover the window of each.
func ReplayWindow(maxTTL, maxSkew time.Duration) time.Duration {
	if maxTTL == 0 {
		maxTTL = DefaultMaxTTL
	}
	if maxSkew == 0 {
		maxSkew = DefaultMaxSkew
	}
	return max((maxTTL/time.Second+2*(maxSkew/time.Second))*time.Second, time.Second)
}

// ReplayCache remembers accepted nonces, in bounded memory. A nonce accepted
// at time t is refused (ReasonReplayedNonce) until at least t + window,
// whatever IssuedAt and ExpiresAt the frame that brings it again carries:
// every frame that was valid at t, under verifiers whose MaxTTL + 2*MaxSkew
// is at most window, has expired by then, so a nonce is never accepted twice
// while a frame carrying it could still pass the time checks. It is safe for
// concurrent use and may be shared by several Verifiers
// (VerifierConfig.ReplayCache).
//
// Nonces are grouped into buckets by acceptance second; a bucket is
// recycled whole once its newest nonce is older than window, so a nonce is
// held for window plus at most one bucket width (window/14 + 1 s). A lookup
// consults every bucket (at most 16 map lookups), since a frame that reuses
// a nonce may carry any validity window.
type ReplayCache struct {
	mu       sync.Mutex
	capacity int
	hint     int // initial size of each bucket's map
	count    int
	window   int64 // seconds: MaxTTL + 2*MaxSkew of the verifiers it serves
	width    int64 // seconds of acceptance time per bucket
	buckets  [replayBuckets]replayBucket
}

type replayBucket struct {
	epoch  int64 // acceptance second / width; -1 when empty
	nonces map[[NonceLen]byte]struct{}
}

// NewReplayCache returns a cache for at most size nonces, for verifiers whose
// MaxTTL + 2*MaxSkew is at most window.
func NewReplayCache(size int, window time.Duration) (*ReplayCache, error) {
	if size <= 0 {
		return nil, fmt.Errorf("preamble: replay cache size %d must be positive", size)
	}
	if window < time.Second {
		return nil, fmt.Errorf("preamble: replay cache window %v must be at least 1s", window)
	}
	rc := &ReplayCache{}
	rc.init(size, int64(window/time.Second))
	return rc, nil
}

// replayWidth is the acceptance time, in seconds, that one bucket of a
// cache with this window covers. The buckets that may hold unexpired nonces
// span window + width seconds, at most replayBuckets-1 of them, so the
// bucket a new nonce goes to never still holds one.
func replayWidth(window int64) int64 { return window/(replayBuckets-2) + 1 }

// replayHold is the longest a cache with this window (seconds) holds a
// nonce: window plus one bucket width. docs/preamble.md §6 sizes the cache
// by it.
func replayHold(window int64) int64 { return window + replayWidth(window) }

func (rc *ReplayCache) init(capacity int, window int64) {
	rc.capacity = capacity
	rc.window = window
	rc.hint = capacity / replayBuckets
	rc.width = replayWidth(window)
	for i := range rc.buckets {
		rc.buckets[i] = replayBucket{epoch: -1, nonces: make(map[[NonceLen]byte]struct{}, rc.hint)}
	}
}

// expired reports whether every nonce of b was accepted more than window
// seconds before now.
func (rc *ReplayCache) expired(b *replayBucket, now int64) bool {
	return (b.epoch+1)*rc.width+rc.window <= now
}

// add records nonce as accepted at now (unix seconds), or rejects it as a
// replay if any bucket still holds it.
func (rc *ReplayCache) add(nonce [NonceLen]byte, now int64) error {
	if now < 0 {
		// A clock before 1970: hold such nonces as if accepted at 0, which
		// keeps them at least as long as their true acceptance time would.
		now = 0
	}
	epoch := now / rc.width
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for i := range rc.buckets {
		b := &rc.buckets[i]
		switch {
		case b.epoch < 0:
		case rc.expired(b, now):
			rc.recycle(b)
			b.epoch = -1
		default:
			if _, seen := b.nonces[nonce]; seen {
				return refuse(ReasonReplayedNonce, "nonce %x was already accepted (a nonce is refused for %ds after its acceptance)", nonce, rc.window)
			}
		}
	}
	b := &rc.buckets[epoch%replayBuckets]
	if b.epoch != epoch {
		if b.epoch >= 0 {
			// Unreachable when the clock is monotonic (expired buckets were
			// just recycled); fail closed if a clock jump makes it reachable.
			return refuse(ReasonReplayCacheFull, "acceptance-time bucket still holds unexpired nonces")
		}
		b.epoch = epoch
	}
	if rc.count >= rc.capacity {
		return refuse(ReasonReplayCacheFull, "%d unexpired nonces, capacity %d", rc.count, rc.capacity)
	}
	b.nonces[nonce] = struct{}{}
	rc.count++
	return nil
}

// recycle empties a bucket. A map keeps its storage when cleared, so a
// bucket that once took far more than its share gets a fresh map: the cache's
// memory then tracks its live nonces (bounded by capacity) plus a fixed
// per-bucket reserve, not the largest burst ever seen in every bucket.
func (rc *ReplayCache) recycle(b *replayBucket) {
	rc.count -= len(b.nonces)
	if len(b.nonces) > 2*rc.hint {
		b.nonces = make(map[[NonceLen]byte]struct{}, rc.hint)
	} else {
		clear(b.nonces)
	}
}

// Len returns the number of nonces held.
func (rc *ReplayCache) Len() int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.count
}
