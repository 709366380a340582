package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/cphttp"
)

// A lookup answered with a redirect (301, 302, 307, 308) fails as
// LookupRedirect, naming the status and the Location; the redirect's target
// receives nothing (the configured Authorization stays with the control
// plane), and the failure is not cached: the next lookup asks again.
func TestLookupRedirectNotFollowed(t *testing.T) {
	for _, status := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			var asked, stolen atomic.Int64
			other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				stolen.Add(1)
				w.Write([]byte(`{"forwarder": "10.9.9.9:8443", "target": "10.9.9.9:80"}`))
			}))
			defer other.Close()
			location := other.URL + "/latest/meta-data"
			plane := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("Authorization") != "Bearer cp" {
					t.Errorf("the control plane got Authorization %q", r.Header.Get("Authorization"))
				}
				asked.Add(1)
				http.Redirect(w, r, location, status)
			}))
			defer plane.Close()
			l, err := NewLookup(LookupConfig{URL: plane.URL + "/v1/{sandbox}", Header: http.Header{"Authorization": {"Bearer cp"}}})
			if err != nil {
				t.Fatal(err)
			}
			for i := range 2 {
				loc, _, err := l.Resolve(context.Background(), "sbx-1")
				le, ok := errors.AsType[*LookupError](err)
				re, isRedirect := errors.AsType[*cphttp.RedirectError](err)
				want := fmt.Sprintf("%d %s", status, http.StatusText(status))
				if !ok || le.Reason != LookupRedirect || !isRedirect || re.Status != want || re.Location != location || loc != (Location{}) {
					t.Fatalf("lookup %d: %v, %v; want reason %s naming %q and Location %q", i, loc, err, LookupRedirect, want, location)
				}
				if msg := err.Error(); !strings.Contains(msg, fmt.Sprintf(": redirect: %s/v1/sbx-1 answered %s, Location %q: redirects are not followed", plane.URL, want, location)) {
					t.Errorf("error %q", msg)
				}
			}
			if asked.Load() != 2 || stolen.Load() != 0 {
				t.Errorf("the control plane got %d requests (want 2), the redirect's target %d (want 0)", asked.Load(), stolen.Load())
			}
		})
	}
}
