package caddyktls

import (
	"crypto/tls"
	"sync"

	"github.com/caddyserver/caddy/v2/modules/caddytls"
)

// Session resumption for the layer4 `ktls` handler.
//
// Caddy issues no session tickets on a connection policy with client
// authentication: a ticket issued under one policy could resume under
// another (a different trust pool, a leaf allowlist) and authenticate a
// client that policy never verified, and a resumed handshake does not run
// the policy's verifiers again (caddytls connpolicy.go). A gateway that
// opens a connection per call then pays a full mutual-TLS handshake for
// each; verifying the client's certificate and signing the server's
// CertificateVerify are most of the forwarder's CPU for such a call
// (docs/bench/per-call-profile.md).
//
// The handler issues tickets there anyway, each sealed with keys of the one
// policy configuration that issued it (the *tls.Config Caddy chose: one per
// connection policy and config load). A ticket therefore resumes only under
// the policy that authenticated its client, with the same trust pool and
// verifiers; another policy cannot open it, and a config reload builds new
// policy configurations, so tickets from before it start full handshakes.
// crypto/tls restores the session's verified chains, and refuses to resume
// a session without a client certificate where the policy requires one, or
// one whose leaf has expired. The keys are crypto/tls's own automatic ones
// (a new key every 24 hours, each opening tickets for 7 days), kept in this
// process: Caddy's shared session ticket keys are not used, so a ticket
// resumes only on the forwarder process that issued it. Where the tls app
// disables session tickets, so does the handler.

// sessionKeys holds, for each policy configuration Caddy chose, the copy
// of it that issues and accepts tickets, made once: its WrapSession and
// UnwrapSession use a Config of their own, used only for its ticket keys.
type sessionKeys struct {
	mu      sync.Mutex
	configs map[*tls.Config]*tls.Config
}

// resumable returns the copy of chosen, the policy configuration Caddy
// picked for a ClientHello, that issues and accepts tickets sealed with
// chosen's own keys. With tickets disabled in the tls app it returns chosen
// as it is.
func (s *sessionKeys) resumable(chosen *tls.Config, tickets *caddytls.SessionTicketService) *tls.Config {
	if tickets != nil && tickets.Disabled {
		return chosen
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if cfg, ok := s.configs[chosen]; ok {
		return cfg
	}
	if s.configs == nil {
		s.configs = map[*tls.Config]*tls.Config{}
	}
	keys := &tls.Config{}
	cfg := chosen.Clone()
	cfg.SessionTicketsDisabled = false
	cfg.WrapSession = keys.EncryptTicket
	// A ticket these keys cannot open (another policy's, another load's,
	// expired) is no error: DecryptTicket returns no session, and the
	// handshake is a full one.
	cfg.UnwrapSession = keys.DecryptTicket
	s.configs[chosen] = cfg
	return cfg
}
