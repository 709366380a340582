package caddyktls

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

func init() {
	caddy.RegisterModule(new(SandboxHandler))
}

// SandboxHandler is a terminal handler that carries sandbox tunnels: it
// reads the gateway's signed preamble (under the one deadline a tunnel has),
// verifies it, checks the target against the allowlist, dials it and relays
// both directions with splice(2), metering every byte per tunnel and per
// sandbox. A refused tunnel is closed without a reply, logged in one line
// with its reason and counted; nothing is dialed for it.
//
// Place it after `ktls` (mutual TLS) so that splice reaches kernel sockets on
// both sides; behind caddy-l4's `tls` handler or on plaintext it still works,
// with a userspace copy.
type SandboxHandler struct {
	// Keys are the gateways' Ed25519 public keys, inline.
	Keys []SandboxKey `json:"keys,omitempty"`

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

	// MaxTunnelLifetime ends a tunnel that has been open this long as a
	// failure (both sides aborted), whatever it is doing: it bounds how
	// long a tunnel outlives a client certificate that a reload revoked
	// (a revoked key ends its tunnels at once).
	// Counted in caddy_ktls_sandbox_tunnels_expired_total. Default: 0, no
	// limit.
	MaxTunnelLifetime caddy.Duration `json:"max_tunnel_lifetime,omitempty"`

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

	// AllowCIDRs are the networks targets may be in; empty allows every
	// address not refused by default. Loopback, link-local (including
	// 169.254.169.254), multicast, unspecified, broadcast and this host's
	// own addresses are refused unless an entry lies inside them: for
	// example "127.0.0.0/8" opens loopback for a demo, "0.0.0.0/0" does not.
	AllowCIDRs []string `json:"allow_cidrs,omitempty"`

	// AllowPorts are the target ports allowed, as "443" or "8000-8999";
	// empty allows all.
	AllowPorts []string `json:"allow_ports,omitempty"`

	// ActivityPush, when set, POSTs per-sandbox byte deltas as JSON to a
	// control plane (format: forward.ActivityReport).
	ActivityPush *ActivityPush `json:"activity_push,omitempty"`

	// DrainGracePeriod is how long open tunnels may keep running when the
	// process exits before they are closed. Reloads do not drain.
	// Default: 30s.
	DrainGracePeriod caddy.Duration `json:"drain_grace_period,omitempty"`

	ctx       caddy.Context
	logger    *zap.Logger
	fwd       *forward.Forwarder
	pusher    *forward.Pusher
	events    *caddyevents.App
	replayKey replayCacheKey // set while this handler holds a replayCaches reference
}

// SandboxKey is one inline gateway key.
type SandboxKey struct {
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
}

// CaddyModule returns the Caddy module information.
func (*SandboxHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleSandboxHandler, New: func() caddy.Module { return new(SandboxHandler) }}
}

// Provision sets up the handler.
func (h *SandboxHandler) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger(h)
	if err := registerMetrics(ctx); err != nil {
		return err
	}
	keys, err := h.keyring()
	if err != nil {
		return err
	}
	for id, clients := range h.KeyClients {
		if _, ok := keys[id]; !ok || len(clients) == 0 {
			return fmt.Errorf("sandbox handler: key_clients %q: no such key, or no client named", id)
		}
	}
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
	policy, err := forward.NewTargetPolicy(h.AllowCIDRs, h.AllowPorts)
	if err != nil {
		return fmt.Errorf("sandbox handler: %w", err)
	}
	h.fwd, err = forward.New(forward.Config{
		Verifier:             verifier,
		Policy:               policy,
		Registry:             tunnels,
		PreambleTimeout:      time.Duration(h.PreambleTimeout),
		DialTimeout:          time.Duration(h.DialTimeout),
		KeepAlive:            time.Duration(h.KeepAlive),
		TCPUserTimeout:       time.Duration(h.TCPUserTimeout),
		MaxTunnelsPerSandbox: h.MaxTunnelsPerSandbox,
		KeyClients:           h.KeyClients,
		MaxTunnelLifetime:    time.Duration(h.MaxTunnelLifetime),
	})
	if err != nil {
		return fmt.Errorf("sandbox handler: %w", err)
	}
	if h.DrainGracePeriod < 0 {
		return errors.New("sandbox handler: drain_grace_period must not be negative")
	}
	if h.DrainGracePeriod == 0 {
		h.DrainGracePeriod = caddy.Duration(30 * time.Second)
	}
	events, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("sandbox handler: events app: %w", err)
	}
	h.events = events.(*caddyevents.App)
	if p := h.ActivityPush; p != nil {
		repl := caddy.NewReplacer()
		header := make(http.Header, len(p.Headers))
		for name, values := range p.Headers {
			for _, v := range values {
				header.Add(name, repl.ReplaceAll(v, ""))
			}
		}
		h.pusher, err = forward.NewPusher(forward.PusherConfig{
			URL: p.URL, Interval: time.Duration(p.Interval), Timeout: time.Duration(p.Timeout),
			Attempts: p.Attempts, Backoff: time.Duration(p.Backoff), Queue: p.QueueSize, Header: header,
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

// loadReplayCache takes a reference to the shared replay cache for this
// handler's settings, released by Cleanup.
func (h *SandboxHandler) loadReplayCache() (*preamble.ReplayCache, error) {
	size := h.ReplayCacheSize
	if size == 0 {
		size = preamble.DefaultReplayCacheSize
	}
	skew, ttl := time.Duration(h.MaxClockSkew), time.Duration(h.MaxPreambleTTL)
	if skew == 0 {
		skew = preamble.DefaultMaxSkew
	}
	if ttl == 0 {
		ttl = preamble.DefaultMaxTTL
	}
	// The verifier checks whole seconds, and its window is MaxTTL +
	// 2*MaxSkew; at least 1s so that bad TTL or skew values reach the
	// verifier's clearer error.
	window := max((ttl/time.Second+2*(skew/time.Second))*time.Second, time.Second)
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

func (h *SandboxHandler) keyring() (map[string]ed25519.PublicKey, error) {
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
			return nil, fmt.Errorf("sandbox handler: keys[%d] (%q): %w", i, k.ID, err)
		}
		if k.ID == "" {
			return nil, fmt.Errorf("sandbox handler: keys[%d] has no id", i)
		}
		if err := add("inline", map[string]ed25519.PublicKey{k.ID: pub}); err != nil {
			return nil, err
		}
	}
	for _, f := range h.KeyFiles {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("sandbox handler: key file: %w", err)
		}
		ring, err := preamble.ParseKeyring(data)
		if err != nil {
			return nil, fmt.Errorf("sandbox handler: key file %s: %w", f, err)
		}
		if len(ring) == 0 {
			return nil, fmt.Errorf("sandbox handler: key file %s holds no PUBLIC KEY block", f)
		}
		if err := add(f, ring); err != nil {
			return nil, err
		}
	}
	if len(keys) == 0 {
		return nil, errors.New("sandbox handler: no gateway keys: set keys or key_files")
	}
	return keys, nil
}

// Cleanup stops this configuration's pusher and releases its reference to
// the shared replay cache; a second call does nothing (Caddy also cleans up
// after a failed Provision). Tunnels are left alone on a reload; when the
// process exits it drains them for the grace period.
func (h *SandboxHandler) Cleanup() error {
	if h.replayKey != (replayCacheKey{}) {
		replayCaches.Delete(h.replayKey)
		h.replayKey = replayCacheKey{}
	}
	if h.pusher != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		h.pusher.Stop(ctx)
		cancel()
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
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(h.DrainGracePeriod))
		forced := tunnels.Drain(ctx)
		cancel()
		if forced > 0 {
			h.logger.Warn("closed tunnels still open after the drain grace period", zap.Int("tunnels", forced))
		}
	}
	return nil
}

