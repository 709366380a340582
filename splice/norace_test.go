//go:build !race

package splice

const raceEnabled = false
