package forwarder

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/controlplane"
	"github.com/ktlsingress/caddy-ktls/internal/l4conn"
	"github.com/ktlsingress/caddy-ktls/internal/logsummary"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

func init() {
	caddy.RegisterModule(new(Handler))
}

// Handler is a terminal handler that carries sandbox tunnels: it
// reads the gateway's signed preamble (under the one deadline a tunnel has),
// verifies it, checks the target against the allowlist, dials it and relays
// both directions with splice(2), metering every byte per tunnel and per
// sandbox. A refused tunnel is closed without a reply, logged in one line
// with its reason and counted; nothing is dialed for it.
//
// It carries tunnels only for gateways that authenticated with a verified
// client certificate: place it after `ktls` with client_auth (mutual TLS),
// so that splice reaches kernel sockets on both sides (behind caddy-l4's
// `tls` handler with client authentication it works too, with a userspace
// copy). A route with no TLS-terminating handler before it does not load,
// and every connection whose TLS session verified no client certificate is
// refused ("no-client-certificate") before its preamble is read.
type Handler struct {
	// Keys are the gateways' Ed25519 public keys, inline.
	Keys []Key `json:"keys,omitempty"`

	// KeyFiles are keyring files: PEM "PUBLIC KEY" blocks, each named by a
	// "Key-Id" header (or the key's derived ID without one).
	KeyFiles []string `json:"key_files,omitempty"`

	// KeyClients binds keys (by ID, inline or from key_files) to gateways:
	// a preamble signed by a key listed here is refused
	// ("key-not-for-client") unless the connection's client certificate has
	// one of the key's names as its Common Name or a DNS name. Keys not
	// listed may be used with any certificate the TLS policy admits.
	KeyClients map[string][]string `json:"key_clients,omitempty"`

	// RequireChannelBinding rejects preambles that are not bound to this
	// TLS session (the TLS 1.3 exporter the gateway signs), so a captured
	// preamble cannot be replayed on another connection.
	RequireChannelBinding bool `json:"require_channel_binding,omitempty"`

	// MaxClockSkew is the clock difference tolerated between gateway and
	// forwarder. Default: 30s.
	MaxClockSkew caddy.Duration `json:"max_clock_skew,omitempty"`

	// MaxPreambleTTL is the longest validity window a preamble may claim.
	// Default: 2m.
	MaxPreambleTTL caddy.Duration `json:"max_preamble_ttl,omitempty"`

	// ReplayCacheSize is how many nonces are remembered for replay
	// detection. Default: 65536. The cache outlives reloads as long as
	// this, max_preamble_ttl and max_clock_skew stay the same.
	ReplayCacheSize int `json:"replay_cache_size,omitempty"`

	// MaxTunnelsPerSandbox caps the tunnels open at once to one sandbox
	// (counted over the whole process, every configuration's tunnels
	// included): one more is refused with reason "tunnel-limit" before its
	// target is dialed. Default: 0, no cap.
	MaxTunnelsPerSandbox int `json:"max_tunnels_per_sandbox,omitempty"`

	// StandbyTimeout is how long a gateway's standby connection may wait
	// for its first preamble byte: a connection whose mutual TLS is done
	// and whose preamble the gateway has not written yet, kept ready so
	// that a new tunnel pays only its preamble and the target's dial (the
	// gateway modules' `standby`). The rest of the preamble must then
	// arrive within preamble_timeout, as any. Only connections with a
	// verified client certificate wait so, at most max_standby_per_client
	// of one certificate at once; the others have preamble_timeout from
	// their start. One that ends without a preamble is no refusal:
	// caddy_ktls_sandbox_standby_ends_total counts it (closed by the
	// gateway, or expired here, when the gateway reads the access_denied
	// alert). Default: 60s.
	StandbyTimeout caddy.Duration `json:"standby_timeout,omitempty"`

	// MaxStandbyPerClient bounds the standby connections of one client
	// certificate (its subject) waiting at once. Default: 64.
	MaxStandbyPerClient int `json:"max_standby_per_client,omitempty"`

	// DisableStandby gives every connection preamble_timeout from its
	// start: no standby connections.
	DisableStandby bool `json:"disable_standby,omitempty"`

	// MaxDials bounds the tunnels that dial their target at once, a wake
	// and its dials included, counted over the whole process: one more is
	// refused with reason "overloaded" before it dials, so that targets
	// slow to answer or to wake hold a bounded number of connections and
	// goroutines, and a gateway hears at once instead of waiting. Refusals
	// for it are logged at DEBUG, with one WARN summary a minute. Default:
	// 0, which means 1024; -1: no bound.
	MaxDials int `json:"max_dials,omitempty"`

	// MaxTunnelLifetime ends a tunnel that has been open this long as a
	// failure (both sides aborted), whatever it is doing: it bounds how
	// long a tunnel outlives a client certificate that a reload revoked
	// (a revoked key ends its tunnels at once).
	// Counted in caddy_ktls_sandbox_tunnels_expired_total. Default: 0, no
	// limit.
	MaxTunnelLifetime caddy.Duration `json:"max_tunnel_lifetime,omitempty"`

	// ProxyProtocol, when "v2", writes a PROXY protocol v2 header to each
	// target right after it is dialed, before any tenant byte: the source
	// is the end user's address from the signed preamble's client identity
	// (extension 0x0010, docs/preamble.md §3.1), or the gateway connection's
	// own peer address when the frame carries none; the destination is the
	// target; TLV 0xE0 holds the sandbox ID and TLV 0xE1 the client's
	// identity string when the frame has one. The header is not counted as
	// tenant bytes (metrics, activity). The target must expect the header:
	// turn it on only for targets that parse PROXY v2. Default: "" (none).
	ProxyProtocol string `json:"proxy_protocol,omitempty"`

	// PreambleTimeout bounds the wait for the whole preamble: the only
	// deadline a tunnel ever has. Default: 5s.
	PreambleTimeout caddy.Duration `json:"preamble_timeout,omitempty"`

	// DialTimeout bounds connecting to the target. Default: 10s.
	DialTimeout caddy.Duration `json:"dial_timeout,omitempty"`

	// KeepAlive is the TCP keepalive idle time and interval on both sockets.
	// Default: 30s.
	KeepAlive caddy.Duration `json:"keepalive,omitempty"`

	// TCPUserTimeout sets TCP_USER_TIMEOUT on both sockets (how long sent
	// data may go unacknowledged). Default: the kernel's.
	TCPUserTimeout caddy.Duration `json:"tcp_user_timeout,omitempty"`

	// AllowCIDRs are the networks targets may be in. Required: a handler
	// without an entry does not load (name the sandbox networks). Loopback,
	// link-local (including 169.254.169.254), multicast, unspecified,
	// broadcast and this host's own addresses are refused unless an entry
	// lies inside them: for example "127.0.0.0/8" opens loopback for a
	// demo, "0.0.0.0/0" does not.
	AllowCIDRs []string `json:"allow_cidrs,omitempty"`

	// AllowPorts are the target ports allowed, as "443" or "8000-8999";
	// empty allows all.
	AllowPorts []string `json:"allow_ports,omitempty"`

	// NAT64Prefixes declares the network-specific prefixes (RFC 6052: /32,
	// /40, /48, /56, /64 or /96) of the NAT64 translators targets may be
	// reached through. A target in one is also judged by the IPv4 address
	// that prefix length embeds, against the ranges refused by default
	// (169.254.169.254 behind NAT64 is refused as 169.254.169.254 is).
	// 64:ff9b::/96 needs no declaration, and an address in 64:ff9b:1::/48
	// that no declared prefix holds is judged by all four readings (/48,
	// /56, /64, /96) its translator could use: declare the local-use
	// prefix in use to be judged by its reading alone. Default: none.
	NAT64Prefixes []string `json:"nat64_prefixes,omitempty"`

	// ActivityPush, when set, POSTs per-sandbox byte deltas and cumulative
	// totals as JSON to a control plane, each report with an ID to
	// deduplicate (format: forward.ActivityReport, JSON Schema
	// docs/activity-report.schema.json; delivery at least once).
	ActivityPush *ActivityPush `json:"activity_push,omitempty"`

	// MaxBandwidth caps each sandbox's tunnels together, per direction,
	// in bytes per second: every tunnel of a sandbox in the process shares
	// one token bucket per direction, so more tunnels do not raise the
	// cap. The relay splices no more than the bucket grants (the fast path
	// stays zero-copy); time spent waiting is counted in
	// caddy_ktls_sandbox_throttled_seconds_total{direction}. Default: no
	// cap.
	MaxBandwidth *Bandwidth `json:"max_bandwidth,omitempty"`

	// Wake, when set, wakes a sandbox whose target does not answer the dial
	// (a paused or moved sandbox): it POSTs {"sandbox": ..., "target": ...}
	// to the control plane (one request for concurrent tunnels of a
	// sandbox) and dials again, backing off, until the target answers or
	// the wake's timeout ends. The gateway's bytes wait in the kernel
	// meanwhile. Refused as "wake-failed" when the control plane does not
	// accept the wake, "dial-failed" when the target stays silent. Counted
	// in caddy_ktls_sandbox_wakes_total{outcome}.
	Wake *Wake `json:"wake,omitempty"`

	// DrainGracePeriod is how long open tunnels may keep running when the
	// process exits before they are closed. Reloads do not drain.
	// Default: 30s.
	DrainGracePeriod caddy.Duration `json:"drain_grace_period,omitempty"`

	// InsecurePlaintext is for tests only. It carries tunnels on
	// connections that no TLS handshake authenticated, plaintext over raw
	// TCP included: it turns off the load-time check that a TLS-terminating
	// handler comes before this one, and the refusal of connections
	// without a verified client certificate. Whoever reaches the port can
	// then open tunnels to every allowed target with any frame a trusted
	// key signed. Every load with it logs a WARN.
	InsecurePlaintext bool `json:"insecure_plaintext,omitempty"`

	ctx       caddy.Context
	logger    *zap.Logger
	fwd       *forward.Forwarder
	keys      map[string]ed25519.PublicKey // the gateway keys, by ID (Provision)
	pusher    *forward.Pusher
	pushDrops *pushDropLog // logs the reports pusher drops
	events    *caddyevents.App
	replayKey replayCacheKey // set while this handler holds a replayCaches reference
	// refusals summarizes the tunnels refused for a reason in
	// summarizedRefusals, by reason (Handle).
	refusals map[forward.Reason]*logsummary.FailureSummary
	// moveName is the handler's configuration's digest (moveNameOf): its
	// forwarder's MoveName.
	moveName string
}