// Handle carries one tunnel; it is terminal and never calls next.
func (h *SandboxHandler) Handle(cx *layer4.Connection, _ layer4.Handler) error {
	peer := cx.RemoteAddr().String()
	client := forward.Client{
		Conn: cx,
		Peer: peer,
		OnOpen: func(ti forward.TunnelInfo) {
			h.events.Emit(h.ctx, "sandbox_tunnel_opened", map[string]any{
				"id": ti.ID, "sandbox": ti.Sandbox, "target": ti.Target, "peer": ti.Peer,
				"client_certificate": ti.Certificate, "key_id": ti.KeyID,
			})
		},
		Unwrap: func() (net.Conn, []byte) {
			// Relay the connection under cx's read-ahead buffer so that
			// splice reaches the socket; what cx still buffers (a matcher
			// read past the preamble) goes to the target first.
			return cx.Conn, append([]byte(nil), cx.MatchingBytes()...)
		},
	}
	if state, ok := tlsStateOf(cx); ok {
		client.Binding, _ = preamble.ChannelBinding(state)
		if len(state.PeerCertificates) > 0 {
			leaf := state.PeerCertificates[0]
			client.Certificate = leaf.Subject.String()
			client.CertificateNames = append([]string{leaf.Subject.CommonName}, leaf.DNSNames...)
		}
	}
	res, err := h.fwd.Serve(client)
	if res.Tunnel.ID == 0 {
		reason := forward.ReasonOf(err)
		h.logger.Warn("sandbox tunnel rejected", zap.String("reason", reason), zap.String("peer", peer),
			zap.String("client_certificate", client.Certificate), zap.Error(err))
		return nil
	}
	ti := res.Tunnel
	h.events.Emit(h.ctx, "sandbox_tunnel_closed", map[string]any{
		"id": ti.ID, "sandbox": ti.Sandbox, "target": ti.Target, "peer": ti.Peer,
		"client_certificate": ti.Certificate, "key_id": ti.KeyID,
		"bytes_to_sandbox": ti.BytesToSandbox, "bytes_from_sandbox": ti.BytesFromSandbox,
		"duration": time.Since(ti.Opened).Seconds(),
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
			connCloses.add(closeKey{moduleL4Handler, eventBadRecord})
		}
		h.logger.Info("sandbox tunnel ended with an error", append(fields, zap.Error(err))...)
		return nil
	}
	h.logger.Debug("sandbox tunnel closed", fields...)
	return nil
}

// tlsStateOf returns the TLS session that carries cx: the one the layer4
// ktls (or tls) handler recorded, or, when the connection came through the
// HTTP server's `listener_wrappers { ktls; layer4 {...} }` (where caddy-l4
// records no TLS state), the one the wrapped connection itself reports.
func tlsStateOf(cx *layer4.Connection) (tls.ConnectionState, bool) {
	if states, ok := cx.GetVar(layer4.TLSConnectionStatesVarName).([]*tls.ConnectionState); ok && len(states) > 0 {
		return *states[len(states)-1], true
	}
	if sc, ok := cx.Conn.(interface{ ConnectionState() tls.ConnectionState }); ok {
		return sc.ConnectionState(), true
	}
	return tls.ConnectionState{}, false
}

// Interface guards.
var (
	_ layer4.NextHandler = (*SandboxHandler)(nil)
	_ caddy.Provisioner  = (*SandboxHandler)(nil)
	_ caddy.CleanerUpper = (*SandboxHandler)(nil)
)
