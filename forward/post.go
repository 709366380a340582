package forward

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/ktlsingress/caddy-ktls/internal/cphttp"
)

// postJSON POSTs body to a control plane's url with header (its
// credentials) and userAgent unless header sets one, and reads the answer
// (at most 64 KiB, then dropped). Any status but 2xx is an error that
// quotes the start of the answer's body (answerExcerpt); a 3xx is a
// *cphttp.RedirectError, never followed (client comes from
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
	resp, answer, err := cphttp.Do(client, req, 64<<10)
	if _, redirected := errors.AsType[*cphttp.RedirectError](err); redirected || resp == nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		if excerpt := answerExcerpt(answer); excerpt != "" {
			return fmt.Errorf("%s answered %s: %q", url, resp.Status, excerpt)
		}
		return fmt.Errorf("%s answered %s", url, resp.Status)
	}
	return nil
}

// answerExcerptLen bounds the part of a refusal's body an error quotes.
const answerExcerptLen = 256

// answerExcerpt is the start of a control plane's answer, for an error
// that quotes it: at most answerExcerptLen bytes, whitespace runs as one
// space, cut short with "…".
func answerExcerpt(body []byte) string {
	s := strings.Join(strings.Fields(strings.ToValidUTF8(string(body), "\uFFFD")), " ")
	if len(s) > answerExcerptLen {
		cut := answerExcerptLen
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}