// moveNameOf names a sandbox handler for an upgrade (upgrade.MoveName). A
// gateway's standby connection has sent no preamble whose key would choose
// a handler; it moves to the new process's handler configured the same
// (upgrade.go, adoptStandby).
func moveNameOf(h *Handler) (string, error) { return upgrade.MoveName(h) }

// Key is one inline gateway key.
type Key struct {
	// ID is the key ID gateways write in their preambles.
	ID string `json:"id"`
	// PublicKey is the Ed25519 public key: 32 raw bytes in standard base64,
	// or a PEM "PUBLIC KEY" block.
	PublicKey string `json:"public_key"`
}

// ActivityPush configures the activity reports.
type ActivityPush struct {
	// URL receives the POSTs.
	URL string `json:"url"`
	// Interval between reports. Default: 10s.
	Interval caddy.Duration `json:"interval,omitempty"`
	// Timeout per POST attempt. Default: 5s.
	Timeout caddy.Duration `json:"timeout,omitempty"`
	// Attempts per report before it is dropped. Default: 4.
	Attempts int `json:"attempts,omitempty"`
	// Backoff before the first retry, doubled after each. Default: 500ms.
	Backoff caddy.Duration `json:"backoff,omitempty"`
	// QueueSize is how many reports may wait; when full, the oldest is
	// dropped. Default: 16.
	QueueSize int `json:"queue_size,omitempty"`
	// Headers are sent with every POST, for the control plane to
	// authenticate the forwarder (e.g. "Authorization"). Values may use
	// Caddy's global placeholders, such as {env.ACTIVITY_TOKEN}, so that
	// secrets stay out of the configuration; they are replaced once, at
	// load. Content-Type is always application/json.
	Headers http.Header `json:"headers,omitempty"`
	// Instance names this forwarder in every report (its "instance", and
	// the first part of its "id": <instance>/<process start>/<sequence>).
	// No slash or control character. Default: the host name.
	Instance string `json:"instance,omitempty"`
}

