package ktls

import "time"

// tokenBucket enforces a Rate. Not safe for concurrent use: the read lock
// serialises it.
type tokenBucket struct {
	rate   Rate
	tokens float64
	last   time.Time
}

func newTokenBucket(r Rate) tokenBucket {
	if r.PerSecond <= 0 || r.Burst <= 0 {
		r = DefaultKeyUpdateLimit
	}
	return tokenBucket{rate: r, tokens: float64(r.Burst)}
}

// allow takes one token at time now.
func (b *tokenBucket) allow(now time.Time) bool {
	if !b.last.IsZero() {
		b.tokens = min(float64(b.rate.Burst), b.tokens+now.Sub(b.last).Seconds()*b.rate.PerSecond)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
