// Package cphttp is the HTTP rule every control-plane client of this
// module follows (forward's wake and activity pusher, gateway's lookup): a
// request goes to the configured URL and nowhere else. A redirect is never
// followed, to any host: its target would receive the request's
// credentials (the configured headers) and its body. A 3xx answer is a
// failure of that call, a *RedirectError naming the status and the
// Location. Do is the one way those clients send a call and read its answer.
package cphttp

import (
	"fmt"
	"io"
	"net/http"
)

// NoRedirects returns a client that makes c's requests (its transport,
// timeout and jar) but hands a redirect answer back instead of following
// it; nil c: a client of its own.
func NoRedirects(c *http.Client) *http.Client {
	var nc http.Client
	if c != nil {
		nc = *c
	}
	nc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &nc
}

// RedirectError is a control plane's 3xx answer, which is not followed.
type RedirectError struct {
	URL      string // the URL asked
	Status   string // the answer's status line, e.g. "307 Temporary Redirect"
	Location string // the answer's Location header, empty when it had none
}

func (e *RedirectError) Error() string {
	loc := fmt.Sprintf("%q", e.Location)
	if e.Location == "" {
		loc = "(none)"
	}
	return fmt.Sprintf("%s answered %s, Location %s: redirects are not followed (the credentials and the body would go there): "+
		"configure the URL that answers itself", e.URL, e.Status, loc)
}

// Redirect returns a *RedirectError when resp, the answer to url, is a
// 3xx, and nil otherwise.
func Redirect(url string, resp *http.Response) error {
	if resp.StatusCode/100 != 3 {
		return nil
	}
	return &RedirectError{URL: url, Status: resp.Status, Location: resp.Header.Get("Location")}
}

// Do sends req, a control-plane call, with client (from NoRedirects), and
// reads at most limit+1 bytes of the answer, so that the caller can tell an
// answer over limit; the rest is dropped and the body closed. A 3xx is a
// *RedirectError; every other status is the caller's to judge.
func Do(client *http.Client, req *http.Request, limit int64) (*http.Response, []byte, error) {
	resp, err := client.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if rerr := Redirect(req.URL.String(), resp); rerr != nil {
		return resp, answer, rerr
	}
	return resp, answer, err
}