// Bandwidth is a per-sandbox bandwidth cap.
type Bandwidth struct {
	// ToSandbox caps the bytes per second from gateways to the sandbox;
	// 0: no cap.
	ToSandbox int64 `json:"to_sandbox,omitempty"`
	// FromSandbox caps the bytes per second from the sandbox to gateways;
	// 0: no cap.
	FromSandbox int64 `json:"from_sandbox,omitempty"`
	// Burst is how many bytes a capped direction may move at once after a
	// quiet spell. Default: a tenth of a second's worth, at least 64 KiB.
	Burst int64 `json:"burst,omitempty"`
}

// Wake configures waking sandboxes on connect.
type Wake struct {
	// URL receives the wake POSTs; any 2xx status means the control plane
	// is waking the sandbox.
	URL string `json:"url"`
	// Headers are sent with every wake (the control plane's credentials);
	// values may use Caddy's global placeholders such as {env.WAKE_TOKEN},
	// replaced once, at load.
	Headers http.Header `json:"headers,omitempty"`
	// Timeout is how long a tunnel waits for its woken target (the wake
	// request and the dials after it). Default: 30s.
	Timeout caddy.Duration `json:"timeout,omitempty"`
	// RequestTimeout bounds the wake request. Default: 10s.
	RequestTimeout caddy.Duration `json:"request_timeout,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (*Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.SandboxHandler, New: func() caddy.Module { return new(Handler) }}
}

// Provision sets up the handler.
func (h *Handler) Provision(ctx caddy.Context) error {
	// Before anything Provision sets: the configuration as loaded.
	name, err := moveNameOf(h)
	if err != nil {
		return fmt.Errorf("sandbox handler: %w", err)
	}
	h.moveName = name
	h.ctx = ctx
	h.logger = ctx.Logger(h)
	if err := caddymetrics.Register(ctx, moduleid.SandboxHandler); err != nil {
		return err
	}
	// The checks that need nothing loaded come first (Validate runs
	// after Provision, whose effects a failed load then undoes).
	if err := h.validateOptions(); err != nil {
		return err
	}
	keys, err := h.keyring()
	if err != nil {
		return err
	}
	h.keys = keys
	replay, err := h.loadReplayCache()
	if err != nil {
		return fmt.Errorf("sandbox handler: %w", err)
	}
	verifier, err := preamble.NewVerifier(preamble.VerifierConfig{
		Keys:           keys,
		MaxSkew:        time.Duration(h.MaxClockSkew),
		MaxTTL:         time.Duration(h.MaxPreambleTTL),
		ReplayCache:    replay,
		RequireBinding: h.RequireChannelBinding,
	})
	if err != nil {
		return fmt.Errorf("sandbox handler: %w", err)
	}
	policy, err := forward.NewTargetPolicy(h.AllowCIDRs, h.AllowPorts, h.NAT64Prefixes...)
	if err != nil {
		return fmt.Errorf("sandbox handler: %s, %s, %s: %w", offload.Option("allow", "allow_cidrs"), offload.Option("allow_ports", "allow_ports"), offload.Option("nat64_prefix", "nat64_prefixes"), err)
	}
	var waker *forward.Waker
	var wakeTimeout time.Duration
	if w := h.Wake; w != nil {
		waker, err = forward.NewWaker(forward.WakerConfig{URL: w.URL, Header: controlplane.LoadHeaders(h.logger, "wake", w.Headers),
			Timeout: time.Duration(w.RequestTimeout), UserAgent: controlplane.UserAgent()})
		if err != nil {
			return fmt.Errorf("sandbox handler: wake: %w", err)
		}
		wakeTimeout = time.Duration(w.Timeout)
	}
	var toSandbox, fromSandbox forward.Bandwidth
	if b := h.MaxBandwidth; b != nil {
		toSandbox = forward.Bandwidth{BytesPerSecond: b.ToSandbox, Burst: b.Burst}
		fromSandbox = forward.Bandwidth{BytesPerSecond: b.FromSandbox, Burst: b.Burst}
	}
	h.fwd, err = forward.New(forward.Config{
		BandwidthToSandbox:   toSandbox,
		BandwidthFromSandbox: fromSandbox,
		Wake:                 waker,
		WakeTimeout:          wakeTimeout,
		OnWake:               h.onWake,
		Verifier:             verifier,
		Policy:               policy,
		Registry:             tunnels,
		PreambleTimeout:      time.Duration(h.PreambleTimeout),
		DialTimeout:          time.Duration(h.DialTimeout),
		KeepAlive:            time.Duration(h.KeepAlive),
		TCPUserTimeout:       time.Duration(h.TCPUserTimeout),
		MaxTunnelsPerSandbox: h.MaxTunnelsPerSandbox,
		MaxDials:             maxDials(h.MaxDials),
		StandbyTimeout:       h.standbyTimeout(),
		MaxStandbyPerClient:  h.MaxStandbyPerClient,
		KeyClients:           h.KeyClients,
		MaxTunnelLifetime:    time.Duration(h.MaxTunnelLifetime),
		ProxyProtocol:        proxyProtocolVersion(h.ProxyProtocol),
		// Only gateways whose TLS session verified their client
		// certificate reach the preamble (Handle says which did).
		RequireClientCertificate: !h.InsecurePlaintext,
		OnStep:                   observeStep,
		// A binary upgrade moves tunnels whose gateway session runs in
		// kernel TLS (sandbox_handoff, upgrade.go).
		HandOffConn: ktls.HandOffConn,
		AdoptConn:   ktls.AdoptConn(ktls.Options{Observer: offload.AdoptedObserver(h.logger)}),
		MoveName:    h.moveName,
	})
	if err != nil {
		return fmt.Errorf("sandbox handler: %w", err)
	}
	if h.DrainGracePeriod == 0 {
		h.DrainGracePeriod = caddy.Duration(30 * time.Second)
	}
	if h.InsecurePlaintext {
		h.logger.Warn(InsecurePlaintextWarning)
	} else if err := checkTLSBeforeSandbox(ctx); errors.Is(err, errRouteNotVisible) {
		h.logger.Warn(RouteNotVisibleWarning, zap.Error(err))
	} else if err != nil {
		return err
	}
	if err := upgrade.CheckListeners(ctx, h.logger, upgrade.HandlerSandbox); err != nil {
		return err
	}
	warnProxyProtocolBefore(ctx, h.logger)
	events, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("sandbox handler: events app: %w", err)
	}
	h.events = events.(*caddyevents.App)
	h.refusals = make(map[forward.Reason]*logsummary.FailureSummary, len(summarizedRefusals))
	for reason, r := range summarizedRefusals {
		details := `each at DEBUG ("` + tunnelRefusedMsg + `"); caddy_ktls_sandbox_rejects_total{reason="` + string(reason) + `"} counts them` + r.extra
		h.refusals[reason] = logsummary.NewFailureSummary(h.logger, r.msg, []string{string(reason)}, details)
	}
	if p := h.ActivityPush; p != nil {
		header := controlplane.LoadHeaders(h.logger, "activity_push", p.Headers)
		h.pushDrops = newPushDropLog(h.logger, p.URL)
		h.pusher, err = forward.NewPusher(forward.PusherConfig{
			URL: p.URL, Interval: time.Duration(p.Interval), Timeout: time.Duration(p.Timeout),
			Attempts: p.Attempts, Backoff: time.Duration(p.Backoff), Queue: p.QueueSize, Header: header,
			UserAgent: controlplane.UserAgent(), Instance: p.Instance, OnDrop: h.pushDrops.drop,
		}, tunnels)
		if err != nil {
			return fmt.Errorf("sandbox handler: %w", err)
		}
		pushers.add(h.pusher)
		h.pusher.Start()
	}
	keyrings.add(h, keys)
	return nil
}

// validateOptions checks what needs nothing loaded; its errors name the
// Caddyfile option and the JSON field, and say the fix.
func (h *Handler) validateOptions() error {
	if len(h.AllowCIDRs) == 0 {
		return fmt.Errorf("sandbox handler: no %s entry: name the sandbox networks this forwarder may reach, e.g. `allow 10.0.0.0/8`", offload.Option("allow", "allow_cidrs"))
	}
	for id, clients := range h.KeyClients {
		if len(clients) == 0 {
			return fmt.Errorf("sandbox handler: %s %q: no client named: list the gateways' client certificate names (Common Name or DNS name) after the key ID, e.g. `key_clients %s gateway-1`",
				offload.Option("key_clients", "key_clients"), id, id)
		}
	}
	if b := h.MaxBandwidth; b != nil && (b.ToSandbox < 0 || b.FromSandbox < 0 || b.Burst < 0 || (b.ToSandbox == 0 && b.FromSandbox == 0)) {
		return fmt.Errorf("sandbox handler: %s takes a positive to_sandbox or from_sandbox rate (bytes per second, e.g. `to_sandbox 10MB`) and no negative burst", offload.Option("max_bandwidth", "max_bandwidth"))
	}
	if w := h.Wake; w != nil && (w.URL == "" || w.Timeout < 0 || w.RequestTimeout < 0) {
		return fmt.Errorf("sandbox handler: %s needs a URL and no negative timeout: e.g. `wake https://cp.internal/v1/wake`", offload.Option("wake", "wake"))
	}
	if h.DrainGracePeriod < 0 {
		return fmt.Errorf("sandbox handler: %s must not be negative: give a duration such as 30s, or leave it out (30s)", offload.Option("drain_grace_period", "drain_grace_period"))
	}
	if h.StandbyTimeout < 0 || h.MaxStandbyPerClient < 0 {
		return fmt.Errorf("sandbox handler: %s and %s must not be negative: leave them out for 60s and 64, or turn standby connections off with %s",
			offload.Option("standby_timeout", "standby_timeout"), offload.Option("max_standby_per_client", "max_standby_per_client"), offload.Option("standby off", "disable_standby"))
	}
	if h.MaxDials < -1 {
		return fmt.Errorf("sandbox handler: %s %d: give a number of dials, off (-1 in JSON) for no bound, or leave it out (%d)", offload.Option("max_dials", "max_dials"), h.MaxDials, DefaultMaxDials)
	}
	if h.MaxTunnelsPerSandbox < 0 {
		return fmt.Errorf("sandbox handler: %s must not be negative: give a number of tunnels, or leave it out (no cap)", offload.Option("max_tunnels_per_sandbox", "max_tunnels_per_sandbox"))
	}
	if p := h.ActivityPush; p != nil && p.Instance != "" {
		if err := forward.CheckInstance(p.Instance); err != nil {
			return fmt.Errorf("sandbox handler: %s: %w: use letters, digits, dots and dashes, or leave it out (the host name)", offload.Option("activity_push instance", "activity_push.instance"), err)
		}
	}
	if h.MaxTunnelLifetime < 0 {
		return fmt.Errorf("sandbox handler: %s must not be negative: give a duration such as 24h, or leave it out (none)", offload.Option("max_tunnel_lifetime", "max_tunnel_lifetime"))
	}
	if h.ProxyProtocol != "" && h.ProxyProtocol != "v2" {
		return fmt.Errorf("sandbox handler: %s %q: the only version is v2 (PROXY protocol version 2), or leave it out (none)", offload.Option("proxy_protocol", "proxy_protocol"), h.ProxyProtocol)
	}
	return nil
}

