package forward

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// wakePlane is a control plane's wake endpoint: it records each request's
// JSON and answers with status after delay.
type wakePlane struct {
	mu       sync.Mutex
	requests []map[string]string
	woken    chan struct{} // one send per request
	status   int
	delay    time.Duration
}

func newWakePlane(t *testing.T, status int, delay time.Duration) (*wakePlane, *Waker) {
	w := &wakePlane{woken: make(chan struct{}, 16), status: status, delay: delay}
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		var body map[string]string
		json.NewDecoder(r.Body).Decode(&body)
		body["method"], body["auth"], body["content_type"] = r.Method, r.Header.Get("Authorization"), r.Header.Get("Content-Type")
		w.mu.Lock()
		w.requests = append(w.requests, body)
		w.mu.Unlock()
		w.woken <- struct{}{}
		time.Sleep(w.delay)
		rw.WriteHeader(w.status)
	}))
	t.Cleanup(srv.Close)
	waker, err := NewWaker(WakerConfig{URL: srv.URL + "/wake", Header: http.Header{"Authorization": {"Bearer w"}}, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return w, waker
}

func (w *wakePlane) calls() []map[string]string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]map[string]string(nil), w.requests...)
}

type wakeLog struct {
	mu       sync.Mutex
	outcomes []string
}

func (l *wakeLog) observe(ev WakeEvent) {
	l.mu.Lock()
	l.outcomes = append(l.outcomes, ev.Outcome)
	l.mu.Unlock()
}
func (l *wakeLog) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.outcomes...)
}

// A sandbox whose target is down is woken: the control plane gets one
// call for concurrent tunnels, the target starts listening only after it,
// and every tunnel then runs, the bytes its gateway sent while the target
// was down arriving exact.
func TestWakeOnConnect(t *testing.T) {
	forwardtest.CheckLeaks(t)
	// The control plane takes a while to answer, so every tunnel's dial
	// fails while the first wake is in flight.
	plane, waker := newWakePlane(t, http.StatusAccepted, 500*time.Millisecond)
	var log wakeLog
	f := newFixture(t, func(c *Config) { c.Wake, c.WakeTimeout, c.OnWake = waker, 10*time.Second, log.observe })
	target := forwardtest.ClosedPort(t)
	const tunnels, size = 4, 256 << 10
	type result struct {
		sent, recv [32]byte
		n          int64
	}
	results := make(chan result, tunnels)
	for i := range tunnels {
		go func() {
			sent, recv, n := runTunnel(t, f.dial(t), f.gw.Frame(t, "sbx-asleep", target), size, uint64(i+1))
			results <- result{sent, recv, n}
		}()
	}
	<-plane.woken
	// The sandbox resumes a while after the wake, as a paused one does.
	time.Sleep(300 * time.Millisecond)
	up := forwardtest.NewUpstreamOn(t, target.String(), size)
	for range tunnels {
		r := <-results
		if r.n != size || r.recv != forwardtest.PatternSum(2, size) {
			t.Errorf("a gateway received %d bytes (want %d) or another hash", r.n, size)
		}
	}
	for _, err := range f.wait(t, tunnels) {
		if err != nil {
			t.Errorf("tunnel: %v", err)
		}
	}
	up.Close()
	got := map[[32]byte]bool{}
	for _, r := range up.Results() {
		got[r.RecvSum] = r.Received == size
	}
	for i := range tunnels {
		if !got[forwardtest.PatternSum(uint64(i+1), size)] {
			t.Errorf("the target did not receive tunnel %d's %d bytes exact", i, size)
		}
	}
	calls := plane.calls()
	if len(calls) != 1 {
		t.Fatalf("%d wake calls for %d concurrent tunnels, want 1", len(calls), tunnels)
	}
	if c := calls[0]; c["sandbox"] != "sbx-asleep" || c["target"] != target.String() || c["method"] != "POST" || c["auth"] != "Bearer w" || c["content_type"] != "application/json" {
		t.Errorf("wake call %v", c)
	}
	if o := log.get(); len(o) != tunnels || o[0] != WakeWoken {
		t.Errorf("wake outcomes %v, want %d times %s", o, tunnels, WakeWoken)
	}
}

// A wake the control plane refuses (500) or never answers refuses the
// tunnel with wake-failed; a wake it accepts for a target that never
// comes up refuses it with dial-failed once the wake timeout ends.
// Nothing is relayed for either.
func TestWakeFailures(t *testing.T) {
	for _, c := range []struct {
		name    string
		status  int
		delay   time.Duration
		reason  string
		outcome string
	}{
		{"control plane 500", http.StatusInternalServerError, 0, string(ReasonWakeFailed), WakeFailed},
		{"control plane hangs", http.StatusOK, 1500 * time.Millisecond, string(ReasonWakeFailed), WakeFailed},
		{"target never up", http.StatusOK, 0, string(ReasonDialFailed), WakeDialFailed},
	} {
		t.Run(c.name, func(t *testing.T) {
			plane, waker := newWakePlane(t, c.status, c.delay)
			var log wakeLog
			f := newFixture(t, func(cfg *Config) { cfg.Wake, cfg.WakeTimeout, cfg.OnWake = waker, 600*time.Millisecond, log.observe })
			start := time.Now()
			f.refused(t, 1, c.reason, func(conn *net.TCPConn) {
				// One write: a second one after a fast refusal's reset
				// would take the reset's error, leaving the read an EOF.
				conn.Write(append(f.gw.Frame(t, "sbx-gone", forwardtest.ClosedPort(t)), "tenant bytes"...))
			})
			if d := time.Since(start); c.outcome == WakeDialFailed && d < 600*time.Millisecond {
				t.Errorf("refused after %v, before the wake timeout", d)
			}
			if len(plane.calls()) != 1 {
				t.Errorf("%d wake calls, want 1", len(plane.calls()))
			}
			if o := log.get(); len(o) != 1 || o[0] != c.outcome {
				t.Errorf("wake outcomes %v, want [%s]", o, c.outcome)
			}
		})
	}
}

func TestNewWakerRejectsBadConfig(t *testing.T) {
	if _, err := NewWaker(WakerConfig{}); err == nil {
		t.Error("a waker without URL")
	}
	if _, err := NewWaker(WakerConfig{URL: "http://x", Timeout: -1}); err == nil {
		t.Error("a negative timeout")
	}
}

// A wake endpoint that answers garbage (not HTTP) refuses the tunnel with
// wake-failed, as one that fails does.
func TestWakeGarbageAnswer(t *testing.T) {
	addr := forwardtest.ServeTCP(t, func(c net.Conn) {
		c.Write([]byte("\x00\x01garbage, not HTTP\r\n\r\n"))
		c.Close()
	})
	waker, err := NewWaker(WakerConfig{URL: "http://" + addr + "/wake", Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var log wakeLog
	f := newFixture(t, func(cfg *Config) { cfg.Wake, cfg.WakeTimeout, cfg.OnWake = waker, 2*time.Second, log.observe })
	f.refused(t, 1, string(ReasonWakeFailed), func(conn *net.TCPConn) {
		conn.Write(append(f.gw.Frame(t, "sbx-x", forwardtest.ClosedPort(t)), "tenant bytes"...))
	})
	if o := log.get(); len(o) != 1 || o[0] != WakeFailed {
		t.Errorf("wake outcomes %v, want [%s]", o, WakeFailed)
	}
}
