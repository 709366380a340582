package splice

import (
	"sync"
	"time"
)

// Limiter bounds the rate of one direction of one or more tunnels (a
// sandbox's every tunnel shares one). Before each step a direction asks
// Grant for up to want bytes: it moves at most the n granted, or, when n
// is 0, waits wait before asking again. What a step did not move goes back
// with Refund. A Limiter is safe for concurrent use.
type Limiter interface {
	Grant(want int) (n int, wait time.Duration)
	Refund(n int)
}

// minGrant is the least a RateLimiter hands out once it makes a direction
// wait: fewer, larger steps than one per token (a record's worth).
const minGrant = 16 << 10

// RateLimiter is a token bucket: bytesPerSecond sustained, up to burst at
// once.
type RateLimiter struct {
	rate, burst float64
	now         func() time.Time
	mu          sync.Mutex
	tokens      float64
	last        time.Time
}

// NewRateLimiter returns a full bucket of burst bytes refilled at
// bytesPerSecond. A burst below minGrant is raised to it.
func NewRateLimiter(bytesPerSecond, burst int64) *RateLimiter {
	b := float64(max(burst, minGrant))
	return &RateLimiter{rate: float64(bytesPerSecond), burst: b, tokens: b, now: time.Now}
}

// NewRateLimiterHolding is NewRateLimiter whose bucket holds tokens bytes
// (at most burst) instead of being full: a bucket that continues another
// one (TakeTokens).
func NewRateLimiterHolding(bytesPerSecond, burst, tokens int64) *RateLimiter {
	l := NewRateLimiter(bytesPerSecond, burst)
	l.tokens = min(l.burst, float64(max(tokens, 0)))
	l.last = l.now()
	return l
}

// TakeTokens empties the bucket and returns what it held, refilled up to
// now: for a bucket that continues elsewhere, so that the two together
// never grant more than one would. PutTokens gives them back.
func (l *RateLimiter) TakeTokens() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if !l.last.IsZero() {
		l.tokens = min(l.burst, l.tokens+now.Sub(l.last).Seconds()*l.rate)
	}
	l.last = now
	n := int64(l.tokens)
	l.tokens -= float64(n)
	return n
}

// PutTokens gives back what TakeTokens took, up to the burst.
func (l *RateLimiter) PutTokens(n int64) { l.Refund(int(n)) }

// Grant implements Limiter.
func (l *RateLimiter) Grant(want int) (int, time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if !l.last.IsZero() {
		l.tokens = min(l.burst, l.tokens+now.Sub(l.last).Seconds()*l.rate)
	}
	l.last = now
	// A grant smaller than minGrant (or want) waits for the bucket to
	// hold that much, so that a throttled direction moves in whole steps.
	need := float64(min(want, minGrant))
	if l.tokens < need {
		return 0, time.Duration((need - l.tokens) / l.rate * float64(time.Second))
	}
	n := int(min(float64(want), l.tokens))
	l.tokens -= float64(n)
	return n, 0
}

// Refund implements Limiter.
func (l *RateLimiter) Refund(n int) {
	if n <= 0 {
		return
	}
	l.mu.Lock()
	l.tokens = min(l.burst, l.tokens+float64(n))
	l.mu.Unlock()
}
