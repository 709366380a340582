package splice

import (
	"bytes"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The control-record branch needs a kTLS socket to happen for real (see the
// TestKernel tests). These host tests drive the same code by injecting the
// errors splice(2) returns on a kTLS source at a non-data record, through
// the tunnel's splice function, and by standing in for the kTLS conn's Read.

// controlSource poses as a kTLS connection whose RX runs in the kernel: it
// offers its TCP socket for splicing and answers the relay's Read (which the
// relay only calls when splice failed) from a script.
type controlSource struct {
	*net.TCPConn
	reads chan readResult
}

type readResult struct {
	data []byte
	err  error
}

func (c *controlSource) SpliceSource() (syscall.RawConn, bool) {
	rc, err := c.SyscallConn()
	return rc, err == nil
}

func (c *controlSource) Read(p []byte) (int, error) {
	select {
	case r := <-c.reads:
		return copy(p, r.data), r.err
	case <-time.After(10 * time.Second):
		return 0, errors.New("controlSource: Read called with nothing scripted")
	}
}

// injector fails the next splice(2) that reads from fd with a queued error.
type injector struct {
	fd   int
	errs chan error
}

func newInjector(t *testing.T, c *net.TCPConn) *injector {
	return &injector{fd: socketFD(t, c), errs: make(chan error, 1024)}
}

// socketFD returns the file descriptor under c, to recognise it in a
// tunnel's splice calls.
func socketFD(t *testing.T, c *net.TCPConn) int {
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var sfd int
	rc.Control(func(fd uintptr) { sfd = int(fd) })
	return sfd
}

func (inj *injector) splice(rfd, wfd, n, flags int) (int64, error) {
	if rfd == inj.fd {
		select {
		case err := <-inj.errs:
			return 0, err
		default:
		}
	}
	return spliceSyscall(rfd, wfd, n, flags)
}

// controlTunnel sets up client → controlSource(relayA) → relayB → upstream.
func controlTunnel(t *testing.T) (topology, *controlSource, *injector, func() (Stats, error)) {
	tp := newTopology(t)
	src := &controlSource{TCPConn: tp.relayA, reads: make(chan readResult, 16)}
	inj := newInjector(t, tp.relayA)
	tun := newRelay(src, tp.relayB, Options{Pipes: newTestPool(t, 2)}, inj.splice)
	return tp, src, inj, runRelay(t.Context(), tun)
}

func readN(t *testing.T, r io.Reader, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		t.Fatalf("read %d bytes: %v", n, err)
	}
	return b
}

// TestControlRecordDataKeepsOrder: a control step that yields data (the
// conn's Read returned bytes) lands between the bytes spliced before and
// after it, and is counted as copied.
func TestControlRecordDataKeepsOrder(t *testing.T) {
	checkLeaks(t)
	tp, src, inj, wait := controlTunnel(t)
	before := bytes.Repeat([]byte("A"), 100<<10)
	after := bytes.Repeat([]byte("B"), 100<<10)
	if _, err := tp.client.Write(before); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, tp.upstream, len(before)); !bytes.Equal(got, before) {
		t.Fatal("first block corrupted")
	}
	inj.errs <- unix.EINVAL
	src.reads <- readResult{data: []byte("XYZ")}
	if _, err := tp.client.Write(after); err != nil {
		t.Fatal(err)
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	got, err := io.ReadAll(tp.upstream)
	if err != nil {
		t.Fatal(err)
	}
	if want := "XYZ" + string(after); string(got) != want {
		t.Fatalf("upstream got %d bytes starting %q, want %d starting %q", len(got), got[:min(8, len(got))], len(want), want[:8])
	}
	res, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	ds := res.AToB
	if ds.Bytes != 200<<10+3 || ds.SpliceBytes != 200<<10 || ds.CopyBytes != 3 || ds.ControlRecords != 1 || ds.End != EndEOF {
		t.Errorf("a->b %+v", ds)
	}
}

// TestControlRecordKeyUpdateThenCloseNotify: a KeyUpdate (Read returns 0,
// nil; EKEYEXPIRED from splice until the rekey) is transparent, and
// close_notify (Read returns io.EOF) half-closes the upstream while the
// client's socket has not even sent a FIN.
func TestControlRecordKeyUpdateThenCloseNotify(t *testing.T) {
	checkLeaks(t)
	tp, src, inj, wait := controlTunnel(t)
	inj.errs <- unix.EINVAL      // the KeyUpdate record at the head of the queue
	inj.errs <- unix.EKEYEXPIRED // what a kernel ≥ 6.14 answers until the new key is in
	src.reads <- readResult{}
	src.reads <- readResult{}
	if _, err := tp.client.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, tp.upstream, 5); string(got) != "hello" {
		t.Fatalf("upstream got %q", got)
	}
	inj.errs <- unix.EINVAL
	src.reads <- readResult{err: io.EOF}
	if _, err := tp.client.Write([]byte("!")); err != nil { // wakes the relay
		t.Fatal(err)
	}
	if n, err := tp.upstream.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("upstream after close_notify: %d, %v; want EOF", n, err)
	}
	tp.upstream.CloseWrite()
	res, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	if ds := res.AToB; ds.Bytes != 5 || ds.ControlRecords != 3 || ds.End != EndEOF {
		t.Errorf("a->b %+v, want 5 bytes, 3 control records, eof", ds)
	}
}

