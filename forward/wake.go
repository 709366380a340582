package forward

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/cphttp"
)

// Defaults for the zero values of WakerConfig and Config's wake fields.
const (
	DefaultWakeRequestTimeout = 10 * time.Second
	DefaultWakeTimeout        = 30 * time.Second
	// wakeBackoffFirst and wakeBackoffMax bound the waits between the
	// dials that follow a wake: a paused sandbox resumes in seconds.
	wakeBackoffFirst = 50 * time.Millisecond
	wakeBackoffMax   = time.Second
)

// WakerConfig configures a Waker.
type WakerConfig struct {
	// URL receives a POST of {"sandbox": "<id>", "target": "<ip:port>"}
	// when a sandbox's target does not answer; any 2xx status means the
	// control plane is waking it. Required.
	URL string
	// Header is sent with every request (a control plane's credentials);
	// Content-Type is always JSON.
	Header http.Header
	// UserAgent is sent unless Header sets one; default "caddy-ktls".
	UserAgent string
	// Timeout bounds one request. Zero means DefaultWakeRequestTimeout.
	Timeout time.Duration
	// Client makes the requests; nil means a client of its own. It never
	// follows a redirect: a 3xx answer fails the wake
	// (*cphttp.RedirectError, outcome WakeRedirected).
	Client *http.Client
}

// Waker asks a control plane to wake sandboxes: concurrent wakes of one
// sandbox share one request. It is safe for concurrent use.
type Waker struct {
	cfg      WakerConfig
	mu       sync.Mutex
	inflight map[string]*wakeCall
}

type wakeCall struct {
	done chan struct{}
	err  error
}

// NewWaker returns a Waker for cfg.
func NewWaker(cfg WakerConfig) (*Waker, error) {
	if cfg.URL == "" {
		return nil, errors.New("forward: wake needs a URL")
	}
	if cfg.Timeout < 0 {
		return nil, errors.New("forward: negative wake request timeout")
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultWakeRequestTimeout
	}
	if cfg.UserAgent == "" {
		cfg.UserAgent = "caddy-ktls"
	}
	cfg.Client = cphttp.NoRedirects(cfg.Client)
	return &Waker{cfg: cfg, inflight: map[string]*wakeCall{}}, nil
}

// Wake asks the control plane to wake sandbox, whose service is target,
// and reports whether it accepted. A wake of sandbox already in flight is
// joined instead of repeated (coalesced reports that). ctx bounds this
// caller's wait only.
func (w *Waker) Wake(ctx context.Context, sandbox string, target netip.AddrPort) (coalesced bool, err error) {
	w.mu.Lock()
	call, coalesced := w.inflight[sandbox]
	if !coalesced {
		call = &wakeCall{done: make(chan struct{})}
		w.inflight[sandbox] = call
		go func() {
			call.err = w.request(sandbox, target)
			w.mu.Lock()
			delete(w.inflight, sandbox)
			w.mu.Unlock()
			close(call.done)
		}()
	}
	w.mu.Unlock()
	select {
	case <-call.done:
		return coalesced, call.err
	case <-ctx.Done():
		return coalesced, ctx.Err()
	}
}

func (w *Waker) request(sandbox string, target netip.AddrPort) error {
	body, err := json.Marshal(map[string]string{"sandbox": sandbox, "target": target.String()})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), w.cfg.Timeout)
	defer cancel()
	if err := postJSON(ctx, w.cfg.Client, w.cfg.URL, w.cfg.Header, w.cfg.UserAgent, body); err != nil {
		return fmt.Errorf("wake request: %w", err)
	}
	return nil
}

// The outcomes of a wake, as Config.OnWake reports them.
const (
	WakeWoken      = "woken"       // the target answered after the wake
	WakeFailed     = "wake-failed" // the control plane did not accept the wake
	WakeDialFailed = "dial-failed" // the wake was accepted, the target never answered within the wake timeout
	// WakeRedirected: the control plane answered the wake with a redirect,
	// which is not followed (the tunnel is refused as ReasonWakeFailed).
	WakeRedirected = "redirected"
)

// WakeEvent is one wake, as Config.OnWake reports it.
type WakeEvent struct {
	Sandbox  string
	Target   netip.AddrPort
	Outcome  string        // one of WakeOutcomes
	Duration time.Duration // from the wake request to the target's answer or the wake's failure
}

// WakeOutcomes are every outcome Config.OnWake reports.
func WakeOutcomes() []string {
	return []string{WakeWoken, WakeFailed, WakeDialFailed, WakeRedirected}
}

// wakeAndDial wakes the sandbox of a target that did not answer and dials
// it again, backing off, until it answers or the wake timeout ends. The
// gateway's bytes wait in the kernel meanwhile: nothing past the preamble
// has been read.
func (f *Forwarder) wakeAndDial(sandbox string, target netip.AddrPort, first error) (*net.TCPConn, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), f.cfg.WakeTimeout)
	defer cancel()
	outcome := WakeWoken
	defer func() {
		if f.cfg.OnWake != nil {
			f.cfg.OnWake(WakeEvent{Sandbox: sandbox, Target: target, Outcome: outcome, Duration: time.Since(start)})
		}
	}()
	if _, err := f.cfg.Wake.Wake(ctx, sandbox, target); err != nil {
		outcome = WakeFailed
		if _, ok := errors.AsType[*cphttp.RedirectError](err); ok {
			outcome = WakeRedirected
		}
		return nil, &RefusalError{Reason: ReasonWakeFailed, Err: fmt.Errorf("sandbox %s: target %s: %v; the wake failed: %w", sandbox, target, first, err)}
	}
	backoff := wakeBackoffFirst
	for {
		dctx, dcancel := context.WithTimeout(ctx, f.cfg.DialTimeout)
		up, derr := f.sock.dial(dctx, target.String(), f.cfg.DialTimeout)
		dcancel()
		if derr == nil {
			return up, nil
		}
		select {
		case <-ctx.Done():
			outcome = WakeDialFailed
			return nil, &RefusalError{Reason: ReasonDialFailed, Err: fmt.Errorf("sandbox %s: target %s did not answer within %v of its wake: %w", sandbox, target, f.cfg.WakeTimeout, derr)}
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, wakeBackoffMax)
	}
}
