package forward

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/ktlsingress/caddy-ktls/internal/cphttp"
)

// ActivityReport is the JSON body a Pusher POSTs (its JSON Schema is
// docs/activity-report.schema.json). Each entry is the bytes a sandbox
// moved since the entry before it, and the cumulative totals of all its
// entries since `since`; a sandbox that is open but idle appears with zero
// deltas so the receiver can tell idle from gone, and one whose last tunnel
// closed appears once more with open_tunnels 0.
//
// Delivery is at least once: a report is retried until a 2xx answer or its
// attempts run out, every attempt with the same body. A receiver
// deduplicates by id (or by instance, process_start and sequence) and may
// sum the deltas of the reports it kept; the totals make a lost report's
// bytes recoverable (the difference between two totals of one sandbox and
// since) and a repeated report harmless.
//
//	{"id":"fwd-1/1764456000000000000/42","instance":"fwd-1",
//	 "process_start":"2026-11-29T22:40:00Z","sequence":42,
//	 "sent_at":"2026-11-29T22:41:28Z","sandboxes":[
//	  {"sandbox":"sbx-1","bytes_to_sandbox":1024,"bytes_from_sandbox":4096,
//	   "open_tunnels":1,"last_activity":"2026-11-29T22:41:27.5Z",
//	   "total_bytes_to_sandbox":8192,"total_bytes_from_sandbox":65536,
//	   "since":"2026-11-29T22:40:03Z"}]}
type ActivityReport struct {
	ReportID
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
	Client   *http.Client  // default: a client with Timeout; it never follows a redirect (a 3xx is a failed attempt, counted Redirected)
	Header   http.Header   // sent with every POST (a control plane's credentials); Content-Type is always JSON
	// UserAgent is sent as User-Agent unless Header sets one; default
	// "caddy-ktls".
	UserAgent string
	// Instance names this forwarder in the reports' IDs (ReportID); default
	// the host name. It must not contain a slash or a control character.
	Instance string
	// OnDrop, when set, is called once for every report the pusher gives
	// up on, before Stop returns, from either of the pusher's two
	// goroutines: it may run concurrently with itself, and must not block.
	OnDrop func(Drop)
}

// The reasons a Pusher drops a report (Drop.Reason).
const (
	DropAttempts  = "attempts"   // every attempt failed
	DropQueueFull = "queue-full" // the oldest of a full queue, evicted for a newer report
	DropStopped   = "stopped"    // Stop's deadline passed before it was delivered
	DropEncode    = "encode"     // it could not be encoded as JSON
)

// DropReasons lists every Drop.Reason.
func DropReasons() []string { return []string{DropAttempts, DropQueueFull, DropStopped, DropEncode} }

// Drop is a report a Pusher gave up on (PusherConfig.OnDrop). Its bytes are
// not lost to a receiver that gets a later report: the totals of each
// sandbox's next entry include them.
type Drop struct {
	Report    ReportID
	Sandboxes int    // the report's entries
	Reason    string // DropAttempts, DropQueueFull, DropStopped, DropEncode
	Attempts  int    // the POSTs made for it
	// Err is the last attempt's failure: the control plane's answer (its
	// status and the start of its body), or why there was none. Nil when
	// no attempt was made.
	Err error
}

// PusherStats counts what a Pusher did.
type PusherStats struct {
	Sent    uint64 // reports accepted with a 2xx status
	Retries uint64 // failed attempts that were retried
	Dropped uint64 // reports given up on (attempts exhausted, or evicted from a full queue)
	// Redirected counts the attempts the receiver answered with a redirect,
	// which is not followed (*cphttp.RedirectError); each is also a retry
	// or ends in a drop.
	Redirected uint64
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

	sent, retries, dropped, redirected atomic.Uint64
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
	if cfg.Instance == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			return nil, fmt.Errorf("activity pusher: no instance name, and the host name is unknown (%v): name the instance", err)
		}
		cfg.Instance = host
	}
	if err := CheckInstance(cfg.Instance); err != nil {
		return nil, fmt.Errorf("activity pusher: %w", err)
	}
	if cfg.Client == nil {
		// Its own transport, so that Stop can close the idle connections
		// of a pusher that a configuration reload retired.
		cfg.Client = &http.Client{Timeout: cfg.Timeout, Transport: http.DefaultTransport.(*http.Transport).Clone()}
	}
	cfg.Client = cphttp.NoRedirects(cfg.Client)
	ctx, cancel := context.WithCancel(context.Background())
	return &Pusher{cfg: cfg, reg: reg, queue: make(chan ActivityReport, cfg.Queue), stop: make(chan struct{}), ctx: ctx, cancel: cancel}, nil
}

// CheckInstance says what is wrong with an instance name for the reports'
// IDs: empty, a slash (the ID's separator) or a control character.
func CheckInstance(name string) error {
	if name == "" {
		return fmt.Errorf("empty instance name")
	}
	for _, c := range name {
		if c == '/' || unicode.IsControl(c) {
			return fmt.Errorf("instance name %q: a slash or a control character: the report ID is <instance>/<process start>/<sequence>", name)
		}
	}
	return nil
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
	return PusherStats{Sent: p.sent.Load(), Retries: p.retries.Load(), Dropped: p.dropped.Load(), Redirected: p.redirected.Load()}
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
	rep, ok := p.reg.TakeReport(p.cfg.Instance)
	if !ok {
		return
	}
	for {
		select {
		case p.queue <- rep:
			return
		default:
		}
		// Full: the receiver is down or slow. Evict the oldest report rather
		// than block or grow without bound.
		select {
		case old := <-p.queue:
			p.drop(old, DropQueueFull, 0, nil)
		default:
		}
	}
}

// drop counts rep as dropped and reports it (OnDrop).
func (p *Pusher) drop(rep ActivityReport, reason string, attempts int, err error) {
	p.dropped.Add(1)
	if p.cfg.OnDrop != nil {
		p.cfg.OnDrop(Drop{Report: rep.ReportID, Sandboxes: len(rep.Sandboxes), Reason: reason, Attempts: attempts, Err: err})
	}
}

func (p *Pusher) deliver() {
	defer p.done.Done()
	defer p.cancel()
	for rep := range p.queue {
		if p.ctx.Err() != nil {
			p.drop(rep, DropStopped, 0, nil)
			continue
		}
		p.post(p.ctx, rep)
	}
}

func (p *Pusher) post(ctx context.Context, rep ActivityReport) {
	body, err := json.Marshal(rep)
	if err != nil {
		p.drop(rep, DropEncode, 0, err)
		return
	}
	wait := p.cfg.Backoff
	for attempt := 1; ; attempt++ {
		err := p.postOnce(ctx, body)
		if err == nil {
			p.sent.Add(1)
			return
		}
		if attempt == p.cfg.Attempts {
			p.drop(rep, DropAttempts, attempt, err)
			return
		}
		p.retries.Add(1)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			p.drop(rep, DropStopped, attempt, err)
			return
		}
		wait *= 2
	}
}

func (p *Pusher) postOnce(ctx context.Context, body []byte) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	defer cancel()
	if err := postJSON(ctx, p.cfg.Client, p.cfg.URL, p.cfg.Header, p.cfg.UserAgent, body); err != nil {
		if _, ok := errors.AsType[*cphttp.RedirectError](err); ok {
			p.redirected.Add(1)
		}
		return fmt.Errorf("activity pusher: %w", err)
	}
	return nil
}