// DefaultStandbyTimeout is the sandbox handler's standby_timeout when it is
// left out.
const DefaultStandbyTimeout = time.Minute

// standbyTimeout is forward.Config.StandbyTimeout for the standby options.
func (h *Handler) standbyTimeout() time.Duration {
	switch {
	case h.DisableStandby:
		return 0
	case h.StandbyTimeout == 0:
		return DefaultStandbyTimeout
	}
	return time.Duration(h.StandbyTimeout)
}

// DefaultMaxDials is the sandbox handler's max_dials when it is left out.
const DefaultMaxDials = 1024

// maxDials is forward.Config.MaxDials for the max_dials option.
func maxDials(opt int) int {
	switch opt {
	case 0:
		return DefaultMaxDials
	case -1:
		return 0
	}
	return opt
}

// proxyProtocolVersion maps the proxy_protocol option to
// forward.Config.ProxyProtocol (validateOptions accepted it).
func proxyProtocolVersion(opt string) int {
	if opt == "v2" {
		return 2
	}
	return 0
}

// Validate checks the configuration (caddy.Validator): the options, and
// that each key_clients entry names a key the handler holds (h.keys, which
// Provision loaded from keys and key_files).
func (h *Handler) Validate() error {
	if err := h.validateOptions(); err != nil {
		return err
	}
	for id := range h.KeyClients {
		if _, ok := h.keys[id]; !ok {
			return fmt.Errorf("sandbox handler: %s %q: no such key: no %s or %s holds the key ID %q (the keys are %s): correct the ID, or add the key",
				offload.Option("key_clients", "key_clients"), id, offload.Option("key", "keys"), offload.Option("key_file", "key_files"), id, strings.Join(slices.Sorted(maps.Keys(h.keys)), ", "))
		}
	}
	return nil
}

