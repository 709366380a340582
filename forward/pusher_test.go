package forward

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// The receiver gets JSON deltas that sum to exactly the bytes moved.
func TestPusherDeltasSumToBytesMoved(t *testing.T) {
	forwardtest.CheckLeaks(t)
	var mu sync.Mutex
	sums := map[string][2]int64{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var rep ActivityReport
		if r.Method != http.MethodPost || r.Header.Get("Content-Type") != "application/json" || r.Header.Get("Authorization") != "Bearer t0ken" {
			t.Errorf("got %s with Content-Type %q, Authorization %q", r.Method, r.Header.Get("Content-Type"), r.Header.Get("Authorization"))
		}
		if err := json.NewDecoder(r.Body).Decode(&rep); err != nil {
			t.Errorf("decode report: %v", err)
		}
		mu.Lock()
		for _, d := range rep.Sandboxes {
			s := sums[d.Sandbox]
			sums[d.Sandbox] = [2]int64{s[0] + d.BytesToSandbox, s[1] + d.BytesFromSandbox}
		}
		mu.Unlock()
	}))
	defer srv.Close()
	reg := NewRegistry()
	p, err := NewPusher(PusherConfig{URL: srv.URL, Interval: 5 * time.Millisecond,
		Header: http.Header{"Authorization": {"Bearer t0ken"}, "Content-Type": {"text/plain"}}}, reg)
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	a, _, _ := reg.Open("sbx-a", "10.0.0.1:1", Origin{Peer: "peer"}, 0)
	b, _, _ := reg.Open("sbx-b", "10.0.0.2:1", Origin{Peer: "peer"}, 0)
	for i := range 200 {
		a.AddToSandbox(int64(i))
		a.AddFromSandbox(3)
		b.AddFromSandbox(int64(i * 2))
		if i%50 == 0 {
			time.Sleep(7 * time.Millisecond)
		}
	}
	a.Close()
	b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p.Stop(ctx) // takes and delivers the last deltas
	mu.Lock()
	defer mu.Unlock()
	if got := sums["sbx-a"]; got != [2]int64{199 * 200 / 2, 600} {
		t.Errorf("sbx-a deltas sum to %v", got)
	}
	if got := sums["sbx-b"]; got != [2]int64{0, 199 * 200} {
		t.Errorf("sbx-b deltas sum to %v", got)
	}
	if st := p.Stats(); st.Sent == 0 || st.Dropped != 0 || st.Retries != 0 {
		t.Errorf("stats %+v", st)
	}
}

// A failing receiver: each report is retried, then dropped, counted and
// reported (OnDrop) with the receiver's answer; the data path (the
// counters) is never held up.
func TestPusherRetriesThenDrops(t *testing.T) {
	forwardtest.CheckLeaks(t)
	var posts atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		posts.Add(1)
		http.Error(w, "quota\n\t exceeded: "+strings.Repeat("x", 300), http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	reg := NewRegistry()
	var drops []Drop
	p, err := NewPusher(PusherConfig{URL: srv.URL, Interval: time.Hour, Attempts: 3, Backoff: time.Millisecond, Queue: 1,
		OnDrop: func(d Drop) { drops = append(drops, d) }}, reg)
	if err != nil {
		t.Fatal(err)
	}
	p.Start()
	tun, _, _ := reg.Open("sbx", "10.0.0.1:1", Origin{Peer: "peer"}, 0)
	tun.AddToSandbox(1 << 20)
	tun.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p.Stop(ctx)
	st := p.Stats()
	if st.Sent != 0 || st.Dropped != 1 || st.Retries != 2 || posts.Load() != 3 {
		t.Errorf("stats %+v after %d POSTs; want 3 attempts, 2 retries, 1 drop", st, posts.Load())
	}
	// The answer's body, whitespace runs as one space, cut at 256 bytes.
	answer := "quota exceeded: " + strings.Repeat("x", 256-len("quota exceeded: ")) + "…"
	if len(drops) != 1 {
		t.Fatalf("OnDrop called %d times, want 1: %+v", len(drops), drops)
	}
	d := drops[0]
	if d.Reason != DropAttempts || d.Attempts != 3 || d.Sandboxes != 1 || d.Report.Sequence != 1 || d.Err == nil ||
		!strings.HasSuffix(d.Err.Error(), srv.URL+" answered 503 Service Unavailable: "+strconv.Quote(answer)) {
		t.Errorf("drop %+v; want reason attempts after 3 attempts, report 1 of 1 sandbox, and the answer %q", d, answer)
	}
}

// A full queue evicts the oldest report and counts it.
func TestPusherQueueBound(t *testing.T) {
	forwardtest.CheckLeaks(t)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-release }))
	defer srv.Close()
	defer close(release)
	reg := NewRegistry()
	var (
		mu    sync.Mutex // OnDrop runs on both of the pusher's goroutines once it has started
		drops []Drop
	)
	p, err := NewPusher(PusherConfig{URL: srv.URL, Interval: time.Hour, Attempts: 1, Queue: 2, Timeout: 50 * time.Millisecond,
		OnDrop: func(d Drop) { mu.Lock(); drops = append(drops, d); mu.Unlock() }}, reg)
	if err != nil {
		t.Fatal(err)
	}
	tun, _, _ := reg.Open("sbx", "10.0.0.1:1", Origin{Peer: "peer"}, 0)
	defer tun.Close()
	for range 5 {
		tun.AddToSandbox(1)
		p.enqueue()
	}
	if got := p.Stats().Dropped; got != 3 {
		t.Errorf("dropped %d of 5 reports with a queue of 2, want 3", got)
	}
	// The oldest ones, as they were evicted, with no attempt made.
	mu.Lock()
	for i, d := range drops {
		if d.Reason != DropQueueFull || d.Report.Sequence != uint64(i+1) || d.Attempts != 0 || d.Err != nil {
			t.Errorf("drop %d: %+v, want report %d evicted from the full queue, no attempt", i, d, i+1)
		}
	}
	if len(drops) != 3 {
		t.Errorf("OnDrop called %d times, want 3", len(drops))
	}
	mu.Unlock()
	p.Start()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p.Stop(ctx)
}

// Every POST carries the configured User-Agent ("caddy-ktls" by default),
// unless the configured headers set one.
func TestPusherUserAgent(t *testing.T) {
	forwardtest.CheckLeaks(t)
	for _, tc := range []struct {
		cfg  PusherConfig
		want string
	}{
		{PusherConfig{}, "caddy-ktls"},
		{PusherConfig{UserAgent: "caddy-ktls/v1.2.3"}, "caddy-ktls/v1.2.3"},
		{PusherConfig{UserAgent: "caddy-ktls/v1.2.3", Header: http.Header{"User-Agent": {"mine"}}}, "mine"},
	} {
		got := make(chan string, 8)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			got <- r.Header.Get("User-Agent")
			w.Header().Set("Connection", "close")
		}))
		reg := NewRegistry()
		tc.cfg.URL, tc.cfg.Interval = srv.URL, time.Hour
		p, err := NewPusher(tc.cfg, reg)
		if err != nil {
			t.Fatal(err)
		}
		p.Start()
		tun, _, _ := reg.Open("sbx", "10.0.0.1:1", Origin{Peer: "peer"}, 0)
		tun.AddToSandbox(1)
		tun.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		p.Stop(ctx) // flushes the one report
		cancel()
		srv.Close()
		select {
		case ua := <-got:
			if ua != tc.want {
				t.Errorf("User-Agent %q, want %q", ua, tc.want)
			}
		default:
			t.Errorf("no report was POSTed (stats %+v)", p.Stats())
		}
	}
}
