//go:build race

package splice

// raceEnabled shrinks the big transfers: the race detector makes every
// userspace byte an order of magnitude slower.
const raceEnabled = true
