package forward

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// ActivityReport is the JSON body a Pusher POSTs. Each entry is the bytes a
// sandbox moved since the entry before it: a receiver sums the deltas to get
// totals, and a sandbox that is open but idle appears with zero deltas so
// the receiver can tell idle from gone.
//
//	{"sent_at":"2026-11-29T22:41:28Z","sandboxes":[
//	  {"sandbox":"sbx-1","bytes_to_sandbox":1024,"bytes_from_sandbox":4096,
//	   "open_tunnels":1,"last_activity":"2026-11-29T22:41:27.5Z"}]}
type ActivityReport struct {
	SentAt    time.Time      `json:"sent_at"`
	Sandboxes []SandboxDelta `json:"sandboxes"`
}

// PusherConfig configures a Pusher. Zero durations and sizes take the
// defaults documented on each field.
type PusherConfig struct {
	URL      string        // where reports are POSTed (required)
	Interval time.Duration // between reports; default 10s
	Timeout  time.Duration // per POST attempt; default 5s
	Attempts int           // POST attempts per report before it is dropped; default 4
	Backoff  time.Duration // wait before the second attempt, doubled after each failure; default 500ms
	Queue    int           // reports waiting for delivery; when full the oldest is dropped; default 16
	Client   *http.Client  // default: a client with Timeout
	Header   http.Header   // sent with every POST (a control plane's credentials); Content-Type is always JSON
	// UserAgent is sent as User-Agent unless Header sets one; default
	// "caddy-ktls".
	UserAgent string
}

// PusherStats counts what a Pusher did.
type PusherStats struct {
	Sent    uint64 // reports accepted with a 2xx status
	Retries uint64 // failed attempts that were retried
	Dropped uint64 // reports given up on (attempts exhausted, or evicted from a full queue)
}

// Pusher reports per-sandbox byte deltas from a Registry to a URL. The data
// path never waits for it: it only reads the registry's atomics.
type Pusher struct {
	cfg   PusherConfig
	reg   *Registry
	queue chan ActivityReport
	stop  chan struct{}
	done  sync.WaitGroup
	// ctx ends in-flight deliveries when Stop's own deadline passes.
	ctx    context.Context
	cancel context.CancelFunc

	sent, retries, dropped atomic.Uint64
}

// NewPusher validates cfg and returns a Pusher that is not yet running.
func NewPusher(cfg PusherConfig, reg *Registry) (*Pusher, error) {
	if cfg.URL == "" {
		return nil, fmt.Errorf("activity pusher: no URL")
	}
	if cfg.Interval < 0 || cfg.Timeout < 0 || cfg.Attempts < 0 || cfg.Backoff < 0 || cfg.Queue < 0 {
		return nil, fmt.Errorf("activity pusher: negative interval, timeout, attempts, backoff or queue")
	}
	if cfg.Interval == 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.Attempts == 0 {
		cfg.Attempts = 4
	}
	if cfg.Backoff == 0 {
		cfg.Backoff = 500 * time.Millisecond
	}
	if cfg.Queue == 0 {
		cfg.Queue = 16
	}
	if cfg.UserAgent == "" {
		cfg.UserAgent = "caddy-ktls"
	}
	if cfg.Client == nil {
		// Its own transport, so that Stop can close the idle connections
		// of a pusher that a configuration reload retired.
		cfg.Client = &http.Client{Timeout: cfg.Timeout, Transport: http.DefaultTransport.(*http.Transport).Clone()}
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Pusher{cfg: cfg, reg: reg, queue: make(chan ActivityReport, cfg.Queue), stop: make(chan struct{}), ctx: ctx, cancel: cancel}, nil
}

// Start runs the pusher until Stop.
func (p *Pusher) Start() {
	p.done.Add(2)
	go p.collect()
	go p.deliver()
}

// Stop takes a last report, tries to deliver what is queued until ctx is
// done, and returns when both goroutines have ended.
func (p *Pusher) Stop(ctx context.Context) {
	close(p.stop)
	stopped := make(chan struct{})
	go func() { p.done.Wait(); close(stopped) }()
	select {
	case <-stopped:
	case <-ctx.Done():
		p.cancel()
		<-stopped
	}
	p.cfg.Client.CloseIdleConnections()
}

// Stats returns the pusher's counters.
func (p *Pusher) Stats() PusherStats {
	return PusherStats{Sent: p.sent.Load(), Retries: p.retries.Load(), Dropped: p.dropped.Load()}
}

func (p *Pusher) collect() {
	defer p.done.Done()
	defer close(p.queue)
	tick := time.NewTicker(p.cfg.Interval)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			p.enqueue()
		case <-p.stop:
			p.enqueue()
			return
		}
	}
}

func (p *Pusher) enqueue() {
	ds := p.reg.TakeDeltas()
	if len(ds) == 0 {
		return
	}
	rep := ActivityReport{SentAt: time.Now().UTC(), Sandboxes: ds}
	for {
		select {
		case p.queue <- rep:
			return
		default:
		}
		// Full: the receiver is down or slow. Evict the oldest report rather
		// than block or grow without bound.
		select {
		case <-p.queue:
			p.dropped.Add(1)
		default:
		}
	}
}

func (p *Pusher) deliver() {
	defer p.done.Done()
	defer p.cancel()
	for rep := range p.queue {
		if p.ctx.Err() != nil {
			p.dropped.Add(1)
			continue
		}
		p.post(p.ctx, rep)
	}
}

func (p *Pusher) post(ctx context.Context, rep ActivityReport) {
	body, err := json.Marshal(rep)
	if err != nil {
		p.dropped.Add(1)
		return
	}
	wait := p.cfg.Backoff
	for attempt := 1; ; attempt++ {
		if err := p.postOnce(ctx, body); err == nil {
			p.sent.Add(1)
			return
		}
		if attempt == p.cfg.Attempts {
			p.dropped.Add(1)
			return
		}
		p.retries.Add(1)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			p.dropped.Add(1)
			return
		}
		wait *= 2
	}
}

func (p *Pusher) postOnce(ctx context.Context, body []byte) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	defer cancel()
	if err := postJSON(ctx, p.cfg.Client, p.cfg.URL, p.cfg.Header, p.cfg.UserAgent, body); err != nil {
		return fmt.Errorf("activity pusher: %w", err)
	}
	return nil
}