// loadReplayCache takes a reference to the shared replay cache for this
// handler's settings, released by Cleanup.
func (h *Handler) loadReplayCache() (*preamble.ReplayCache, error) {
	size := h.ReplayCacheSize
	if size == 0 {
		size = preamble.DefaultReplayCacheSize
	}
	// At least 1s: bad TTL or skew values reach the verifier's clearer
	// error.
	window := preamble.ReplayWindow(time.Duration(h.MaxPreambleTTL), time.Duration(h.MaxClockSkew))
	key := replayCacheKey{size: size, window: window}
	v, _, err := replayCaches.LoadOrNew(key, func() (caddy.Destructor, error) {
		rc, err := preamble.NewReplayCache(size, window)
		return replayCacheEntry{rc}, err
	})
	if err != nil {
		return nil, err
	}
	h.replayKey = key
	return v.(replayCacheEntry).ReplayCache, nil
}

func (h *Handler) keyring() (map[string]ed25519.PublicKey, error) {
	keys := make(map[string]ed25519.PublicKey)
	add := func(from string, ring map[string]ed25519.PublicKey) error {
		for id, k := range ring {
			if _, dup := keys[id]; dup {
				return fmt.Errorf("sandbox handler: key ID %q is configured twice (%s)", id, from)
			}
			keys[id] = k
		}
		return nil
	}
	for i, k := range h.Keys {
		pub, err := preamble.ParsePublicKey(k.PublicKey)
		if err != nil {
			return nil, fmt.Errorf("sandbox handler: %s %q (JSON keys[%d]): %w", offload.Option("key", "keys"), k.ID, i, err)
		}
		if k.ID == "" {
			return nil, fmt.Errorf("sandbox handler: %s (JSON keys[%d]) has no key ID: give it as `key <id> <base64>`", offload.Option("key", "keys"), i)
		}
		if err := add("inline", map[string]ed25519.PublicKey{k.ID: pub}); err != nil {
			return nil, err
		}
	}
	for _, f := range h.KeyFiles {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("sandbox handler: %s: %w", offload.Option("key_file", "key_files"), err)
		}
		ring, err := preamble.ParseKeyring(data)
		if err != nil {
			return nil, fmt.Errorf("sandbox handler: %s %s: %w", offload.Option("key_file", "key_files"), f, err)
		}
		if len(ring) == 0 {
			return nil, fmt.Errorf("sandbox handler: %s %s holds no PUBLIC KEY block: give the gateways' keyring (caddy sandbox keygen --pub-out)", offload.Option("key_file", "key_files"), f)
		}
		if err := add(f, ring); err != nil {
			return nil, err
		}
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("sandbox handler: no gateway keys: add %s or %s with the gateways' Ed25519 public keys (caddy sandbox keygen --pub-out)", offload.Option("key <id> <base64>", "keys"), offload.Option("key_file <file>", "key_files"))
	}
	return keys, nil
}

// Cleanup stops this configuration's pusher and releases its reference to
// the shared replay cache; a second call does nothing (Caddy also cleans up
// after a failed Provision). Tunnels are left alone on a reload; when the
// process exits it drains them for the grace period.
func (h *Handler) Cleanup() error {
	if h.replayKey != (replayCacheKey{}) {
		replayCaches.Delete(h.replayKey)
		h.replayKey = replayCacheKey{}
	}
	if h.pusher != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		h.pusher.Stop(ctx)
		cancel()
		h.pushDrops.stop()
		pushers.remove(h.pusher)
		h.pusher = nil
	}
	keyrings.remove(h)
	if !caddy.Exiting() {
		// A reload (or a failed load's rollback): the retired handler's
		// keys may be gone from the configuration that replaced it.
		if n := tunnels.Revoke(keyrings.trusts); n > 0 {
			h.logger.Warn("closed open tunnels whose signing key no loaded configuration trusts any more", zap.Int("tunnels", n))
		}
	}
	if caddy.Exiting() && h.fwd != nil {
		// Every sandbox handler drains the one registry at exit; the
		// first finds the tunnels, the others none. After a handoff, the
		// connections accepted before it are served first, their tunnels
		// admitted, within the same grace period.
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(h.DrainGracePeriod))
		upgrade.ServeAccepted(ctx, h.logger)
		if open, _ := tunnels.Counts(); open > 0 {
			h.logger.Info("draining open tunnels at exit: new tunnels are refused, open ones may finish until the grace period ends",
				zap.Int("tunnels", open), zap.Duration("grace_period", time.Duration(h.DrainGracePeriod)))
		}
		forced := tunnels.Drain(ctx)
		cancel()
		if forced > 0 {
			h.logger.Warn("closed tunnels still open after the drain grace period", zap.Int("tunnels", forced))
		}
	}
	return nil
}

