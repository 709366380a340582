package main

import (
	"math/rand/v2"
	"time"
)

// poissonSchedule is the arrival times, from the start of a step, of a
// Poisson process of rate arrivals per second over dur: exponential gaps of
// mean 1/rate, drawn from a PCG seeded with seed, so a seed gives the same
// schedule every time.
func poissonSchedule(rate float64, dur time.Duration, seed uint64) []time.Duration {
	if rate <= 0 || dur <= 0 {
		return nil
	}
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	out := make([]time.Duration, 0, int(rate*dur.Seconds()*1.1)+16)
	var t float64 // seconds
	for {
		t += rng.ExpFloat64() / rate
		at := time.Duration(t * float64(time.Second))
		if at >= dur {
			return out
		}
		out = append(out, at)
	}
}