// TestControlRecordAlert: an alert (Read returns an error) fails the tunnel
// with that error.
func TestControlRecordAlert(t *testing.T) {
	checkLeaks(t)
	tp, src, inj, wait := controlTunnel(t)
	inj.errs <- unix.EINVAL
	src.reads <- readResult{err: errors.New("tls: remote alert: bad_record_mac")}
	tp.client.Write([]byte("x"))
	res, err := wait()
	if err == nil || !strings.Contains(err.Error(), "bad_record_mac") {
		t.Fatalf("relay error %v, want the alert", err)
	}
	if res.AToB.End != EndError || res.BToA.End != EndAborted {
		t.Errorf("ends a->b %v b->a %v, want error, aborted", res.AToB.End, res.BToA.End)
	}
}

// TestControlRecordFlood: a source whose splice keeps failing while Read
// yields nothing is cut off instead of spinning.
func TestControlRecordFlood(t *testing.T) {
	checkLeaks(t)
	tp, src, inj, wait := controlTunnel(t)
	for range maxControlRecordsInARow + 1 {
		inj.errs <- unix.EINVAL
	}
	go func() {
		for range maxControlRecordsInARow {
			src.reads <- readResult{}
		}
	}()
	tp.client.Write([]byte("x"))
	res, err := wait()
	if err == nil || !strings.Contains(err.Error(), "control records in a row") {
		t.Fatalf("relay error %v, want the flood cut-off", err)
	}
	if res.AToB.ControlRecords != maxControlRecordsInARow {
		t.Errorf("handled %d control records, want %d", res.AToB.ControlRecords, maxControlRecordsInARow)
	}
}

// TestPlainSourceSpliceErrorIsFatal: on a plain TCP source a splice error is
// a real error, never a control record (there is no userspace path to ask).
func TestPlainSourceSpliceErrorIsFatal(t *testing.T) {
	checkLeaks(t)
	tp := newTopology(t)
	inj := newInjector(t, tp.relayA)
	inj.errs <- unix.EINVAL
	wait := runRelay(t.Context(), newRelay(tp.relayA, tp.relayB, Options{Pipes: newTestPool(t, 1)}, inj.splice))
	tp.client.Write([]byte("x"))
	res, err := wait()
	if !errors.Is(err, unix.EINVAL) || res.AToB.End != EndError || res.AToB.ControlRecords != 0 {
		t.Fatalf("relay: %v, %+v; want EINVAL as a fatal a->b error", err, res.AToB)
	}
}

// recordSplicer stands in for splice(2) on a kTLS source: each call from the
// source moves at most perCall bytes: one record (maxRecordPlaintext), as
// the kernel's tls_sw_splice_read does, or several, as a kernel that gathers
// the records ready would. Once controlAt bytes have come from the source
// (-1: never) it fails as at a control record, which stays at the head of
// the stream until the connection's Read takes it (recordSource). It counts
// the calls either way.
type recordSplicer struct {
	src, sink    int
	controlAt    int64
	perCall      int
	delivered    int64 // bytes moved from the source, by the relay's one reader
	controlTaken atomic.Bool
	srcCalls     atomic.Int64
	sinkCalls    atomic.Int64
	// Kept by the relay's one reader: the largest source call asked for, the
	// bytes of the source calls since the last sink call, and the source
	// calls made after one that moved more than a record, before a drain.
	largestSrcAsk, sinceDrain, askedAfterGathered int64
}

// recordSource is the kTLS connection over a recordSplicer: its Read
// consumes the control record.
type recordSource struct {
	*controlSource
	rs *recordSplicer
}

