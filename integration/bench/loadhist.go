package main

import (
	"math/bits"
	"time"
)

// histogram is an HDR-style log-linear latency histogram: values below
// 2^histSubBits×2 ns are counted exactly (1 ns buckets); above, each
// power-of-two range [2^e, 2^(e+1)) ns is split into 2^histSubBits equal
// buckets, so a bucket is at most 1/2^histSubBits (0.78 %) of its lower
// bound wide. Values above histMax count in the top bucket; the exact
// maximum is kept apart. Not safe for concurrent use.
type histogram struct {
	counts [histBuckets]uint64
	n      uint64
	max    time.Duration
}

const (
	// histSubBits: 128 buckets per power of two, a relative error of at
	// most 1/128 (< 1 %) from 256 ns up to histMax.
	histSubBits = 7
	histSub     = 1 << histSubBits
	// histMax is the largest latency the buckets resolve (60 s).
	histMax = 60 * time.Second
	// histExact: values below it have a bucket each.
	histExact = 2 * histSub
	// histTopExp is the exponent of the power-of-two range histMax is in.
	histTopExp = 35 // 2^35 ns ≈ 34.4 s ≤ 60 s < 2^36 ns
	// histBuckets: up to the bucket that holds histMax.
	histBuckets = histExact + (histTopExp-histSubBits-1)*histSub + int(uint64(histMax)>>(histTopExp-histSubBits)) - histSub + 1
)

// histIndex is the bucket of a value of d ns (clamped to [0, histMax]).
func histIndex(d time.Duration) int {
	v := uint64(max(min(d, histMax), 0))
	if v < histExact {
		return int(v)
	}
	e := bits.Len64(v) - 1 // v in [2^e, 2^(e+1)), e ≥ histSubBits+1
	sub := int(v>>(e-histSubBits)) - histSub
	return histExact + (e-histSubBits-1)*histSub + sub
}

// histBounds are the values a bucket counts: [lo, hi] in ns, inclusive.
func histBounds(i int) (lo, hi time.Duration) {
	if i < histExact {
		return time.Duration(i), time.Duration(i)
	}
	e := (i-histExact)/histSub + histSubBits + 1
	sub := (i - histExact) % histSub
	width := uint64(1) << (e - histSubBits)
	l := uint64(histSub+sub) << (e - histSubBits)
	return time.Duration(l), time.Duration(l + width - 1)
}

// record counts one latency.
func (h *histogram) record(d time.Duration) {
	h.counts[histIndex(d)]++
	h.n++
	h.max = max(h.max, d)
}

// merge adds o's counts to h.
func (h *histogram) merge(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// percentile is the q-th percentile (0 < q ≤ 100): the upper bound of the
// bucket that holds the sample of rank ⌈q/100 × n⌉ in sorted order, at most
// the exact maximum. It is never below that sample and at most 1/128 above
// it (below histMax); 0 without samples.
func (h *histogram) percentile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q / 100 * float64(h.n))
	if float64(rank) < q/100*float64(h.n) {
		rank++
	}
	rank = max(rank, 1)
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			_, hi := histBounds(i)
			return min(hi, h.max)
		}
	}
	return h.max
}
