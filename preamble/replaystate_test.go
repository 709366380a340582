package preamble

import (
	"crypto/ed25519"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// nonceN is the n-th test nonce.
func nonceN(n int) (b [NonceLen]byte) {
	binary.BigEndian.PutUint64(b[8:], uint64(n)+1)
	return b
}

// fillReplay adds nonces 0..n-1 to rc, nonce i accepted at start+i*step
// seconds.
func fillReplay(t *testing.T, rc *ReplayCache, n int, start, step int64) {
	t.Helper()
	for i := range n {
		if err := rc.add(nonceN(i), start+int64(i)*step); err != nil {
			t.Fatalf("add nonce %d: %v", i, err)
		}
	}
}

// movedReplay is old's state at now, through its encoding, restored into a
// new cache of size and window.
func movedReplay(t *testing.T, old *ReplayCache, now int64, size int, window time.Duration) (*ReplayCache, error) {
	t.Helper()
	b, err := old.State(time.Unix(now, 0)).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var s ReplayState
	if err := s.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	rc, err := NewReplayCache(size, window)
	if err != nil {
		t.Fatal(err)
	}
	return rc, rc.Restore(s, time.Unix(now, 0))
}

// A moved cache refuses every nonce the old one still held, exactly as
// long as the old one would have, and no longer than one bucket beyond;
// the nonces the old one had let go are accepted.
func TestReplayStateMoves(t *testing.T) {
	const window = 180
	const start, step, n = 1_000_000, 3, 200 // accepted over 600 s
	old, err := NewReplayCache(1000, window*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	fillReplay(t, old, n, start, step)
	now := int64(start + n*step)
	moved, err := movedReplay(t, old, now, 1000, window*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if moved.Len() != old.State(time.Unix(now, 0)).Len() || moved.Len() == 0 || moved.Len() == n {
		t.Fatalf("moved cache holds %d nonces, the old one %d unexpired of %d", moved.Len(), old.State(time.Unix(now, 0)).Len(), n)
	}
	// Each nonce against both caches, at the same second: the same verdict
	// while the old one holds it; the moved one may hold it one bucket
	// longer, never shorter, and never less than window.
	for at := now; at <= now+window+2*replayWidth(window); at += 7 {
		for i := range n {
			accepted := int64(start + i*step)
			o, m := holds(old, i, at), holds(moved, i, at)
			switch {
			case o && !m:
				t.Fatalf("at +%ds: nonce %d (accepted at +%ds) is held by the old cache, not by the moved one", at-now, i, accepted-now)
			case at < accepted+window && !m:
				t.Fatalf("at +%ds: nonce %d accepted %ds before is not held, window %ds", at-now, i, at-accepted, window)
			case m && at >= accepted+replayHold(window):
				t.Fatalf("at +%ds: nonce %d accepted %ds before is still held, hold %ds", at-now, i, at-accepted, replayHold(window))
			}
		}
	}
}

// holds reports whether rc refuses nonce i as a replay at sec, without
// adding it (a probe on a copy would not age the buckets alike).
func holds(rc *ReplayCache, i int, sec int64) bool {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for j := range rc.buckets {
		b := &rc.buckets[j]
		if b.epoch >= 0 && !rc.expired(b, sec) {
			if _, ok := b.nonces[nonceN(i)]; ok {
				return true
			}
		}
	}
	return false
}

// Through a Verifier: a frame accepted before the move is refused as a
// replay after it.
func TestReplayStateRefusesReplayAfterMove(t *testing.T) {
	keys := map[string]ed25519.PublicKey{exampleKeyID: examplePub}
	now := func() time.Time { return exampleNow }
	old, err := NewReplayCache(16, 3*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	before := mustVerifier(t, VerifierConfig{Keys: keys, ReplayCache: old, Now: now})
	frame := readGolden(t, "valid-ipv6-bound")
	if _, err := before.Verify(frame, exampleBinding); err != nil {
		t.Fatal(err)
	}
	moved, err := movedReplay(t, old, exampleNow.Unix(), 16, 3*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	after := mustVerifier(t, VerifierConfig{Keys: keys, ReplayCache: moved, Now: now})
	_, err = after.Verify(frame, exampleBinding)
	wantReason(t, err, ReasonReplayedNonce)
	fresh := mustVerifier(t, VerifierConfig{Keys: keys, Now: now})
	if _, err := fresh.Verify(frame, exampleBinding); err != nil {
		t.Fatalf("the frame is refused without the moved nonces too (%v): the test proves nothing", err)
	}
}

// A cache of a longer window holds the moved nonces for its own window; a
// shorter one leaves out what expired under it.
func TestReplayStateOtherWindow(t *testing.T) {
	old, err := NewReplayCache(100, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	const start = 2_000_000
	fillReplay(t, old, 30, start, 2) // accepted over 60 s
	now := int64(start + 60)
	longer, err := movedReplay(t, old, now, 100, 300*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 30 {
		if accepted := int64(start + 2*i); !holds(longer, i, accepted+299) {
			t.Errorf("nonce %d: not held 299 s after its acceptance by a cache of a 300 s window", i)
		}
	}
	shorter, err := movedReplay(t, old, now, 100, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 30 {
		accepted := int64(start + 2*i)
		if now < accepted+10 && !holds(shorter, i, now) {
			t.Errorf("nonce %d accepted %d s ago: not held by a cache of a 10 s window", i, now-accepted)
		}
	}
	if shorter.Len() >= longer.Len() {
		t.Errorf("the 10 s cache took %d nonces, the 300 s one %d: the expired ones were not left out", shorter.Len(), longer.Len())
	}
}

// What does not fit is refused whole; a clock that went back too.
func TestReplayStateRefused(t *testing.T) {
	old, err := NewReplayCache(100, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	const start = 3_000_000
	fillReplay(t, old, 50, start, 1)
	now := int64(start + 50)
	small, err := movedReplay(t, old, now, 49, 60*time.Second)
	if !errors.Is(err, ErrReplayStateTooLarge) || small.Len() != 0 {
		t.Errorf("restore into a 49-nonce cache: %v, %d nonces taken; want ErrReplayStateTooLarge and none", err, small.Len())
	}
	rc, _ := NewReplayCache(100, 60*time.Second)
	err = rc.Restore(old.State(time.Unix(now, 0)), time.Unix(start, 0))
	if err == nil || !strings.Contains(err.Error(), "clock went back") || rc.Len() != 0 {
		t.Errorf("restore at a time before the nonces' acceptance: %v, %d nonces taken; want the clock named and none", err, rc.Len())
	}
}

func TestReplayStateEncoding(t *testing.T) {
	s := ReplayState{Buckets: []ReplayStateBucket{{AcceptedBy: 17, Nonces: [][NonceLen]byte{nonceN(1), nonceN(2)}}, {AcceptedBy: -1}}}
	b, err := s.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if want := 1 + 4 + 2*12 + 2*NonceLen; len(b) != want {
		t.Fatalf("encoded %d bytes, want %d", len(b), want)
	}
	var got ReplayState
	if err := got.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint(s) {
		t.Fatalf("round trip: %v, want %v", got, s)
	}
	bad := map[string][]byte{
		"version 2":       append([]byte{2}, b[1:]...),
		"empty":           nil,
		"cut in a nonce":  b[:len(b)-1],
		"cut in a bucket": b[:1+4+5],
		"a byte after":    append(append([]byte{}, b...), 0),
		"nonces past end": binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint64([]byte{1, 0, 0, 0, 1}, 0), 1<<31),
	}
	for name, enc := range bad {
		got := ReplayState{Buckets: []ReplayStateBucket{{AcceptedBy: 99}}}
		if err := got.UnmarshalBinary(enc); err == nil || got.Buckets[0].AcceptedBy != 99 {
			t.Errorf("%s: decoded (%v), or changed the state", name, err)
		}
	}
}