func (c recordSource) Read(p []byte) (int, error) {
	c.rs.controlTaken.Store(true)
	return c.controlSource.Read(p)
}

func newRecordSplicer(t *testing.T, src, sink *net.TCPConn, controlAt int64, perCall int) *recordSplicer {
	return &recordSplicer{src: socketFD(t, src), sink: socketFD(t, sink), controlAt: controlAt, perCall: perCall}
}

func (rs *recordSplicer) splice(rfd, wfd, n, flags int) (int64, error) {
	switch {
	case rfd == rs.src:
		rs.srcCalls.Add(1)
		rs.largestSrcAsk = max(rs.largestSrcAsk, int64(n))
		if rs.sinceDrain > maxRecordPlaintext {
			rs.askedAfterGathered++
		}
		if rs.delivered == rs.controlAt && !rs.controlTaken.Load() {
			return 0, unix.EINVAL
		}
		n = min(n, rs.perCall)
		if rs.delivered < rs.controlAt {
			n = min(n, int(rs.controlAt-rs.delivered)) // a record ends at the control record
		}
		m, err := spliceSyscall(rfd, wfd, n, flags)
		rs.delivered += max(m, 0)
		rs.sinceDrain += max(m, 0)
		return m, err
	case wfd == rs.sink:
		rs.sinkCalls.Add(1)
		rs.sinceDrain = 0
	}
	return spliceSyscall(rfd, wfd, n, flags)
}

// recordTunnel is controlTunnel with a recordSplicer, the whole stream
// written by the client before the relay starts, so every record is ready.
func recordTunnel(t *testing.T, stream []byte, controlAt int64, perCall int) (topology, *controlSource, *recordSplicer, func() (Stats, error)) {
	tp := newTopology(t)
	go sendAndClose(tp.client, stream)
	src := &controlSource{TCPConn: tp.relayA, reads: make(chan readResult, 16)}
	rs := newRecordSplicer(t, tp.relayA, tp.relayB, controlAt, perCall)
	tun := newRelay(recordSource{src, rs}, tp.relayB, Options{Pipes: newTestPool(t, 2)}, rs.splice)
	return tp, src, rs, runRelay(t.Context(), tun)
}

// sendAndClose writes stream to c, then half-closes it.
func sendAndClose(c *net.TCPConn, stream []byte) {
	c.Write(stream)
	c.CloseWrite()
}

// expectSplicedWhole half-closes the upstream, reads all the tunnel
// delivers to it and waits for the tunnel: stream must have arrived whole,
// every byte of it spliced.
func expectSplicedWhole(t *testing.T, tp topology, wait func() (Stats, error), stream []byte) {
	t.Helper()
	tp.upstream.CloseWrite()
	got, err := io.ReadAll(tp.upstream)
	if err != nil {
		t.Fatal(err)
	}
	res, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, stream) || res.AToB.SpliceBytes != int64(len(stream)) {
		t.Fatalf("upstream got %d bytes (equal: %v), %d spliced; want the %d sent", len(got), bytes.Equal(got, stream), res.AToB.SpliceBytes, len(stream))
	}
}

// TestRecordBatching: from a source that yields one full record per
// splice(2), the relay gathers records in the pipe before it drains it, so
// the sink sees one splice(2) per batch (recordBatch), not one per record.
func TestRecordBatching(t *testing.T) {
	checkLeaks(t)
	const records = 16 * recordBatch / maxRecordPlaintext // sixteen batches
	stream := bytes.Repeat([]byte("0123456789abcdef"), records*maxRecordPlaintext/16)
	tp, _, rs, wait := recordTunnel(t, stream, -1, maxRecordPlaintext)
	expectSplicedWhole(t, tp, wait, stream)
	src, sink := rs.srcCalls.Load(), rs.sinkCalls.Load()
	t.Logf("%d records: %d source splices, %d sink splices", records, src, sink)
	if src < records {
		t.Fatalf("%d source splices for %d records: the fake does not bound them", src, records)
	}
	// Records arrive as the client's writes land, so a batch can end early
	// at EAGAIN; one drain per record would be `records` sink splices, full
	// batches records/16.
	if sink > records/4 {
		t.Errorf("%d sink splices for %d records: the relay drains record by record", sink, records)
	}
}

