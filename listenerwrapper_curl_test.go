package caddyktls

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestListenerWrapperCurl downloads through the wrapper with curl (OpenSSL,
// nghttp2) over HTTP/1.1 and HTTP/2, on userspace TLS here.
func TestListenerWrapperCurl(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperCurl covers this kernel")
	}
	lwCurl(t, false)
}

// TestKernelListenerWrapperCurl is the curl download on a kTLS kernel:
// offloaded, and the HTTP/1.1 body sent with sendfile. KTLS_TEST_MIB=256 is
// the full-size run.
func TestKernelListenerWrapperCurl(t *testing.T) {
	kerneltest.Require(t)
	lwCurl(t, true)
}

func lwCurl(t *testing.T, kernel bool) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		if kerneltest.Required() {
			t.Fatalf("curl is needed in the VM: %v", err)
		}
		t.Skipf("SKIP: no curl: %v", err)
	}
	s := lwStartSite(t, map[string]any{"sendfile": true})
	caFile := s.ca.WriteFile(t, t.TempDir(), "ca")
	for _, proto := range []string{"--http1.1", "--http2"} {
		t.Run(strings.TrimPrefix(proto, "--"), func(t *testing.T) {
			before, rf := ktls.Stats().Outcomes[ktls.ReasonNone], lwReadFromNow()
			out := filepath.Join(t.TempDir(), "blob")
			cmd := exec.Command(curl, "--silent", "--show-error", "--fail", proto, "--cacert", caFile,
				"--resolve", fmt.Sprintf("localhost:%d:127.0.0.1", s.port),
				"--output", out, "--write-out", "%{http_version} %{size_download}", s.url("localhost", "/files/blob.bin"))
			got, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("curl: %v: %s", err, got)
			}
			wantVersion := map[string]string{"--http1.1": "1.1", "--http2": "2"}[proto]
			if want := fmt.Sprintf("%s %d", wantVersion, len(s.file)); string(got) != want {
				t.Errorf("curl reports %q, want %q", got, want)
			}
			body, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			if lwSHA(body) != lwSHA(s.file) {
				t.Fatalf("curl downloaded %d bytes with a different SHA-256 (want %d bytes)", len(body), len(s.file))
			}
			if !kernel {
				return
			}
			if ktls.Stats().Outcomes[ktls.ReasonNone] == before {
				t.Error("curl's connection was not offloaded")
			}
			if d := lwReadFromNow().sub(rf); proto == "--http1.1" && d.sendfileBytes < uint64(len(s.file)-512) {
				t.Errorf("HTTP/1.1 body: %d bytes by sendfile, want >= %d", d.sendfileBytes, len(s.file)-512)
			}
		})
	}
}