// Handle carries one tunnel; it is terminal and never calls next.
func (h *Handler) Handle(cx *layer4.Connection, _ layer4.Handler) error {
	client := forward.Gateway{
		Conn: cx,
		Peer: cx.RemoteAddr().String(),
		// What cx still buffers (a matcher read past the preamble) goes
		// to the target first.
		Unwrap: func() (net.Conn, []byte) { return l4conn.Unwrap(cx) },
	}
	if state, ok := l4conn.TLSState(cx); ok {
		client.Binding, _ = preamble.ChannelBinding(state)
		if len(state.PeerCertificates) > 0 {
			leaf := state.PeerCertificates[0]
			client.Certificate = leaf.Subject.String()
			client.CertificateNames = append([]string{leaf.Subject.CommonName}, leaf.DNSNames...)
		}
		// Only a chain the handshake verified counts: crypto/tls fills
		// VerifiedChains for client_auth modes verify_if_given and
		// require_and_verify (Caddy's default with a trust pool), never
		// for request or require, which take any certificate as sent.
		client.CertificateVerified = len(state.PeerCertificates) > 0 && len(state.VerifiedChains) > 0
	}
	h.serve(client)
	return nil
}

// serve carries client's tunnel to its end, or its refusal (served).
func (h *Handler) serve(client forward.Gateway) {
	client.OnOpen = h.tunnelOpened
	res, err := h.fwd.Serve(client)
	h.served(client, res, err)
}

// serveAdopted is serve for a standby connection another process handed
// over (upgrade.go).
func (h *Handler) serveAdopted(a *forward.AdoptedStandby) {
	res, err := a.Serve(h.tunnelOpened)
	h.served(a.Gateway(), res, err)
}

// tunnelOpened announces a tunnel (sandbox_tunnel_opened).
func (h *Handler) tunnelOpened(ti forward.TunnelInfo) {
	h.events.Emit(h.ctx, "sandbox_tunnel_opened", map[string]any{
		"id": ti.ID, "sandbox": ti.Sandbox, "target": ti.Target, "peer": ti.Peer,
		"client_certificate": ti.Certificate, "key_id": ti.KeyID,
	})
}

// served logs and counts how client's Serve ended: a standby connection
// unused or moved, a refusal, a tunnel moved or carried to its end.
func (h *Handler) served(client forward.Gateway, res forward.Result, err error) {
	peer := client.Peer
	if se, ok := errors.AsType[*forward.StandbyEndError](err); ok {
		// A gateway's connection kept ready that no tunnel used (here: it
		// may have moved to the process of an upgrade): no refusal.
		h.logger.Debug("sandbox standby connection ended unused here", zap.String("end", se.End), zap.String("peer", peer),
			zap.String("client_certificate", client.Certificate), zap.Error(se.Err))
		return
	}
	if res.Tunnel.ID == 0 {
		reason := forward.ReasonOf(err)
		fields := []zap.Field{zap.String("reason", reason), zap.String("peer", peer),
			zap.String("client_certificate", client.Certificate), zap.Error(err)}
		if s := h.refusals[forward.Reason(reason)]; s != nil {
			h.logger.Debug(tunnelRefusedMsg, fields...)
			s.Add(reason)
			return
		}
		h.logger.Warn(tunnelRefusedMsg, fields...)
		return
	}
	if res.Moved {
		h.logger.Debug("sandbox tunnel moved to the process that took over", zap.Uint64("id", res.Tunnel.ID),
			zap.String("sandbox", res.Tunnel.Sandbox), zap.String("peer", peer))
		return
	}
	h.tunnelEnded(res, err)
}

// tunnelEnded logs, counts and announces (sandbox_tunnel_closed) the end
// of a tunnel this process carried, opened here or adopted (upgrade.go).
func (h *Handler) tunnelEnded(res forward.Result, err error) {
	ti := res.Tunnel
	peer := ti.Peer
	tunnelDuration.Observe(res.Duration.Seconds())
	h.events.Emit(h.ctx, "sandbox_tunnel_closed", map[string]any{
		"id": ti.ID, "sandbox": ti.Sandbox, "target": ti.Target, "peer": ti.Peer,
		"client_certificate": ti.Certificate, "key_id": ti.KeyID,
		"bytes_to_sandbox": ti.BytesToSandbox, "bytes_from_sandbox": ti.BytesFromSandbox,
		"duration": res.Duration.Seconds(),
	})
	fields := []zap.Field{zap.Uint64("id", ti.ID), zap.String("sandbox", ti.Sandbox), zap.String("target", ti.Target),
		zap.String("peer", peer), zap.String("client_certificate", ti.Certificate), zap.String("key_id", ti.KeyID),
		zap.Int64("bytes_to_sandbox", ti.BytesToSandbox), zap.Int64("bytes_from_sandbox", ti.BytesFromSandbox),
		zap.Bool("spliced_to_sandbox", res.Relay.AToB.Spliced), zap.Bool("spliced_from_sandbox", res.Relay.BToA.Spliced)}
	if short := res.Relay.AToB.PipeShortages + res.Relay.BToA.PipeShortages; short > 0 {
		// Not a failure, every byte moved, but some through userspace:
		// the process is at its descriptor limit (`ulimit -n`).
		h.logger.Warn("sandbox tunnel found no file descriptors for pipes; those bursts were copied through userspace",
			append(fields, zap.Int64("pipe_shortages", short))...)
	}
	if err != nil && !errors.Is(err, io.EOF) {
		if ktls.IsBadRecord(err) {
			offload.CountClose(moduleid.L4Handler, offload.EventBadRecord)
		}
		h.logger.Info("sandbox tunnel ended with an error", append(fields, zap.Error(err))...)
		return
	}
	h.logger.Debug("sandbox tunnel closed", fields...)
}

