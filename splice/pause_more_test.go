package splice

import (
	"encoding/json"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestPauseRefusedWithBufferedBytes: a tunnel whose client side is read
// through userspace (the copy path, as for a TLS conn kept in Go), with an
// upstream that reads nothing: the client->upstream direction holds bytes
// it read and cannot write. Pause refuses (PauseBuffered), Run goes on as
// if nothing happened: once the upstream reads, both streams arrive exact
// and the tunnel ends in order. Once nothing is held, a pause succeeds on
// the copy path too, and the resumed relay finishes the streams.
func TestPauseRefusedWithBufferedBytes(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	smallSinks(t, tp)
	const size = 4 * MiB
	a := opaqueConn{tp.relayA}
	sentAB := goSend(tp.client, size, 51)
	pz := startPausing(t, a, tp.relayB, Options{Pipes: pool})
	pz.stalled(AToB)
	_, err := pz.tun.Pause(t.Context())
	var pe *PauseError
	if !errors.As(err, &pe) || pe.Reason != PauseBuffered {
		t.Fatalf("Pause with a copying direction blocked on its sink: %v, want a PauseError (%s)", err, PauseBuffered)
	}
	if ds := pz.tun.Stats().AToB; ds.End != EndRunning || ds.Spliced {
		t.Fatalf("a->b after the refusal: %+v, want running on the copy path", ds)
	}
	var gate sync.RWMutex
	gotAB := goPacedRead(tp.upstream, size, 0, &gate)
	if string(gotAB(t)) != string(sentAB(t)) {
		t.Fatal("a->b corrupted after a refused pause")
	}
	// Nothing held now: both directions wait in Read.
	sentBA := goSend(tp.upstream, size/2, 52)
	gotBA := readExact(t, tp.client, size/2)
	if string(gotBA) != string(sentBA(t)) {
		t.Fatal("b->a corrupted after a refused pause")
	}
	st := pz.cycle()
	if st.Dirs[AToB].Bytes != size || st.Dirs[BToA].Bytes != size/2 || st.Dirs[AToB].Pending != 0 {
		t.Fatalf("paused state %+v, want %d and %d bytes, nothing pending", st, int64(size), int64(size/2))
	}
	sentBA = goSend(tp.upstream, size/2, 53)
	if got := readExact(t, tp.client, size/2); string(got) != string(sentBA(t)) {
		t.Fatal("b->a corrupted after the resume")
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.AToB.Bytes != size || res.AToB.CopyBytes != size || res.BToA.Bytes != size || res.AToB.End != EndEOF || res.BToA.End != EndEOF {
		t.Errorf("result %+v, want %d bytes copied each way, both eof", res, int64(size))
	}
}

// TestPauseThrottled: a direction waiting for its Limiter (whose next
// grant is a second away) is stopped at once: the wait is cut short, not
// served, and the resumed relay, without a Limiter, delivers the rest.
func TestPauseThrottled(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	const size = 64 << 10
	lim := NewRateLimiter(minGrant, minGrant) // after the first grant, one a second
	sent := goSend(tp.client, size, 61)
	var gate sync.RWMutex
	got := goPacedRead(tp.upstream, size, 0, &gate)
	pz := startPausing(t, tp.relayA, tp.relayB, Options{Pipes: pool, Limit: [2]Limiter{AToB: lim}})
	for pz.tun.Stats().AToB.Bytes == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // waiting for the next grant
	start := time.Now()
	pz.opts.Limit[AToB] = nil
	st := pz.cycle()
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("pausing a throttled direction took %v; its wait should be cut short", took)
	}
	if ab := st.Dirs[AToB]; ab.Bytes == 0 || ab.Bytes > minGrant || ab.Throttled <= 0 || ab.Throttled >= time.Second {
		t.Errorf("a->b paused %+v, want the first grant's bytes and a throttled wait cut short", ab)
	}
	if string(got(t)) != string(sent(t)) {
		t.Fatal("a->b corrupted through the pause")
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.AToB.Bytes != size || res.AToB.Throttled != st.Dirs[AToB].Throttled {
		t.Errorf("a->b %+v, want %d bytes, throttled only before the pause", res.AToB, size)
	}
}

// TestPauseNotRunning: Pause before Run, and after Run returned, refuses
// and changes nothing.
func TestPauseNotRunning(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	tun := New(tp.relayA, tp.relayB, Options{Pipes: pool})
	var pe *PauseError
	if _, err := tun.Pause(t.Context()); !errors.As(err, &pe) || pe.Reason != PauseNotRunning {
		t.Fatalf("Pause before Run: %v, want %s", err, PauseNotRunning)
	}
	res, err := echoRun(t.Context(), tp, tun, 71, 1*MiB)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tun.Pause(t.Context()); !errors.As(err, &pe) || pe.Reason != PauseEnded {
		t.Fatalf("Pause after Run: %v, want %s", err, PauseEnded)
	}
	if res.AToB.Bytes != 1*MiB || res.BToA.Bytes != 1*MiB {
		t.Errorf("result %+v", res)
	}
}

// TestPauseStateEncoding: a state survives its encoding; another version,
// an unknown field and states Resume could not continue are refused.
func TestPauseStateEncoding(t *testing.T) {
	st := PauseState{Dirs: [2]PausedDirection{
		{Bytes: 5 << 20, SpliceBytes: 5<<20 - 100, CopyBytes: 100, ControlRecords: 3, PipeShortages: 1, Throttled: 1500 * time.Millisecond, Spliced: true, End: EndRunning, Pending: 65536},
		{Bytes: 7, SpliceBytes: 0, CopyBytes: 7, End: EndEOF},
	}}
	enc, err := st.Encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodePauseState(enc)
	if err != nil {
		t.Fatal(err)
	}
	if got != st {
		t.Fatalf("round trip: %+v, want %+v", got, st)
	}
	// Inside a larger message, through encoding/json.
	msg, err := json.Marshal(struct{ Relay PauseState }{st})
	if err != nil {
		t.Fatal(err)
	}
	var back struct{ Relay PauseState }
	if err := json.Unmarshal(msg, &back); err != nil || back.Relay != st {
		t.Fatalf("inside a message: %+v, %v", back.Relay, err)
	}

	var ve *PauseVersionError
	other := strings.Replace(string(enc), `"v":1`, `"v":2`, 1)
	if _, err := DecodePauseState([]byte(other)); !errors.As(err, &ve) || ve.Got != 2 {
		t.Errorf("version 2: %v, want a PauseVersionError", err)
	}
	for name, b := range map[string]string{
		"no version":    strings.Replace(string(enc), `"v":1,`, ``, 1),
		"unknown field": strings.Replace(string(enc), `"v":1,`, `"v":1,"fd":3,`, 1),
		"trailing":      string(enc) + "{}",
		"unknown end":   strings.Replace(string(enc), `"end":"eof"`, `"end":"error"`, 1),
	} {
		if _, err := DecodePauseState([]byte(b)); err == nil {
			t.Errorf("%s: decoded %s", name, b)
		}
	}
	for name, bad := range map[string]func(*PauseState){
		"bytes do not add up":      func(s *PauseState) { s.Dirs[0].CopyBytes++ },
		"negative":                 func(s *PauseState) { s.Dirs[1].ControlRecords = -1 },
		"pending after the end":    func(s *PauseState) { s.Dirs[1].Pending = 1 },
		"an end that cannot go on": func(s *PauseState) { s.Dirs[0].End = EndError },
	} {
		s := st
		bad(&s)
		if _, err := s.Encode(); err == nil {
			t.Errorf("%s: encoded", name)
		}
		if _, err := Resume(&net.TCPConn{}, &net.TCPConn{}, &Paused{State: s}, Options{}); err == nil {
			t.Errorf("%s: resumed", name)
		}
	}
}
