package caddymetrics

import (
	"fmt"
	"maps"
	"sync"
)

// SeriesCounts counts events per metric series (K: the labels). It is made
// with every series its observers can report, each from zero (alerts on
// rate() need them), from the tables of those observers. Add never drops an
// event: a series that was not declared is counted all the same, and
// reported as the bug it is (Undeclared).
type SeriesCounts[K comparable] struct {
	metric string
	mu     sync.Mutex
	n      map[K]uint64
}

func NewSeriesCounts[K comparable](metric string, keys []K) *SeriesCounts[K] {
	c := &SeriesCounts[K]{metric: metric, n: make(map[K]uint64, len(keys))}
	for _, k := range keys {
		c.n[k] = 0
	}
	return c
}

// Add counts one event of k.
func (c *SeriesCounts[K]) Add(k K) {
	c.mu.Lock()
	_, declared := c.n[k]
	c.n[k]++
	c.mu.Unlock()
	if !declared {
		Undeclared(c.metric, fmt.Sprintf("%+v", k))
	}
}

func (c *SeriesCounts[K]) Snapshot() map[K]uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.n)
}
