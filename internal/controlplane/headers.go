package controlplane

import (
	"net/http"
	"os"
	"regexp"
	"runtime/debug"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// loadHeaders replaces the global placeholders ({env.NAME}) of headers
// sent to a control plane, once, at load; an empty one is a WARN.
func LoadHeaders(logger *zap.Logger, headers http.Header) http.Header {
	repl := caddy.NewReplacer()
	out := make(http.Header, len(headers))
	for name, values := range headers {
		for _, v := range values {
			warnEmptyEnv(logger, name, v)
			out.Add(name, repl.ReplaceAll(v, ""))
		}
	}
	return out
}

// envPlaceholder is a {env.NAME} placeholder.
var envPlaceholder = regexp.MustCompile(`\{env\.([^{}]+)\}`)

// warnEmptyEnv warns, at load, of an activity_push header value whose
// {env.NAME} placeholder is empty: the control plane would get a header
// without its secret (an "Authorization: Bearer " that it refuses), and
// the reports would be retried, then dropped.
func warnEmptyEnv(logger *zap.Logger, header, value string) {
	for _, m := range envPlaceholder.FindAllStringSubmatch(value, -1) {
		if os.Getenv(m[1]) == "" {
			logger.Warn("activity_push header placeholder is empty: the header goes out without it",
				zap.String("header", header), zap.String("placeholder", m[0]),
				zap.String("fix", "set "+m[1]+" in Caddy's environment (deploy/systemd: EnvironmentFile=/etc/caddy/caddy-ktls.env)"))
		}
	}
}

// userAgent is the User-Agent of this module's outgoing requests:
// caddy-ktls/<module version>, "(devel)" for a build from a checkout.
func UserAgent() string {
	version := "(devel)"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, m := range append([]*debug.Module{&bi.Main}, bi.Deps...) {
			if m.Path == "github.com/ktlsingress/caddy-ktls" && m.Version != "" {
				version = m.Version
			}
		}
	}
	return "caddy-ktls/" + version
}
