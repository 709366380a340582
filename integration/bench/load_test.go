package main

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

// Every value falls in the bucket whose bounds hold it: the buckets are
// contiguous from 0 to histMax, exact below 256 ns, and above at most
// 1/128 of their lower bound wide.
func TestHistogramBuckets(t *testing.T) {
	for _, c := range []struct {
		d      time.Duration
		i      int
		lo, hi time.Duration
	}{
		{0, 0, 0, 0},
		{255, 255, 255, 255},
		{256, 256, 256, 257},
		{257, 256, 256, 257},
		{258, 257, 258, 259},
		{511, 383, 510, 511},
		{512, 384, 512, 515},
		{time.Microsecond, 256 + 2*128 - 128 + (1000>>2 - 128), 1000, 1003},
		{histMax, histBuckets - 1, 0, 0},
		{time.Hour, histBuckets - 1, 0, 0},
	} {
		if got := histIndex(c.d); got != c.i {
			t.Errorf("histIndex(%d) = %d, want %d", c.d, got, c.i)
		}
		if c.hi == 0 && c.lo == 0 && c.d != 0 {
			continue
		}
		if lo, hi := histBounds(c.i); lo != c.lo || hi != c.hi {
			t.Errorf("histBounds(%d) = [%d, %d], want [%d, %d]", c.i, lo, hi, c.lo, c.hi)
		}
	}
	next := time.Duration(0)
	for i := range histBuckets {
		lo, hi := histBounds(i)
		if lo != next || hi < lo {
			t.Fatalf("bucket %d is [%d, %d], want it to start at %d", i, lo, hi, next)
		}
		if histIndex(lo) != i || histIndex(hi) != i {
			t.Fatalf("bucket %d [%d, %d]: its bounds index %d and %d", i, lo, hi, histIndex(lo), histIndex(hi))
		}
		if lo >= histExact && float64(hi-lo+1) > float64(lo)/histSub {
			t.Fatalf("bucket %d [%d, %d] is wider than 1/%d of its lower bound", i, lo, hi, histSub)
		}
		next = hi + 1
	}
	if _, hi := histBounds(histBuckets - 1); hi < histMax {
		t.Errorf("the top bucket ends at %v, below histMax %v", hi, histMax)
	}
}

// A percentile is never below the sorted samples' and at most 1/128 above
// it.
func TestHistogramPercentiles(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	var h histogram
	var all []time.Duration
	for range 100_000 {
		// log-uniform from 1 µs to 10 s
		d := time.Duration(math.Exp(math.Log(1e3) + rng.Float64()*(math.Log(1e10)-math.Log(1e3))))
		all = append(all, d)
		h.record(d)
	}
	slices.Sort(all)
	for _, q := range []float64{0.1, 1, 50, 90, 99, 99.9, 99.99, 100} {
		rank := int(math.Ceil(q / 100 * float64(len(all))))
		want := all[rank-1]
		got := h.percentile(q)
		if got < want || float64(got) > float64(want)*(1+1.0/histSub) {
			t.Errorf("p%v = %v, want %v (to +1/%d)", q, got, want, histSub)
		}
	}
	if h.max != all[len(all)-1] || h.percentile(100) != h.max {
		t.Errorf("max %v, p100 %v; want %v", h.max, h.percentile(100), all[len(all)-1])
	}
	var a, b histogram
	for i, d := range all {
		if i%2 == 0 {
			a.record(d)
		} else {
			b.record(d)
		}
	}
	a.merge(&b)
	if a != h {
		t.Error("merging two halves differs from recording all")
	}
}

