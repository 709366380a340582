package edgegateway

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// DialOptions is how the gateway modules (the layer4 `sandbox_proxy`
// handler and the `sandbox` reverse_proxy transport) reach forwarders:
// mutual TLS with the gateway's client certificate, the key that signs the
// preambles, and the offload of each forwarder connection to kernel TLS.
// Both embed it, so its fields sit at the top level of their JSON and of
// their Caddyfile blocks.
type DialOptions struct {
	// TLS is the gateway's side of the mutual TLS session with forwarders,
	// as reverse_proxy's http transport configures it: the client
	// certificate (client_certificate_file and client_certificate_key_file,
	// or client_certificate_automate), the trust pool forwarders'
	// certificates must chain to (ca), and server_name (default: the
	// forwarder's host). Required, with a client certificate: forwarders
	// serve only gateways they verified. TLS 1.3 is always used (the
	// preamble is bound to the session's exporter); insecure_skip_verify
	// is refused, and the handshake's bound is handshake_timeout.
	TLS *reverseproxy.TLSConfig `json:"tls,omitempty"`

	// SigningKeyFile is the gateway's Ed25519 private key for preambles,
	// as `caddy sandbox keygen` writes it (a PEM "PRIVATE KEY" block whose
	// Key-Id header names it). Required.
	SigningKeyFile string `json:"signing_key_file,omitempty"`

	// KeyID names the signing key in the forwarders' keyrings. Default:
	// the key file's Key-Id header, or without one the key's derived ID
	// (as a forwarder names a keyring entry without Key-Id). Given with a
	// key file that has a Key-Id, it must be that ID: the configuration
	// does not load otherwise (forwarders would refuse every preamble).
	KeyID string `json:"key_id,omitempty"`

	// DialTimeout bounds opening a tunnel: the connect to the forwarder, the
	// TLS handshake and the preamble's write together. Default: 10s.
	DialTimeout caddy.Duration `json:"dial_timeout,omitempty"`

	// KeepAlive is the TCP keepalive idle time and interval on forwarder
	// connections. Default: 30s.
	KeepAlive caddy.Duration `json:"keepalive,omitempty"`

	// PreambleTTL is the validity each preamble claims; forwarders refuse
	// one above their max_preamble_ttl. Default: 30s.
	PreambleTTL caddy.Duration `json:"preamble_ttl,omitempty"`

	// DisableResumption makes every forwarder connection a full TLS
	// handshake. By default a connection resumes the session of an earlier
	// one to the same forwarder address (a session ticket from the
	// forwarder's `ktls` handler, whose `resumption` must be on too): the
	// forwarder then checks the gateway's stored chain (expiry, trust pool)
	// instead of verifying its signatures, and signs nothing. Sessions are
	// kept until the config is reloaded.
	DisableResumption bool `json:"disable_resumption,omitempty"`

	// DisableExpectNoPad keeps TLS_RX_EXPECT_NO_PAD off on forwarder
	// connections. By default it is on wherever the kernel accepts it
	// (Linux 6.0+): a forwarder never pads its records (the kernel's TLS
	// and crypto/tls send none), so the kernel decrypts each one straight
	// into the gateway's buffer instead of decrypting, then copying. Turn
	// it off for a forwarder behind something that pads: each padded record
	// would be decrypted twice (TlsRxNoPadViolation in /proc/net/tls_stat).
	// expect_no_pad (OffloadOptions) sets it even where the kernel's probe
	// says no; the two contradict.
	DisableExpectNoPad bool `json:"disable_expect_no_pad,omitempty"`

	// Standby is how many standby connections the module keeps ready for
	// each forwarder it dialed: mutual TLS done, no preamble written yet.
	// A new tunnel then pays only its preamble and the forwarder's dial of
	// the target, not a connect and a TLS handshake (at 20 ms between
	// gateway and forwarder, two round trips: 40 ms). Each holds a socket
	// here and one of the forwarder's standby places (its
	// max_standby_per_client, 64 by default), and is closed unused after
	// standby_max_idle. Counted in caddy_ktls_gateway_standby_total.
	// Default: 0, none.
	Standby int `json:"standby,omitempty"`

	// StandbyMaxIdle is how long a standby connection is kept unused
	// before it is closed. It must stay below the forwarders'
	// standby_timeout (60s by default), past which they end it. Default:
	// 30s.
	StandbyMaxIdle caddy.Duration `json:"standby_max_idle,omitempty"`

	// The offload options of the forwarder connections (OffloadOptions):
	// disable_offload keeps them in crypto/tls, require_offload fails a
	// tunnel whose connection cannot be offloaded, handshake_timeout bounds
	// the TLS handshake (within dial_timeout).
	offload.Options
}

// expectNoPad says whether forwarder connections set TLS_RX_EXPECT_NO_PAD,
// where kernelAccepts is the kernel's answer to the probe.
func (g *DialOptions) ExpectsNoPad(kernelAccepts bool) bool {
	return g.ExpectNoPad || (kernelAccepts && !g.DisableExpectNoPad)
}

