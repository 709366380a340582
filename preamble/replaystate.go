package preamble

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// A ReplayCache moves to a new process (a binary upgrade that hands its
// tunnels over) as a ReplayState: the nonces it still holds, each with the
// acceptance time it is held from, so that a preamble replayed after the
// move is refused exactly as it would have been before.

// ReplayState is the content of a ReplayCache: per acceptance bucket, the
// latest second its nonces may have been accepted at and the nonces.
type ReplayState struct {
	Buckets []ReplayStateBucket
}

// ReplayStateBucket holds nonces accepted no later than AcceptedBy (Unix
// seconds).
type ReplayStateBucket struct {
	AcceptedBy int64
	Nonces     [][NonceLen]byte
}

// Len returns the number of nonces s holds.
func (s ReplayState) Len() int {
	n := 0
	for _, b := range s.Buckets {
		n += len(b.Nonces)
	}
	return n
}

// State returns the nonces rc holds that are not expired at now.
func (rc *ReplayCache) State(now time.Time) ReplayState {
	sec := now.Unix()
	rc.mu.Lock()
	defer rc.mu.Unlock()
	var s ReplayState
	for i := range rc.buckets {
		b := &rc.buckets[i]
		if b.epoch < 0 || rc.expired(b, sec) || len(b.nonces) == 0 {
			continue
		}
		// The bucket's last second, or now for the bucket being filled.
		sb := ReplayStateBucket{AcceptedBy: min((b.epoch+1)*rc.width-1, sec), Nonces: make([][NonceLen]byte, 0, len(b.nonces))}
		for n := range b.nonces {
			sb.Nonces = append(sb.Nonces, n)
		}
		s.Buckets = append(s.Buckets, sb)
	}
	return s
}

// ErrReplayStateTooLarge is returned by Restore when the nonces do not fit
// the cache's capacity beside the ones it holds.
var ErrReplayStateTooLarge = errors.New("preamble: replay state larger than the cache's free capacity")

// Restore adds s's nonces to rc, each held as if accepted at its bucket's
// AcceptedBy (the latest its acceptance may have been, so it is held at
// least as long as in the cache it came from, and at least rc's window).
// Nonces already expired at now under rc's window are left out. It adds
// nothing and fails when they do not fit rc's capacity (a cache that
// dropped some would accept their replays), or when an AcceptedBy lies
// after now (a clock that went back: s cannot be placed).
func (rc *ReplayCache) Restore(s ReplayState, now time.Time) error {
	sec := now.Unix()
	rc.mu.Lock()
	defer rc.mu.Unlock()
	// Recycle what expired first, as add does, so the checks below see
	// only live buckets.
	for i := range rc.buckets {
		if b := &rc.buckets[i]; b.epoch >= 0 && rc.expired(b, sec) {
			rc.recycle(b)
			b.epoch = -1
		}
	}
	need := 0
	for _, sb := range s.Buckets {
		if sb.AcceptedBy > sec {
			return fmt.Errorf("preamble: replay state accepted a nonce at %d, after now (%d): the clock went back", sb.AcceptedBy, sec)
		}
		epoch := max(sb.AcceptedBy, 0) / rc.width
		if (epoch+1)*rc.width+rc.window <= sec {
			continue // expired under rc's window
		}
		if b := &rc.buckets[epoch%replayBuckets]; b.epoch >= 0 && b.epoch != epoch {
			// Only when s comes from a cache of another window.
			return fmt.Errorf("preamble: replay state's bucket %d falls on unexpired bucket %d", epoch, b.epoch)
		}
		need += len(sb.Nonces)
	}
	if rc.count+need > rc.capacity {
		return fmt.Errorf("%w: %d nonces to add, %d held, capacity %d", ErrReplayStateTooLarge, need, rc.count, rc.capacity)
	}
	for _, sb := range s.Buckets {
		epoch := max(sb.AcceptedBy, 0) / rc.width
		if (epoch+1)*rc.width+rc.window <= sec {
			continue // expired under rc's window
		}
		b := &rc.buckets[epoch%replayBuckets]
		b.epoch = epoch
		for _, n := range sb.Nonces {
			if _, dup := b.nonces[n]; !dup {
				b.nonces[n] = struct{}{}
				rc.count++
			}
		}
	}
	return nil
}

// replayStateVersion is the first byte of a marshaled ReplayState.
const replayStateVersion = 1

// MarshalBinary encodes s: a version byte, the bucket count, then per
// bucket AcceptedBy, the nonce count and the nonces (big endian).
func (s ReplayState) MarshalBinary() ([]byte, error) {
	b := make([]byte, 0, 1+4+len(s.Buckets)*12+s.Len()*NonceLen)
	b = append(b, replayStateVersion)
	b = binary.BigEndian.AppendUint32(b, uint32(len(s.Buckets)))
	for _, sb := range s.Buckets {
		b = binary.BigEndian.AppendUint64(b, uint64(sb.AcceptedBy))
		b = binary.BigEndian.AppendUint32(b, uint32(len(sb.Nonces)))
		for _, n := range sb.Nonces {
			b = append(b, n[:]...)
		}
	}
	return b, nil
}

// UnmarshalBinary decodes what MarshalBinary wrote; any other version, a
// short or a long encoding is an error.
func (s *ReplayState) UnmarshalBinary(b []byte) error {
	if len(b) < 5 {
		return errors.New("preamble: replay state: too short")
	}
	if b[0] != replayStateVersion {
		return fmt.Errorf("preamble: replay state version %d, this build reads %d", b[0], replayStateVersion)
	}
	nb := binary.BigEndian.Uint32(b[1:])
	b = b[5:]
	var out ReplayState
	for range nb {
		if len(b) < 12 {
			return errors.New("preamble: replay state: bucket cut short")
		}
		sb := ReplayStateBucket{AcceptedBy: int64(binary.BigEndian.Uint64(b))}
		nn := binary.BigEndian.Uint32(b[8:])
		b = b[12:]
		if uint64(len(b)) < uint64(nn)*NonceLen {
			return errors.New("preamble: replay state: nonces cut short")
		}
		sb.Nonces = make([][NonceLen]byte, nn)
		for i := range sb.Nonces {
			copy(sb.Nonces[i][:], b[:NonceLen])
			b = b[NonceLen:]
		}
		out.Buckets = append(out.Buckets, sb)
	}
	if len(b) != 0 {
		return fmt.Errorf("preamble: replay state: %d bytes after the last bucket", len(b))
	}
	*s = out
	return nil
}
