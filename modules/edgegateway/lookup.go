package edgegateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/controlplane"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
)

func init() {
	caddy.RegisterModule(new(Lookup))
}

// Lookup is an HTTP handler that finds the sandbox a request is
// for through the control plane (gateway.Lookup: cached, coalesced,
// bounded) and sets the variables sandbox_id, sandbox_forwarder and
// sandbox_target ({http.vars.*}, {vars.*} in a Caddyfile) for the
// reverse_proxy with the sandbox transport after it; sandbox_id is the
// lowercase form of the ID (sandbox IDs are case-insensitive). A sandbox the control
// plane does not know, or a control plane that does not answer, ends the
// request with 502 and the reason in the log; nothing is proxied.
type Lookup struct {
	// The sandbox to look up and how the control plane is asked
	// (LookupOptions), at the top level of the JSON.
	LookupOptions
}

// LookupOptions configure a control plane lookup (gateway.LookupConfig);
// the HTTP and layer4 sandbox_lookup handlers embed them.
type LookupOptions struct {
	// Sandbox is the sandbox ID to look up; placeholders are replaced per
	// request or connection, e.g. {http.request.host.labels.2} or
	// {l4.tls.server_name.labels.2}. Required.
	Sandbox string `json:"sandbox,omitempty"`

	// URL is the control plane's endpoint, with {sandbox} where the
	// sandbox ID goes: a GET answers 200 {"forwarder": "host:port",
	// "target": "ip:port", "ttl": seconds} or 404 (docs/gateway.md).
	// Required.
	URL string `json:"url,omitempty"`

	// Headers are sent with every lookup (e.g. Authorization). Values may
	// use Caddy's global placeholders such as {env.CP_TOKEN}; they are
	// replaced once, at load.
	Headers http.Header `json:"headers,omitempty"`

	// Timeout bounds one lookup request. Default: 5s.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// TTL is how long an answer is used (an answer's own ttl may shorten
	// it). Default: 30s.
	TTL caddy.Duration `json:"ttl,omitempty"`

	// NegativeTTL is how long a 404 (no such sandbox) is remembered.
	// Default: 5s.
	NegativeTTL caddy.Duration `json:"negative_ttl,omitempty"`

	// MaxEntries bounds the cache; the least recently used entry goes
	// first. Default: 65536.
	MaxEntries int `json:"max_entries,omitempty"`

	logger *zap.Logger
	lookup *gateway.Lookup
}

// Validate checks the configuration without loading anything.
func (o *LookupOptions) Validate() error {
	if o.Sandbox == "" {
		return errors.New("sandbox_lookup: no sandbox: give the sandbox ID to look up, a placeholder such as {http.request.host.labels.2}")
	}
	if o.URL == "" {
		return errors.New("sandbox_lookup: no url: " + LookupURLHint)
	}
	return checkSandboxOption("sandbox_lookup", o.Sandbox, "{http.request.host.labels.2}")
}

// provision sets up the lookup of a handler that logs to logger.
func (o *LookupOptions) provision(ctx caddy.Context, module string, logger *zap.Logger) error {
	o.logger = logger
	if err := caddymetrics.Register(ctx, module); err != nil {
		return err
	}
	// Caddy validates after provisioning, which would fail first.
	if err := o.Validate(); err != nil {
		return err
	}
	l, err := o.newLookup(logger)
	if err != nil {
		return fmt.Errorf("sandbox_lookup: %w", err)
	}
	o.lookup = l
	return nil
}

// The variables (and replacer keys) a lookup sets.
const (
	lookupVarSandbox   = "sandbox_id"
	lookupVarForwarder = "sandbox_forwarder"
	lookupVarTarget    = "sandbox_target"
)

