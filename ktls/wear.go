package ktls

import (
	"crypto/tls"
	"errors"
	"fmt"
)

// Key wear. RFC 8446 section 5.5 bounds what one AES-GCM traffic key may
// protect to 2^24.5 full records; the kernel counts records (the rec_seq
// that getsockopt(TLS_TX/TLS_RX) returns) but enforces nothing, and a
// tunnel may live for days. A Conn acts when a key has protected
// Options.RecordLimit records:
//
//   - its own (TX) key: on TLS 1.3 with a kernel that rekeys (Linux >= 6.14)
//     it sends KeyUpdate and installs the next key; otherwise the write
//     fails with ErrKeyExhausted before the key seals another record.
//   - the peer's (RX) key: on TLS 1.3 with a kernel that rekeys it asks the
//     peer to update (KeyUpdate with update_requested); a peer that has not
//     updated by twice the limit, and at least rxAnswerRecords past it (at
//     most MaxRecordLimit), and any peer that cannot be asked, fails the
//     read with ErrKeyExhausted.
//
// The count is read from the kernel only when an upper bound of it says the
// limit may be near: a write or splice of n bytes seals at most
// n/2^14 + 2 records, a read of n bytes opened at most n records. The
// kernel has opened a read's records before the count is seen: a read (or
// a relay's batch, splice.Opener) may take the peer's key past the limit
// by what it returned, at most one record per byte (records of full size:
// 16 per relay batch). Reads are not cut to the records left, which would
// split records between read(2) and the relay's splice(2). A zero-length
// record protects no plaintext and is counted at the next read that
// returns data.

// DefaultRecordLimit is Options.RecordLimit's zero value: 2^23 records, a
// third of the AES-GCM bound (and inside AES-CCM's 2^23.5).
const DefaultRecordLimit = 1 << 23

// MaxRecordLimit is the largest Options.RecordLimit, and the most records a
// peer's key may protect when the peer ignores a request to update.
const MaxRecordLimit = 1 << 24

// rxAnswerRecords is the fewest records a peer asked to update may still
// send under its key: what it had in flight when the request went out is
// sealed under the old key whatever it does, and socket buffers of a few
// MiB hold hundreds of full records, thousands of small ones: a small limit
// must not end a tunnel whose peer answers.
const rxAnswerRecords = 1 << 16

// rxEndAt is the count of the peer's records at which a request to update
// that the peer has not answered ends the connection.
func (o Options) rxEndAt() uint64 {
	limit := o.recordLimit()
	return min(limit+max(limit, rxAnswerRecords), MaxRecordLimit)
}

// ErrKeyExhausted fails a connection whose traffic key reached
// Options.RecordLimit and could not be renewed.
var ErrKeyExhausted = errors.New("ktls: a traffic key reached its record limit and could not be renewed")

// recordLimit returns o.RecordLimit or its default, at most MaxRecordLimit.
func (o Options) recordLimit() uint64 {
	if o.RecordLimit == 0 {
		return DefaultRecordLimit
	}
	return min(o.RecordLimit, MaxRecordLimit)
}

// maxSealChunk is the most one write or splice moves in the accounting
// (Write and ReadFrom cut larger ones; a relay's pipe holds less).
const maxSealChunk = 1 << 20

// sealedBound is an upper bound of the records a write or splice of n
// bytes seals: its full records, a partial one, and one an earlier call
// had left open.
func sealedBound(n int64) uint64 { return uint64(n)/maxRecordPayload + 2 }

// sealMargin is the most records one call seals in the accounting.
var sealMargin = sealedBound(maxSealChunk)

// errWriteAfterClose is a write after our close_notify.
var errWriteAfterClose = errors.New("ktls: write after close_notify")

// maxRecordPayload is the plaintext of a full record (2^14 bytes).
const maxRecordPayload = 1 << 14

// kernelSeq reads the kernel's record sequence number of direction opt
// (optTLSTX or optTLSRX): the records its current key has protected.
func (c *Conn) kernelSeq(opt int) (uint64, error) {
	cs, err := suiteFor(c.off.Version, c.off.CipherSuite)
	if err != nil {
		return 0, err
	}
	info, err := readCryptoInfo(c.rawSock, opt, cs)
	if err == nil && !info.is(cs) {
		err = info.mismatch(cs)
	}
	info.wipe()
	if err != nil {
		return 0, fmt.Errorf("ktls: reading the record sequence number: %w", err)
	}
	return info.seq, nil
}

// canRekey reports whether a kernel direction of c can take a next key.
func (c *Conn) canRekey() bool {
	return c.off.Version == tls.VersionTLS13 && Probe().Rekey
}

// BeginSeal is called before a splice(2) into c's socket (splice.Sealer),
// inside the socket's write callback: it holds writeMu until EndSeal and
// first sends the KeyUpdates wanted (without blocking: unix.EAGAIN when the
// socket has no room) and renews the TX key when it may reach the limit
// during the call.
func (c *Conn) BeginSeal(fd uintptr) error {
	c.writeMu.Lock()
	if err := c.writableLocked(); err != nil {
		c.writeMu.Unlock()
		return err
	}
	if err := c.beforeSealLocked(int(fd)); err != nil {
		c.writeMu.Unlock()
		return err
	}
	return nil
}

