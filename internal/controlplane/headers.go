// Package controlplane is what the Caddy modules that call a control plane
// (the forwarder's activity_push and wake, the gateway's sandbox_lookup)
// do alike: load the configured headers once, and name themselves in the
// User-Agent.
package controlplane

import (
	"net/http"
	"os"
	"regexp"
	"runtime/debug"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// LoadHeaders replaces the global placeholders ({env.NAME}) of the headers
// that option (activity_push, wake, sandbox_lookup) sends to a control
// plane, once, at load; an empty one is a WARN.
func LoadHeaders(logger *zap.Logger, option string, headers http.Header) http.Header {
	repl := caddy.NewReplacer()
	out := make(http.Header, len(headers))
	for name, values := range headers {
		for _, v := range values {
			warnEmptyEnv(logger, option, name, v)
			out.Add(name, repl.ReplaceAll(v, ""))
		}
	}
	return out
}

// envPlaceholder is a {env.NAME} placeholder.
var envPlaceholder = regexp.MustCompile(`\{env\.([^{}]+)\}`)

// warnEmptyEnv warns, at load, of a header value of option whose
// {env.NAME} placeholder is empty: the control plane would get a header
// without its secret (an "Authorization: Bearer " that it refuses), and
// every call would fail.
func warnEmptyEnv(logger *zap.Logger, option, header, value string) {
	for _, m := range envPlaceholder.FindAllStringSubmatch(value, -1) {
		if os.Getenv(m[1]) == "" {
			logger.Warn(option+" header placeholder is empty: the header goes out without it",
				zap.String("option", option), zap.String("header", header), zap.String("placeholder", m[0]),
				zap.String("fix", "set "+m[1]+" in Caddy's environment (deploy/systemd: EnvironmentFile=/etc/caddy/caddy-ktls.env)"))
		}
	}
}

// UserAgent is the User-Agent of this module's outgoing requests:
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
