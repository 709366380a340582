package cphttp

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// NoRedirects keeps the client's transport and timeout and hands every
// 3xx back; Redirect names the status and the Location of a 3xx (or says
// there was none) and nothing else.
func TestNoRedirects(t *testing.T) {
	tr := &http.Transport{}
	c := NoRedirects(&http.Client{Transport: tr, Timeout: 3 * time.Second})
	if c.Transport != tr || c.Timeout != 3*time.Second {
		t.Errorf("client %+v, want the transport and timeout kept", c)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/moved":
			http.Redirect(w, r, "http://169.254.169.254/latest", http.StatusTemporaryRedirect)
		case "/multiple":
			w.WriteHeader(http.StatusMultipleChoices)
		case "/latest":
			t.Error("the redirect was followed")
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	}))
	defer srv.Close()
	for _, tc := range []struct{ path, want string }{
		{"/moved", srv.URL + `/moved answered 307 Temporary Redirect, Location "http://169.254.169.254/latest": redirects are not followed (the credentials and the body would go there): configure the URL that answers itself`},
		{"/multiple", srv.URL + `/multiple answered 300 Multiple Choices, Location (none): redirects are not followed (the credentials and the body would go there): configure the URL that answers itself`},
		{"/missing", ""},
	} {
		resp, err := NoRedirects(nil).Get(srv.URL + tc.path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		err = Redirect(srv.URL+tc.path, resp)
		var re *RedirectError
		if tc.want == "" && err != nil || tc.want != "" && (!errors.As(err, &re) || err.Error() != tc.want) {
			t.Errorf("%s: %v, want %q", tc.path, err, tc.want)
		}
	}
}