// The schedule's mean rate is the rate asked for (within 5 standard
// deviations of a Poisson count), its gaps are exponential (their
// coefficient of variation is 1, not a fixed rate's 0), and a seed gives
// the same schedule every time.
func TestPoissonSchedule(t *testing.T) {
	const rate, dur = 2000.0, 50 * time.Second
	s := poissonSchedule(rate, dur, 42)
	want := rate * dur.Seconds()
	if n := float64(len(s)); math.Abs(n-want) > 5*math.Sqrt(want) {
		t.Errorf("%d arrivals, want %v ± %v", len(s), want, 5*math.Sqrt(want))
	}
	if !slices.IsSorted(s) || s[0] < 0 || s[len(s)-1] >= dur {
		t.Error("arrivals out of order or outside the step")
	}
	var sum, sq float64
	prev := time.Duration(0)
	for _, at := range s {
		g := (at - prev).Seconds()
		sum, sq, prev = sum+g, sq+g*g, at
	}
	mean := sum / float64(len(s))
	cv := math.Sqrt(sq/float64(len(s))-mean*mean) / mean
	if math.Abs(cv-1) > 0.03 {
		t.Errorf("gaps' coefficient of variation %.3f, want 1 (exponential)", cv)
	}
	if !slices.Equal(s, poissonSchedule(rate, dur, 42)) {
		t.Error("the same seed gave another schedule")
	}
	if slices.Equal(s[:100], poissonSchedule(rate, dur, 43)[:100]) {
		t.Error("another seed gave the same schedule")
	}
}

// serveOn accepts on a fresh loopback listener and runs serve per
// connection until the test ends.
func serveOn(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { defer c.Close(); serve(c) })
		}
	}()
	return ln.Addr().String()
}

// readClientHello reads the first TLS record (the ClientHello) whole.
func readClientHello(c net.Conn) {
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(c, hdr); err == nil {
		io.CopyN(io.Discard, c, int64(hdr[3])<<8|int64(hdr[4]))
	}
}

// deniedBeforeHandshake is the forwarder's overload shedding: it reads the
// ClientHello record, answers a plaintext access_denied alert, closes.
func deniedBeforeHandshake(c net.Conn) {
	readClientHello(c)
	c.Write([]byte{0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x31})
}

// reset reads the tunnel's first bytes and resets the connection.
func reset(c net.Conn) {
	c.Read(make([]byte, 64))
	c.(*net.TCPConn).SetLinger(0)
}

// corrupting answers load calls with one byte flipped in the second call.
func corrupting(c net.Conn) {
	h, err := readHeader(c)
	if err != nil {
		return
	}
	got, req, resp := make([]byte, h.req), make([]byte, h.req), make([]byte, h.resp)
	for i := uint64(0); ; i++ {
		if _, err := io.ReadFull(c, got); err != nil {
			return
		}
		callBytes(req, resp, h.seed, i)
		if i%2 == 1 {
			resp[len(resp)/2] ^= 1
		}
		c.Write(resp)
	}
}

func testGateway(t *testing.T) *gateway {
	kp, err := newPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return &gateway{tls: gatewayTLS(kp)}
}

// Each failure lands in its class: the forwarder's plaintext access_denied
// before the handshake is refused/overloaded, an RST is a reset, the
// generator's deadline a timeout, a wrong byte corrupt.
func TestLoadErrorClasses(t *testing.T) {
	forwardtest.CheckLeaks(t)
	g := testGateway(t)
	hang := make(chan struct{})
	defer close(hang)
	for _, c := range []struct {
		name, class, cause string
		dial               func(string) func(context.Context) (net.Conn, error)
		serve              func(net.Conn)
		reuse              bool
	}{
		{"access_denied before the handshake, per-call", benchjson.ClassRefused, "overloaded", g.tlsDialer, deniedBeforeHandshake, false},
		{"access_denied before the handshake, reuse", benchjson.ClassRefused, "overloaded", g.tlsDialer, deniedBeforeHandshake, true},
		{"closed before the handshake", benchjson.ClassRefused, "closed before the handshake", g.tlsDialer, readClientHello, false},
		{"reset", benchjson.ClassReset, "reset in first-read", plainDialer, reset, true},
		{"generator deadline", benchjson.ClassTimeout, "generator deadline", plainDialer, func(net.Conn) { <-hang }, true},
		{"wrong byte", benchjson.ClassCorrupt, "wrong bytes", plainDialer, corrupting, true},
	} {
		addr := serveOn(t, c.serve)
		gen := newLoadGen(c.reuse, 1, []func(context.Context) (net.Conn, error){c.dial(addr)}, "", nil, "", 16, 64, 500*time.Millisecond)
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		var err error
		if c.reuse {
			if err = gen.tunnels[0].call(ctx); err == nil {
				err = gen.tunnels[0].call(ctx) // the corrupting server's second call
			}
		} else {
			err = gen.perCall(ctx)
		}
		cancel()
		gen.close()
		if err == nil {
			t.Errorf("%s: no error", c.name)
			continue
		}
		if class, cause := classify(err); class != c.class || cause != c.cause {
			t.Errorf("%s: %v classified %s (%s), want %s (%s)", c.name, err, class, cause, c.class, c.cause)
		}
	}
}