// tunnelRefusedMsg is the log message of a refused tunnel.
const tunnelRefusedMsg = "sandbox tunnel rejected"

// summarizedRefusals are the reasons of the refusals logged each at
// DEBUG, never at WARN, and summarized in one WARN (msg) at most once a
// minute per handler (logsummary.FailureSummary); extra ends the
// summary's details, after where each refusal is logged and what counts
// them. A refusal for any other reason is a WARN of its own.
var summarizedRefusals = map[forward.Reason]struct{ msg, extra string }{
	// Anyone who reaches the port can cause it (client_auth
	// verify_if_given, request or require let the handshake complete
	// without a verified certificate), as a failed handshake under
	// require_and_verify.
	forward.ReasonNoClientCertificate: {AnonymousRefusalSummary, ""},
	// Under load: one line a minute instead of one a tunnel.
	forward.ReasonOverloaded: {OverloadedRefusalSummary, "; max_dials bounds the dials in progress"},
}

// AnonymousRefusalSummary is the WARN summary of the tunnels refused for
// want of a verified client certificate.
const AnonymousRefusalSummary = "sandbox tunnels rejected without a verified client certificate"

// OverloadedRefusalSummary is the WARN summary of the tunnels refused
// because max_dials were in progress.
const OverloadedRefusalSummary = "sandbox tunnels rejected: overloaded"

// InsecurePlaintextWarning is logged at every load of a handler with
// insecure_plaintext.
const InsecurePlaintextWarning = "sandbox handler: insecure_plaintext is on: tunnels are carried on connections without a verified client certificate, " +
	"plaintext over raw TCP included, so whoever reaches this port can open them; for tests only, never in production"

// RouteNotVisibleWarning is logged at load by a handler whose route
// checkTLSBeforeSandbox cannot read.
const RouteNotVisibleWarning = "sandbox handler: cannot check at load that a TLS-terminating handler comes before it; " +
	"connections without a verified client certificate are refused all the same"

// tlsTerminators are the layer4 handlers after which a connection is a
// TLS session (they record it as caddy-l4's tls handler does; tlsStateOf
// reads it): this module's ktls and caddy-l4's tls.
var tlsTerminators = map[string]bool{"ktls": true, "tls": true}

// errRouteNotVisible: the handler sits where its route's configuration
// cannot be read at provision time (not in a layer4 server's route, a
// subroute of one, or a layer4 listener wrapper's route).
var errRouteNotVisible = errors.New("the sandbox handler's route cannot be read at load")

// checkTLSBeforeSandbox fails when a sandbox handler's route does not run
// a TLS-terminating handler before it, so that such a configuration does
// not load. It is a structural check of the configuration; the guarantee
// is the per-connection refusal of connections without a verified client
// certificate (forward.Config.RequireClientCertificate), which holds
// wherever the handler sits and however a connection reached it.
//
// A handler cannot see its route directly; it sees the modules it is
// provisioned under (ctx.Modules) and their raw JSON, which Caddy clears
// only once all of a field's modules are loaded. While a sandbox handler
// provisions, the raw handler lists of its own route, of every route that
// encloses it (subroute) and of every route not yet provisioned are still
// there, those of routes already provisioned are gone. So the check reads
// every sandbox handler in every raw route still there under its
// container: its own route is among them; any other one it fails on will
// fail this load when it provisions itself anyway. The container is the
// nearest ancestor past subroute handlers:
//
//   - a layer4 app (layer4 { <addr> { route { ... } } }): each handler in
//     a route is TLS-terminated when ktls or tls comes before it in that
//     route, or before the subroute holding it in an enclosing route. A
//     TLS handler in another route (an earlier route of the same list,
//     which may not match) does not count: that shape can reach sandbox
//     without it.
//   - a layer4 listener wrapper in an HTTP server (listener_wrappers {
//     ktls; layer4 { ... } }): its routes are TLS-terminated when it comes
//     after the server's tls wrapper (listed, or implied first), which is
//     where Caddy's TLS (or, right after it, the ktls wrapper) terminates
//     it. A server without TLS on that port still hands it plaintext: the
//     per-connection refusal catches that.
//
// Anywhere else (another module holding the handler) it returns
// errRouteNotVisible, and the caller warns instead of failing.
func checkTLSBeforeSandbox(ctx caddy.Context) error {
	mods := ctx.Modules() // ..., the container, subroutes, this handler
	for i := len(mods) - 2; i >= 0; i-- {
		switch m := mods[i].(type) {
		case *layer4.App:
			return checkLayer4App(m)
		case *layer4.ListenerWrapper:
			srv, _ := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
			if srv == nil {
				return fmt.Errorf("%w: a layer4 listener wrapper outside an HTTP server", errRouteNotVisible)
			}
			return checkListenerWrappers(srv.ListenerWrappersRaw)
		default:
			if id := m.CaddyModule().ID; id != "layer4.handlers.subroute" {
				return fmt.Errorf("%w: it is in %s", errRouteNotVisible, id)
			}
		}
	}
	return fmt.Errorf("%w: it is in no layer4 server", errRouteNotVisible)
}

