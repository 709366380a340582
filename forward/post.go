package forward

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"

	"github.com/ktlsingress/caddy-ktls/internal/cphttp"
)

// postJSON POSTs body to a control plane's url with header (its
// credentials) and userAgent unless header sets one, and reads the answer
// (at most 64 KiB, then dropped). Any status but 2xx is an error; a 3xx is
// a *cphttp.RedirectError, never followed (client comes from
// cphttp.NoRedirects).
func postJSON(ctx context.Context, client *http.Client, url string, header http.Header, userAgent string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("User-Agent", userAgent)
	for name, values := range header {
		req.Header[name] = values
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if err := cphttp.Redirect(url, resp); err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s answered %s", url, resp.Status)
	}
	return nil
}