// EndSeal accounts for the n bytes the splice moved and releases writeMu.
func (c *Conn) EndSeal(n int64) {
	c.txBound += sealedBound(n)
	c.writeMu.Unlock()
}

// beforeSealLocked makes sure the TX key can seal another maxSealChunk
// bytes: it sends the KeyUpdates the reading side wants, reads the
// kernel's count once the bound says the limit may be near, then renews
// the key or fails. Caller holds writeMu. fd >= 0 is the socket, inside
// its write callback (BeginSeal): a KeyUpdate is then sent without waiting
// and unix.EAGAIN returned when it cannot be; fd < 0 waits for room.
func (c *Conn) beforeSealLocked(fd int) error {
	if err := c.sendWantedLocked(fd); err != nil {
		return err
	}
	limit := c.opts.recordLimit()
	if c.txBound+sealMargin < limit {
		return nil
	}
	seq, err := c.kernelSeq(optTLSTX)
	if err != nil {
		return err
	}
	c.txBound = seq
	if seq+sealMargin < limit {
		return nil
	}
	if !c.canRekey() {
		return c.exhausted("tx", seq)
	}
	return c.updateTXLocked(false, fd)
}

// openedLocked accounts for n plaintext bytes read under the RX key, and asks
// the peer to update, or fails, at the limit. Caller holds readMu.
func (c *Conn) openedLocked(n int64) error {
	c.rxBound += uint64(n)
	if c.rxBound < c.rxCheckAt() {
		return nil
	}
	seq := uint64(0)
	if c.opener != nil {
		seq = c.opener.seq
	} else {
		var err error
		if seq, err = c.kernelSeq(optTLSRX); err != nil {
			return err
		}
	}
	c.rxBound = seq
	limit := c.opts.recordLimit()
	switch {
	case seq >= c.opts.rxEndAt():
		return c.exhausted("rx", seq)
	case seq < limit || c.rxAsked:
		return nil
	case !c.canRekey():
		return c.exhausted("rx", seq)
	}
	c.rxAsked = true
	c.txWant.Or(wantAsk)
	c.trySendWanted()
	return nil
}

// trySendWanted sends the KeyUpdates wanted now, from the reading side,
// when no writer holds the write lock and the socket takes them without
// waiting; otherwise the next write sends them. It never waits: a relay's
// writer holds the write lock inside the socket's write callback
// (BeginSeal), so a reader waiting there for room would deadlock with it.
func (c *Conn) trySendWanted() {
	if !c.writeMu.TryLock() {
		return
	}
	defer c.writeMu.Unlock()
	// An error is left to the next write, which meets it again.
	_ = controlFD(c.rawSock, c.sendWantedLocked)
}

// sendWantedLocked sends the KeyUpdates in txWant, as updateTXLocked sends
// with fd, and clears what it sent. Caller holds writeMu.
func (c *Conn) sendWantedLocked(fd int) error {
	want := c.txWant.Load()
	if want == 0 {
		return nil
	}
	if err := c.updateTXLocked(want&wantAsk != 0, fd); err != nil {
		return err
	}
	c.txWant.And(^want)
	return nil
}

// txWant bits: KeyUpdates the reading side wants sent. The reader sends
// them if it can without waiting (trySendWanted); otherwise the next write
// or splice sends them before its records (beforeSealLocked), as RFC 8446
// section 4.6.3 asks of an answer.
const (
	wantAnswer = 1 << iota // the peer asked us to update
	wantAsk                // ask the peer to update (update_requested)
)

// peerEnded drops a request to update not sent yet once the peer's stream
// has ended (close_notify, or its FIN): its key will protect no more
// records, and a peer that has sent close_notify cannot answer. Go's
// crypto/tls even fails then: it leaves its read key unchanged when its
// answer cannot be written (handleKeyUpdate returns early), so the records
// behind our KeyUpdate fail its MAC check. An ask already sent to a peer
// that closes before reading it meets the same; docs/configuration.md
// says so under key_record_limit. Caller holds readMu.
func (c *Conn) peerEnded() {
	c.txWant.And(^uint32(wantAsk))
}

// rxCheckAt is the RX bound at which the kernel's count is read next.
func (c *Conn) rxCheckAt() uint64 {
	if c.rxAsked {
		return c.opts.rxEndAt()
	}
	return c.opts.recordLimit()
}

// Opened is splice.Opener: the relay spliced n plaintext bytes from c.
func (c *Conn) Opened(n int64) error {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if c.handedOff.Load() {
		return ErrHandedOff
	}
	return c.openedLocked(n)
}

// exhausted reports and returns ErrKeyExhausted for direction dir.
func (c *Conn) exhausted(dir string, seq uint64) error {
	stats.keyExhausted.Add(1)
	err := fmt.Errorf("%w (%s key: %d records, limit %d)", ErrKeyExhausted, dir, seq, c.opts.recordLimit())
	c.report(Event{Kind: EventKeyExhausted, Offload: c.off, Err: err})
	return err
}