// checkLayer4App checks the routes of a's servers that are not yet
// provisioned (see checkTLSBeforeSandbox).
func checkLayer4App(a *layer4.App) error {
	found := 0
	err := eachLayer4Route(a, func(r *layer4.Route, where string) error {
		n, err := checkRouteHandlers(r.HandlersRaw, false, where)
		found += n
		return err
	})
	if err != nil {
		return err
	}
	return sandboxesFound(found)
}

// eachLayer4Route calls f with each route of a's servers, in server-name
// order, and where it is ("layer4 server %q, route %d"), until f fails.
func eachLayer4Route(a *layer4.App, f func(r *layer4.Route, where string) error) error {
	for _, name := range slices.Sorted(maps.Keys(a.Servers)) {
		srv := a.Servers[name]
		if srv == nil {
			continue
		}
		for i, r := range srv.Routes {
			if r == nil {
				continue
			}
			if err := f(r, fmt.Sprintf("layer4 server %q, route %d", name, i)); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkListenerWrappers checks the routes of an HTTP server's layer4
// listener wrappers (see checkTLSBeforeSandbox).
func checkListenerWrappers(raws []json.RawMessage) error {
	found := 0
	err := eachWrapperRoute(raws, func(r rawRoute, tlsBefore bool, where string) error {
		n, err := checkRouteHandlers(r.Handle, tlsBefore, where)
		found += n
		return err
	})
	if err != nil {
		return err
	}
	return sandboxesFound(found)
}

// rawRoute is a layer4 route as raw JSON.
type rawRoute struct {
	Match  []map[string]json.RawMessage `json:"match"`
	Handle []json.RawMessage            `json:"handle"`
}

// eachWrapperRoute calls f with each route of the layer4 listener wrappers
// among raws (an HTTP server's listener_wrappers), whether the tls wrapper
// comes before it (it is implied first when not listed), and where it is
// ("listener_wrappers[%d] (layer4), route %d"), until f fails.
func eachWrapperRoute(raws []json.RawMessage, f func(r rawRoute, tlsBefore bool, where string) error) error {
	type wrapper struct {
		Wrapper string     `json:"wrapper"`
		Routes  []rawRoute `json:"routes"`
	}
	wrappers := make([]wrapper, len(raws))
	tlsAt := -1
	for i, raw := range raws {
		if json.Unmarshal(raw, &wrappers[i]) == nil && wrappers[i].Wrapper == "tls" {
			tlsAt = i
		}
	}
	for i, w := range wrappers {
		if w.Wrapper != "layer4" {
			continue
		}
		for k, r := range w.Routes {
			if err := f(r, i > tlsAt, fmt.Sprintf("listener_wrappers[%d] (layer4), route %d", i, k)); err != nil {
				return err
			}
		}
	}
	return nil
}

// sandboxesFound reports a walk that met no sandbox handler: the one being
// provisioned was not where the walk looked, so nothing was checked.
func sandboxesFound(n int) error {
	if n == 0 {
		return fmt.Errorf("%w: its route is not among those still to be provisioned", errRouteNotVisible)
	}
	return nil
}

// checkRouteHandlers checks one route's raw handler list; tlsBefore says
// whether a TLS-terminating handler runs before the list (in an enclosing
// route, or a listener wrapper). It returns how many sandbox handlers it
// met, in the list and in its subroutes.
func checkRouteHandlers(handlers []json.RawMessage, tlsBefore bool, where string) (int, error) {
	found := 0
	for j, raw := range handlers {
		var head struct {
			Handler string `json:"handler"`
		}
		if json.Unmarshal(raw, &head) != nil {
			continue // not this handler's, which Caddy decoded; Caddy reports it
		}
		switch {
		case tlsTerminators[head.Handler]:
			tlsBefore = true
		case head.Handler == "sandbox":
			found++
			var sb struct {
				InsecurePlaintext bool `json:"insecure_plaintext"`
			}
			json.Unmarshal(raw, &sb)
			if !tlsBefore && !sb.InsecurePlaintext {
				return found, fmt.Errorf("sandbox handler (%s, handler %d): no TLS-terminating handler comes before it: "+
					"the sandbox handler needs a TLS-terminating handler (ktls, or caddy-l4's tls with client authentication) before it in its route: "+
					"add `ktls { ... }` with client_auth before `sandbox` (it refuses every connection without a verified client certificate)", where, j)
			}
		case head.Handler == "subroute":
			for k, handlers := range subrouteHandlers(raw) {
				n, err := checkRouteHandlers(handlers, tlsBefore, fmt.Sprintf("%s, handler %d (subroute), route %d", where, j, k))
				found += n
				if err != nil {
					return found, err
				}
			}
		}
	}
	return found, nil
}

// Interface guards.
var (
	_ layer4.NextHandler = (*Handler)(nil)
	_ caddy.Provisioner  = (*Handler)(nil)
	_ caddy.Validator    = (*Handler)(nil)
	_ caddy.CleanerUpper = (*Handler)(nil)
)

// WokenMsg is the INFO line of a wake whose target answered.
const WokenMsg = "sandbox woken: its target answered after the wake"

// onWake counts a wake and logs the one that woke its sandbox (a failed
// wake refuses its tunnel, logged as such).
func (h *Handler) onWake(ev forward.WakeEvent) {
	observeWake(ev)
	if ev.Outcome == forward.WakeWoken {
		h.logger.Info(WokenMsg, zap.String("sandbox", ev.Sandbox), zap.Stringer("target", ev.Target), zap.Duration("took", ev.Duration))
	}
}

// subrouteHandlers returns the handler lists of the routes of a caddy-l4
// subroute handler's JSON (none where it does not parse).
func subrouteHandlers(raw json.RawMessage) [][]json.RawMessage {
	var sub struct {
		Routes []struct {
			Handle []json.RawMessage `json:"handle"`
		} `json:"routes"`
	}
	if json.Unmarshal(raw, &sub) != nil {
		return nil
	}
	lists := make([][]json.RawMessage, len(sub.Routes))
	for i, r := range sub.Routes {
		lists[i] = r.Handle
	}
	return lists
}