// A step counts every arrival once: completed, failed by class, or
// saturated; a wrong byte is never completed.
func TestLoadStepAccounting(t *testing.T) {
	forwardtest.CheckLeaks(t)
	up, err := startUpstream()
	if err != nil {
		t.Fatal(err)
	}
	defer up.close()
	for _, reuse := range []bool{true, false} {
		gen := newLoadGen(reuse, 8, []func(context.Context) (net.Conn, error){plainDialer(up.rawAddr())}, "", nil, "", 1024, 4096, 5*time.Second)
		if err := gen.open(t.Context(), 4); err != nil {
			t.Fatal(err)
		}
		s := gen.step(t.Context(), 400, 300*time.Millisecond, 1)
		if err := gen.close(); err != nil {
			t.Errorf("reuse %v: closing: %v", reuse, err)
		}
		if s.Offered == 0 || s.Completed+s.Saturated+s.ErrorCount() != s.Offered || s.ErrorCount() != 0 {
			t.Errorf("reuse %v: offered %d, completed %d, saturated %d, errors %v", reuse, s.Offered, s.Completed, s.Saturated, s.Causes)
		}
		if s.Completed > 0 && (s.P50us <= 0 || s.P99us < s.P50us || s.MaxUs < s.P999us) {
			t.Errorf("reuse %v: percentiles p50 %v p99 %v p99.9 %v max %v", reuse, s.P50us, s.P99us, s.P999us, s.MaxUs)
		}
	}
	addr := serveOn(t, corrupting)
	gen := newLoadGen(true, 4, []func(context.Context) (net.Conn, error){plainDialer(addr)}, "", nil, "", 16, 64, 5*time.Second)
	s := gen.step(t.Context(), 400, 200*time.Millisecond, 2)
	gen.close()
	if s.Errors[benchjson.ClassCorrupt] == 0 || s.Completed+s.Saturated+s.ErrorCount() != s.Offered || s.Errors[benchjson.ClassCorrupt] != s.ErrorCount() {
		t.Errorf("corrupting upstream: offered %d, completed %d, saturated %d, errors %v", s.Offered, s.Completed, s.Saturated, s.Causes)
	}
}

// The generator holds at most its slots' calls: with every slot held by a
// call that outlasts the step, every other arrival is generator-saturated,
// not started.
func TestLoadGeneratorBounded(t *testing.T) {
	forwardtest.CheckLeaks(t)
	hang := make(chan struct{})
	addr := serveOn(t, func(net.Conn) { <-hang })
	defer close(hang)
	for _, reuse := range []bool{true, false} {
		gen := newLoadGen(reuse, 2, []func(context.Context) (net.Conn, error){plainDialer(addr)}, "", nil, "", 16, 64, 3*time.Second)
		s := gen.step(t.Context(), 500, 200*time.Millisecond, 3)
		gen.close()
		if s.Offered < 10 || s.Saturated != s.Offered-2 || s.Errors[benchjson.ClassTimeout] != 2 || s.Completed != 0 {
			t.Errorf("reuse %v: offered %d, saturated %d, errors %v, completed %d; want all but 2 saturated, 2 timeouts", reuse, s.Offered, s.Saturated, s.Causes, s.Completed)
		}
	}
}

