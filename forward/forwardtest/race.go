//go:build race

package forwardtest

// RaceEnabled reports whether the race detector is on (tests move less data).
const RaceEnabled = true
