package cli

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// "caddy sandbox upgrade" posts to the admin API's /sandbox/upgrade and
// prints its answer; an error answer fails the command with its text.
func TestUpgradeCommand(t *testing.T) {
	var posts []string
	status, body := http.StatusOK, `{"pid":42,"moved":3}`
	admin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		posts = append(posts, r.Method+" "+r.URL.Path)
		w.WriteHeader(status)
		w.Write([]byte(body))
	}))
	defer admin.Close()
	addr := strings.TrimPrefix(admin.URL, "http://")
	run := func() (string, error) {
		cmd := upgradeCommand()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(io.Discard)
		cmd.SetArgs([]string{"--address", addr})
		err := cmd.Execute()
		return out.String(), err
	}
	if out, err := run(); err != nil || out != body {
		t.Errorf("upgrade printed %q, %v; want the answer %q", out, err, body)
	}
	status, body = http.StatusBadGateway, `{"error":"the new process (pid 43) exited before it took over"}`
	if _, err := run(); err == nil || !strings.Contains(err.Error(), "exited before it took over") {
		t.Errorf("a failed upgrade: %v, want the answer's error", err)
	}
	if len(posts) != 2 || posts[0] != "POST /sandbox/upgrade" {
		t.Errorf("requests %v, want two POST /sandbox/upgrade", posts)
	}
}