// validate checks what needs no files or apps.
func (g *DialOptions) validate() error {
	switch {
	case g.TLS == nil || (g.TLS.ClientCertificateFile == "" && g.TLS.ClientCertificateAutomate == ""):
		return errors.New("no client certificate (tls_client_auth <cert_file> <key_file>): forwarders serve only gateways with a certificate they verify")
	case g.TLS.InsecureSkipVerify:
		return errors.New("tls_insecure_skip_verify (tls.insecure_skip_verify): " + RefusedGatewayTLSOptions["tls_insecure_skip_verify"])
	case g.TLS.HandshakeTimeout != 0:
		return errors.New("tls_timeout (tls.handshake_timeout): " + RefusedGatewayTLSOptions["tls_timeout"])
	case len(g.TLS.ExceptPorts) > 0:
		return errors.New("tls_except_ports (tls.except_ports): " + RefusedGatewayTLSOptions["tls_except_ports"])
	case g.SigningKeyFile == "":
		return errors.New("no signing_key_file: the gateway's preamble key, from `caddy sandbox keygen`")
	case g.DialTimeout < 0 || g.KeepAlive < 0 || g.PreambleTTL < 0 || g.StandbyMaxIdle < 0:
		return errors.New("dial_timeout, keepalive, preamble_ttl and standby_max_idle must not be negative")
	case g.Standby < 0:
		return errors.New("standby must not be negative: give a number of connections per forwarder, or leave it out (none)")
	case g.ExpectNoPad && g.DisableExpectNoPad:
		return errors.New("expect_no_pad and disable_expect_no_pad together: give one (a gateway expects no padding by default where the kernel allows it)")
	}
	return nil
}

// logStart logs module's start line (logKernel): what this kernel does for
// the forwarder connections, once per configuration load, module and set of
// offload options, however many instances share them.
func (g *DialOptions) logStart(ctx caddy.Context, module string, logger *zap.Logger) {
	key := gatewayStartKey{ctx.Context, module, g.Options}
	if _, logged := gatewayStartLogged.LoadOrStore(key, struct{}{}); logged {
		return
	}
	if ctx.Context != nil {
		context.AfterFunc(ctx, func() { gatewayStartLogged.Delete(key) })
	}
	g.Options.LogKernel(logger)
}

// gatewayStartLogged holds a gatewayStartKey for each start line the
// gateway modules of a loaded configuration logged.
var gatewayStartLogged sync.Map

type gatewayStartKey struct {
	load   context.Context // one per config load
	module string
	opts   offload.Options
}

// dialer builds the gateway.Dialer, loading the certificate, trust pool
// and signing key. module labels its handshake metrics and logs; moveName
// names it in the tunnels it moves in an upgrade (gateway.Config.MoveName).
func (g *DialOptions) dialer(ctx caddy.Context, module string, logger *zap.Logger, moveName string) (*gateway.Dialer, error) {
	if err := g.validate(); err != nil {
		return nil, err
	}
	if err := g.Options.ProvisionOptions(); err != nil {
		return nil, err
	}
	tlsCfg, err := g.TLS.MakeTLSClientConfig(ctx)
	if err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	data, err := os.ReadFile(g.SigningKeyFile)
	if err != nil {
		return nil, fmt.Errorf("signing_key_file: %w", err)
	}
	key, keyID, err := preamble.ParseSigningKey(data)
	if err != nil {
		return nil, fmt.Errorf("signing_key_file %s: %w", g.SigningKeyFile, err)
	}
	switch {
	case keyID != "" && g.KeyID != "" && g.KeyID != keyID:
		// Forwarders name the key by the ID kept with it: preambles
		// signed under another would all be refused (unknown-key).
		return nil, fmt.Errorf("key_id %q does not match the key ID %q kept with the key in signing_key_file %s: "+
			"leave key_id out, or give %q", g.KeyID, keyID, g.SigningKeyFile, keyID)
	case g.KeyID != "":
		keyID = g.KeyID
	}
	if keyID == "" {
		// As a forwarder names a keyring entry without a Key-Id.
		keyID = preamble.KeyIDFor(key.Public().(ed25519.PublicKey))
	}
	signer, err := preamble.NewSigner(keyID, key)
	if err != nil {
		return nil, fmt.Errorf("key_id: %w", err)
	}
	observer := func(ev ktls.Event) {
		offload.CountClose(module, ev.Kind)
		if ev.Kind == ktls.EventHandshake {
			offload.ObserveHandshake(module, ev)
			offload.LogHandshake(logger, ev)
		}
	}
	opts := g.KTLSOptions(observer)
	opts.ExpectNoPad = g.ExpectsNoPad(ktls.Probe().ExpectNoPad)
	return gateway.New(gateway.Config{
		TLS:              tlsCfg,
		Signer:           signer,
		KTLS:             opts,
		DialTimeout:      time.Duration(g.DialTimeout),
		HandshakeTimeout: time.Duration(g.HandshakeTimeout),
		KeepAlive:        time.Duration(g.KeepAlive),
		PreambleTTL:      time.Duration(g.PreambleTTL),

		DisableResumption: g.DisableResumption,

		Standby:        g.Standby,
		StandbyMaxIdle: time.Duration(g.StandbyMaxIdle),
		OnStandby:      func(outcome string) { GatewayStandby.WithLabelValues(module, outcome).Inc() },
		MoveName:       moveName,
		UserKTLS:       ktls.Options{Observer: offload.AdoptedObserver(logger)},
	})
}
