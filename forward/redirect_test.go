package forward

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/cphttp"
)

// redirectStatuses are the answers net/http follows by default.
var redirectStatuses = []int{http.StatusMovedPermanently, http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect}

// redirectPlane is a control plane that answers every request with status
// and a Location on another server, which counts what reaches it.
type redirectPlane struct {
	url, location string
	asked, stolen atomic.Int64
	token         atomic.Value // the X-Token of the last request the control plane got
}

func newRedirectPlane(t *testing.T, status int) *redirectPlane {
	p := &redirectPlane{}
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.stolen.Add(1)
	}))
	t.Cleanup(other.Close)
	p.location = other.URL + "/latest/meta-data"
	plane := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.asked.Add(1)
		p.token.Store(r.Header.Get("X-Token"))
		http.Redirect(w, r, p.location, status)
	}))
	t.Cleanup(plane.Close)
	p.url = plane.URL + "/cp"
	return p
}

// check says what is wrong with err, the failure of one call to p: it must
// be a *cphttp.RedirectError naming the status and the Location, and the
// redirect's target must have received nothing.
func (p *redirectPlane) check(t *testing.T, status int, err error) {
	t.Helper()
	re, ok := errors.AsType[*cphttp.RedirectError](err)
	want := fmt.Sprintf("%d %s", status, http.StatusText(status))
	if !ok || re.Status != want || re.Location != p.location {
		t.Errorf("error %v, want a redirect error naming %q and Location %q", err, want, p.location)
	}
	if msg := fmt.Sprint(err); !strings.Contains(msg, fmt.Sprintf("answered %s, Location %q: redirects are not followed", want, p.location)) {
		t.Errorf("error %q does not name the status and the Location", msg)
	}
	if n := p.stolen.Load(); n != 0 {
		t.Errorf("the redirect's target received %d requests, want 0", n)
	}
	if tok, _ := p.token.Load().(string); tok != "secret" {
		t.Errorf("the control plane got X-Token %q, want the configured one", tok)
	}
}

// A wake answered with a redirect fails with the status and the Location,
// and nothing (neither the token nor the body) reaches the redirect's
// target; the tunnel is refused as wake-failed and the wake's outcome is
// redirected.
func TestWakeRedirectNotFollowed(t *testing.T) {
	for _, status := range redirectStatuses {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			p := newRedirectPlane(t, status)
			waker, err := NewWaker(WakerConfig{URL: p.url, Header: http.Header{"X-Token": {"secret"}}, Timeout: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			_, err = waker.Wake(context.Background(), "sbx-1", forwardtest.ClosedPort(t))
			p.check(t, status, err)
			if n := p.asked.Load(); n != 1 {
				t.Errorf("the control plane got %d requests, want 1", n)
			}
		})
	}
	p := newRedirectPlane(t, http.StatusTemporaryRedirect)
	waker, err := NewWaker(WakerConfig{URL: p.url, Header: http.Header{"X-Token": {"secret"}}, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var log wakeLog
	f := newFixture(t, func(cfg *Config) { cfg.Wake, cfg.WakeTimeout, cfg.OnWake = waker, 2*time.Second, log.observe })
	err = f.refused(t, 1, string(ReasonWakeFailed), func(conn *net.TCPConn) {
		conn.Write(append(f.gw.Frame(t, "sbx-gone", forwardtest.ClosedPort(t)), "tenant bytes"...))
	})
	p.check(t, http.StatusTemporaryRedirect, err)
	if o := log.get(); len(o) != 1 || o[0] != WakeRedirected {
		t.Errorf("wake outcomes %v, want [%s]", o, WakeRedirected)
	}
}

// An activity report answered with a redirect is not delivered there:
// each attempt fails, is counted redirected, retried, and the report is
// dropped; the redirect's target receives nothing.
func TestPusherRedirectNotFollowed(t *testing.T) {
	forwardtest.CheckLeaks(t)
	for _, status := range redirectStatuses {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			p := newRedirectPlane(t, status)
			reg := NewRegistry()
			pusher, err := NewPusher(PusherConfig{URL: p.url, Interval: time.Hour, Attempts: 2, Backoff: time.Millisecond,
				Header: http.Header{"X-Token": {"secret"}}, Instance: "fwd-1"}, reg)
			if err != nil {
				t.Fatal(err)
			}
			p.check(t, status, pusher.postOnce(context.Background(), []byte(`{}`)))
			pusher.Start()
			tun, _, _ := reg.Open("sbx", "10.0.0.1:1", Origin{Peer: "peer"}, 0)
			tun.AddToSandbox(1 << 10)
			tun.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			pusher.Stop(ctx)
			if st := pusher.Stats(); st != (PusherStats{Retries: 1, Dropped: 1, Redirected: 3}) {
				t.Errorf("stats %+v, want 3 attempts redirected (1 direct, 2 of the report), 1 retry, 1 drop", st)
			}
			if n := p.asked.Load(); n != 3 {
				t.Errorf("the control plane got %d requests, want 3", n)
			}
			if n := p.stolen.Load(); n != 0 {
				t.Errorf("the redirect's target received %d requests, want 0", n)
			}
		})
	}
}
