package adminapi

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// countingBody is a request body of left bytes that counts what is read
// of it.
type countingBody struct {
	left, read int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	if b.left == 0 {
		return 0, io.EOF
	}
	n := min(int64(len(p)), b.left)
	b.left -= n
	b.read += n
	return int(n), nil
}

func (b *countingBody) Close() error { return nil }

// A route reads what its handler left of the body, up to MaxDrain, and
// nothing of a body declared longer; the handler's answer is its own.
func TestRouteDrainsTheBody(t *testing.T) {
	refusal := caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: errors.New("method not allowed")}
	cases := []struct {
		name      string
		size      int64 // the body's
		length    int64 // its Content-Length; -1: chunked
		handler   int64 // what the handler reads
		wantRead  int64 // what is read in all
		wantOnEnd bool  // the body read to its end
	}{
		{"unread, declared", 100 << 10, 100 << 10, 0, 100 << 10, true},
		{"half read", 100 << 10, 100 << 10, 50 << 10, 100 << 10, true},
		{"unread, chunked", 100 << 10, -1, 0, 100 << 10, true},
		{"at the bound", MaxDrain, MaxDrain, 0, MaxDrain, true},
		{"declared over the bound", MaxDrain + 1, MaxDrain + 1, 0, 0, false},
		{"chunked over the bound", 1 << 20, -1, 0, MaxDrain, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			body := &countingBody{left: tc.size}
			route := Route("/x", func(w http.ResponseWriter, r *http.Request) error {
				if tc.handler > 0 {
					buf := make([]byte, tc.handler)
					if _, err := r.Body.Read(buf); err != nil {
						t.Fatal(err)
					}
				}
				return refusal
			})
			if route.Pattern != "/x" {
				t.Errorf("pattern %q, want /x", route.Pattern)
			}
			r := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader(""))
			r.Body, r.ContentLength = body, tc.length
			err := route.Handler.ServeHTTP(httptest.NewRecorder(), r)
			if ae, ok := errors.AsType[caddy.APIError](err); !ok || ae.HTTPStatus != refusal.HTTPStatus {
				t.Errorf("the route answered %v, want the handler's %v", err, refusal)
			}
			if body.read != tc.wantRead || (body.left == 0) != tc.wantOnEnd {
				t.Errorf("read %d of %d bytes (%d left), want %d read, to the end: %v", body.read, tc.size, body.left, tc.wantRead, tc.wantOnEnd)
			}
		})
	}
}
