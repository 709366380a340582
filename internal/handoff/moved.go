package handoff

import (
	"sync"
	"time"
)

// MoveResult is what offering many objects did: how many moved, those that
// stay in this process by why (the Stay reasons) and each one with its
// error, and how long each one that moved stood still (a relay paused), in
// the order they moved. N is what names an object that stays (a tunnel's ID, a gateway's
// address, a route).
type MoveResult[N any] struct {
	Moved  int
	Stayed map[string]int
	Stays  []Stay[N]
	Pauses []time.Duration
}

// Stay is an object that stays in the process that offered it: which, why,
// and the error that said so.
type Stay[N any] struct {
	Object N
	Why    string
	Err    error
}

// Stay counts s: one more object that stays, by its why.
func (m *MoveResult[N]) Stay(s Stay[N]) {
	if m.Stayed == nil {
		m.Stayed = map[string]int{}
	}
	m.Stayed[s.Why]++
	m.Stays = append(m.Stays, s)
}

// Offered is what offering one object did.
type Offered struct {
	// Skipped: it was no object to move by then (a standby connection
	// whose first byte came); it is not counted.
	Skipped bool
	// Why it stays (a Stay reason, and Err); "" when it moved.
	Why string
	Err error
	// Pause is how long it stood still, when it moved; zero for an
	// object that carries nothing (a standby connection's wait), which
	// MoveResult.Pauses leaves out.
	Pause time.Duration
}

// MoveAll offers each object with offer, up to m.Window() at once, and
// counts what became of them, an object that stays named by name.
func MoveAll[T, N any](m Mover, objects []T, name func(T) N, offer func(T) Offered) MoveResult[N] {
	var res MoveResult[N]
	var mu sync.Mutex
	each(m, objects, func(o T) {
		out := offer(o)
		mu.Lock()
		defer mu.Unlock()
		switch {
		case out.Skipped:
		case out.Why == "":
			res.Moved++
			if out.Pause > 0 {
				res.Pauses = append(res.Pauses, out.Pause)
			}
		default:
			res.Stay(Stay[N]{Object: name(o), Why: out.Why, Err: out.Err})
		}
	})
	return res
}

// each calls offer for each object, up to m.Window() calls at once, and
// returns once every call has: both processes are at work at once.
func each[T any](m Mover, objects []T, offer func(T)) {
	n := min(max(m.Window(), 1), len(objects))
	if n <= 1 {
		for _, o := range objects {
			offer(o)
		}
		return
	}
	next := make(chan T)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for o := range next {
				offer(o)
			}
		})
	}
	for _, o := range objects {
		next <- o
	}
	close(next)
	wg.Wait()
}
