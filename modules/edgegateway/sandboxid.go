package edgegateway

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ktlsingress/caddy-ktls/preamble"
)

// checkSandboxOption refuses a gateway module's sandbox option that holds
// no placeholder and is no sandbox ID even lowercased ("..", ".a", "a/b"):
// every connection or request would fail with it. A value with a
// placeholder is checked where it is used, after replacement
// (gateway.ParseRoute, gateway.Lookup.Resolve), and an uppercase literal
// is used lowercased there, as every sandbox ID is.
func checkSandboxOption(module, value, example string) error {
	if strings.Contains(value, "{") {
		return nil
	}
	if _, err := preamble.CanonicalSandboxID(value); err != nil {
		detail := err.Error()
		var pe *preamble.Error
		if errors.As(err, &pe) {
			detail = pe.Detail
		}
		return fmt.Errorf("%s: `sandbox`: %s: give a sandbox ID or a placeholder such as %s", module, detail, example)
	}
	return nil
}