// Errors that need a contender to happen, classified from their shapes:
// access_denied on the first read after the preamble (the forwarder's
// bound on pending dials) is refused/overloaded; the HTTP contender's
// 502 is the target's failure, its 503 a refusal; an alert after the first
// response is no refusal.
func TestClassifyContenderErrors(t *testing.T) {
	denied := &net.OpError{Op: "remote error", Err: errors.New("tls: access denied")}
	for _, c := range []struct {
		err          error
		class, cause string
	}{
		{&callError{phaseFirstRead, denied}, benchjson.ClassRefused, "overloaded"},
		{&callError{phaseCall, denied}, benchjson.ClassOther, "alert in call: tls: access denied"},
		{&callError{phaseConnect, &net.OpError{Op: "remote error", Err: errors.New("tls: bad certificate")}}, benchjson.ClassRefused, "tls: bad certificate"},
		{&callError{phaseCall, httpStatusError{502}}, benchjson.ClassTarget, "HTTP 502"},
		{&callError{phaseCall, httpStatusError{503}}, benchjson.ClassRefused, "HTTP 503"},
		{&callError{phaseCall, io.ErrUnexpectedEOF}, benchjson.ClassOther, "closed in call"},
		{&callError{phaseCall, errWrongBytes}, benchjson.ClassCorrupt, "wrong bytes"},
	} {
		if class, cause := classify(c.err); class != c.class || cause != c.cause {
			t.Errorf("%v: classified %s (%s), want %s (%s)", c.err, class, cause, c.class, c.cause)
		}
	}
}

// A call whose deadline passes after its handshake fails on its first
// Write before a byte left; the generator then goes away without
// close_notify (abandon). crypto/tls spent the unsent record's sequence
// number, so a close_notify would reach the contender under the next one
// and fail authentication there (a kTLS contender's TlsDecryptError): the
// contender must see the end of the stream, not a bad record. Closing the
// same connection with Close instead shows the bad record, per shape.
func TestFailedCallLeavesNoBadRecord(t *testing.T) {
	forwardtest.CheckLeaks(t)
	kp, err := newPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.LoadX509KeyPair(kp.certFile, kp.keyFile)
	if err != nil {
		t.Fatal(err)
	}
	g := &gateway{tls: gatewayTLS(kp)}
	ends := make(chan error, 1)
	addr := serveOn(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(time.Minute))
		_, err := io.ReadAll(tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}}))
		ends <- err
	})
	// lateDial hands the call its connection once the call's deadline
	// has passed, with that deadline set (as gateway.counted does).
	lateDial := func(ctx context.Context) (net.Conn, error) {
		c, err := g.tlsDialer(addr)(ctx)
		if err != nil {
			return nil, err
		}
		d, _ := ctx.Deadline()
		time.Sleep(time.Until(d) + 10*time.Millisecond)
		c.SetDeadline(d)
		return c, nil
	}
	for _, reuse := range []bool{true, false} {
		gen := newLoadGen(reuse, 1, []func(context.Context) (net.Conn, error){lateDial}, "", nil, "", 16, 64, time.Second)
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		if reuse {
			err = gen.tunnels[0].call(ctx)
		} else {
			err = gen.perCall(ctx)
		}
		cancel()
		if class, cause := classify(err); class != benchjson.ClassTimeout {
			t.Errorf("reuse %v: call error %v classified %s (%s), want %s", reuse, err, class, cause, benchjson.ClassTimeout)
		}
		if end := <-ends; end != nil {
			t.Errorf("reuse %v: the server's read ended with %v, want the end of the stream", reuse, end)
		}
	}
	// What abandon prevents: the same failed Write, then Close.
	c, err := g.tlsDialer(addr)(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	c.SetWriteDeadline(time.Now().Add(-time.Second))
	if _, err := c.Write([]byte("call")); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Write past the deadline: %v", err)
	}
	c.Close()
	if end := <-ends; end == nil || !strings.Contains(end.Error(), "bad record MAC") {
		t.Errorf("Close after the failed Write: the server's read ended with %v, want bad record MAC", end)
	}
}