// TestGatheringKernelSource: from a kernel whose splice_read moves several
// records per call, a call asks for at most a batch (it opens them while
// it keeps its P), and once a call has moved more than one record the
// relay drains the pipe instead of asking again: that kernel took all that
// was ready.
func TestGatheringKernelSource(t *testing.T) {
	checkLeaks(t)
	stream := bytes.Repeat([]byte("gathered record "), 64*maxRecordPlaintext/16)
	tp, _, rs, wait := recordTunnel(t, stream, -1, 3*maxRecordPlaintext)
	expectSplicedWhole(t, tp, wait, stream)
	t.Logf("%d records: %d source splices (largest ask %d bytes), %d sink splices", len(stream)/maxRecordPlaintext, rs.srcCalls.Load(), rs.largestSrcAsk, rs.sinkCalls.Load())
	if rs.largestSrcAsk > recordBatch {
		t.Errorf("a kTLS source was asked for %d bytes in one call, more than %d", rs.largestSrcAsk, recordBatch)
	}
	if rs.askedAfterGathered != 0 {
		t.Errorf("%d source splices followed one that moved several records, before the drain", rs.askedAfterGathered)
	}
}

// TestControlRecordMidBatch: a control record met while records are being
// gathered in the pipe: the records before it are written first, then its
// data, then the rest.
func TestControlRecordMidBatch(t *testing.T) {
	checkLeaks(t)
	const before = 3 // records spliced before the control record
	stream := make([]byte, 8*maxRecordPlaintext)
	for i := range stream {
		stream[i] = byte(i / maxRecordPlaintext)
	}
	cut := before * maxRecordPlaintext
	tp, src, rs, wait := recordTunnel(t, stream, int64(cut), maxRecordPlaintext)
	src.reads <- readResult{data: []byte("CONTROL")}
	tp.upstream.CloseWrite()
	got, err := io.ReadAll(tp.upstream)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wait(); err != nil {
		t.Fatal(err)
	}
	want := append(append(slices.Clone(stream[:cut]), "CONTROL"...), stream[cut:]...)
	if !bytes.Equal(got, want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Fatalf("upstream got %d bytes, want %d: first difference at byte %d (the control data belongs at %d); %d source splices", len(got), len(want), i, cut, rs.srcCalls.Load())
	}
}

// sealingSink poses as a kTLS connection whose TX runs in the kernel: it
// offers its TCP socket for splicing.
type sealingSink struct{ *net.TCPConn }

func (c sealingSink) SpliceSink() (syscall.RawConn, bool) {
	rc, err := c.SyscallConn()
	return rc, err == nil
}

// TestSealingSinkCallsBounded: a splice(2) into a kTLS sink asks for at most
// maxSealPerCall bytes even when the pipe holds more, while a plain TCP
// sink is drained in calls as large as the pipe's content.
func TestSealingSinkCallsBounded(t *testing.T) {
	for _, kernelTX := range []bool{true, false} {
		t.Run(map[bool]string{true: "ktls", false: "tcp"}[kernelTX], func(t *testing.T) {
			checkLeaks(t)
			tp := newTopology(t)
			stream := bytes.Repeat([]byte("sealed records. "), 8<<20/16)
			go sendAndClose(tp.client, stream)
			sinkFD := socketFD(t, tp.relayB)
			var largestFill, largestAsk atomic.Int64
			splice := func(rfd, wfd, n, flags int) (int64, error) {
				m, err := spliceSyscall(rfd, wfd, n, flags)
				if wfd == sinkFD {
					largestAsk.Store(max(largestAsk.Load(), int64(n)))
				} else {
					largestFill.Store(max(largestFill.Load(), m))
				}
				return m, err
			}
			var sink net.Conn = tp.relayB
			if kernelTX {
				sink = sealingSink{tp.relayB}
			}
			wait := runRelay(t.Context(), newRelay(tp.relayA, sink, Options{Pipes: newTestPool(t, 2)}, splice))
			expectSplicedWhole(t, tp, wait, stream)
			fill, ask := largestFill.Load(), largestAsk.Load()
			t.Logf("largest pipe fill %d bytes, largest sink call %d bytes", fill, ask)
			if fill <= maxSealPerCall {
				t.Fatalf("the pipe never held more than %d bytes: nothing to bound", maxSealPerCall)
			}
			if kernelTX && ask > maxSealPerCall {
				t.Errorf("a kTLS sink was asked for %d bytes in one call, more than %d", ask, maxSealPerCall)
			}
			if !kernelTX && ask != fill {
				t.Errorf("a TCP sink was asked for at most %d bytes in one call, the pipe held %d", ask, fill)
			}
		})
	}
}