// newLookup builds the gateway.Lookup, with the headers' global
// placeholders replaced (an empty {env.…} is a WARN).
func (o *LookupOptions) newLookup(logger *zap.Logger) (*gateway.Lookup, error) {
	if o.Timeout < 0 || o.TTL < 0 || o.NegativeTTL < 0 || o.MaxEntries < 0 {
		return nil, errors.New("timeout, ttl, negative_ttl and max_entries must not be negative")
	}
	header := controlplane.LoadHeaders(logger, "sandbox_lookup", o.Headers)
	if header.Get("User-Agent") == "" {
		header.Set("User-Agent", controlplane.UserAgent())
	}
	return gateway.NewLookup(gateway.LookupConfig{
		URL: o.URL, Header: header, Timeout: time.Duration(o.Timeout),
		TTL: time.Duration(o.TTL), NegativeTTL: time.Duration(o.NegativeTTL), MaxEntries: o.MaxEntries,
	})
}

// resolve looks sandbox up, counts the outcome and logs a failure. module
// labels the metrics.
func resolve(ctx context.Context, l *gateway.Lookup, module, sandbox string, logger *zap.Logger, fields ...zap.Field) (gateway.Location, error) {
	start := time.Now()
	loc, src, err := l.Resolve(ctx, sandbox)
	result := string(src)
	if err != nil {
		var le *gateway.LookupError
		if errors.As(err, &le) {
			// The ID as looked up: lowercase, unless it was refused.
			result, sandbox = le.Reason, le.Sandbox
		}
		logger.Warn("sandbox lookup failed; nothing is proxied", append(fields, zap.String("sandbox", sandbox), zap.String("reason", result), zap.Error(err))...)
	}
	GatewayLookups.WithLabelValues(module, result).Inc()
	if src == gateway.SourceControlPlane || src == gateway.SourceCoalesced {
		gatewayLookupDuration.Observe(time.Since(start).Seconds())
	}
	return loc, err
}

// The lookup metrics.
var (
	GatewayLookups = caddymetrics.NewCounterFamily(prometheus.CounterOpts{
		Name: "caddy_ktls_gateway_lookups_total",
		Help: "Sandbox lookups by module and result: cache, control-plane, coalesced (answered, from where), or why none was: not-found, unavailable, bad-answer, bad-sandbox, redirect (the control plane answered with a redirect, which is not followed).",
	}, []string{"module", "result"}, moduleid.Lookup, LookupResults())
	// A control plane on the local network answers in a millisecond or
	// two, a loaded one in tens; the timeout (5 s by default) bounds it.
	gatewayLookupDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "caddy_ktls_gateway_lookup_duration_seconds",
		Help:    "Sandbox lookups that waited for the control plane (asked or coalesced), from the start to the answer or the failure.",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5},
	})
)

func init() {
	caddymetrics.Add(moduleid.Lookup, GatewayLookups, gatewayLookupDuration)
}

// LookupResults are the results resolve counts a lookup as: where the
// answer came from, or why there was none.
func LookupResults() []string {
	return append([]string{string(gateway.SourceCache), string(gateway.SourceControlPlane), string(gateway.SourceCoalesced)},
		gateway.LookupReasons()...)
}

// CaddyModule returns the Caddy module information.
func (*Lookup) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxLookupHTTP, New: func() caddy.Module { return new(Lookup) }}
}

// Provision sets up the handler.
func (h *Lookup) Provision(ctx caddy.Context) error {
	return h.provision(ctx, moduleid.SandboxLookupHTTP, ctx.Logger(h))
}

// ServeHTTP looks the request's sandbox up and sets its variables.
func (h *Lookup) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	sandbox := repl.ReplaceAll(h.Sandbox, "")
	loc, err := resolve(r.Context(), h.lookup, moduleid.SandboxLookupHTTP, sandbox, h.logger, zap.String("host", r.Host), zap.String("uri", r.RequestURI))
	if err != nil {
		return caddyhttp.Error(http.StatusBadGateway, err)
	}
	caddyhttp.SetVar(r.Context(), lookupVarSandbox, loc.Sandbox)
	caddyhttp.SetVar(r.Context(), lookupVarForwarder, loc.Forwarder)
	caddyhttp.SetVar(r.Context(), lookupVarTarget, loc.Target.String())
	return next.ServeHTTP(w, r)
}

// Interface guards.
var (
	_ caddyhttp.MiddlewareHandler = (*Lookup)(nil)
	_ caddy.Provisioner           = (*Lookup)(nil)
	_ caddy.Validator             = (*Lookup)(nil)
)
