package cli

import (
	"strings"
	"testing"
)

// TestSandboxCertsHelp: certs' help names the files it makes, the key
// modes, the refusal to overwrite, rotation, and the README section.
func TestSandboxCertsHelp(t *testing.T) {
	c := certsCommand()
	for _, want := range []string{certsDocURL, "0600", "No file is ever overwritten", "Rotation", "trust_pool"} {
		if !strings.Contains(c.Long, want) {
			t.Errorf("caddy sandbox certs --help lacks %q", want)
		}
	}
}
