package preamble

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// DefaultTTL is the validity a Signer gives a frame whose ExpiresAt is zero:
// long enough for a dial across a region, short enough to bound replay.
const DefaultTTL = 30 * time.Second

// Signer makes preambles on the gateway side. It is safe for concurrent use.
type Signer struct {
	keyID string
	key   ed25519.PrivateKey
	// Now and Rand are injectable for tests and reproducible examples; nil
	// means time.Now and crypto/rand.
	Now  func() time.Time
	Rand io.Reader
}

// NewSigner returns a Signer that signs with key under keyID, the name the
// verifiers' keyrings know its public key by.
func NewSigner(keyID string, key ed25519.PrivateKey) (*Signer, error) {
	if len(key) != ed25519.PrivateKeySize {
		return nil, fmt.Errorf("preamble: Ed25519 private key of %d bytes, want %d", len(key), ed25519.PrivateKeySize)
	}
	if len(keyID) == 0 || len(keyID) > MaxKeyIDLen || !validID([]byte(keyID)) {
		return nil, refuse(ReasonBadKeyID, "key ID %q: want 1..%d bytes of [A-Za-z0-9._-]", keyID, MaxKeyIDLen)
	}
	return &Signer{keyID: keyID, key: key}, nil
}

// KeyID returns the key ID the Signer writes into its frames.
func (s *Signer) KeyID() string { return s.keyID }

// Sign returns a complete frame for c. Zero IssuedAt becomes now, zero
// ExpiresAt becomes IssuedAt + DefaultTTL, and an all-zero Nonce is drawn at
// random; c.KeyID is ignored (the Signer's own key ID is used). Claims that
// a verifier would reject for their shape are refused with the same *Error.
func (s *Signer) Sign(c Claims) ([]byte, error) {
	if c.IssuedAt.IsZero() {
		now := time.Now
		if s.Now != nil {
			now = s.Now
		}
		c.IssuedAt = now()
	}
	if c.ExpiresAt.IsZero() {
		c.ExpiresAt = c.IssuedAt.Add(DefaultTTL)
	}
	if c.Nonce == ([NonceLen]byte{}) {
		r := s.Rand
		if r == nil {
			r = rand.Reader
		}
		if _, err := io.ReadFull(r, c.Nonce[:]); err != nil {
			return nil, fmt.Errorf("preamble: drawing a nonce: %w", err)
		}
	}
	frame, err := encode(s.keyID, &c)
	if err != nil {
		return nil, err
	}
	msg := make([]byte, 0, len(SignatureContext)+len(frame))
	msg = append(append(msg, SignatureContext...), frame...)
	return append(frame, ed25519.Sign(s.key, msg)...), nil
}

// ChannelBinding returns the RFC 9266 style channel binding of a TLS 1.3
// session: the exporter value for ChannelBindingLabel, empty context, 32
// bytes. On TLS 1.2 it returns ok == false even when the session negotiated
// the extended master secret (crypto/tls does by default, and without it
// the exporter would not be unique to the connection): version 1 of the
// preamble binds only TLS 1.3 sessions, a fixed rule rather than one that
// depends on what a TLS 1.2 handshake negotiated (docs/preamble.md §4).
func ChannelBinding(cs tls.ConnectionState) (binding []byte, ok bool) {
	if cs.Version != tls.VersionTLS13 || !cs.HandshakeComplete {
		return nil, false
	}
	b, err := cs.ExportKeyingMaterial(ChannelBindingLabel, nil, BindingLen)
	if err != nil {
		return nil, false
	}
	return b, true
}

// Conn is a TLS connection whose handshake is complete: a *tls.Conn, or a
// ktls.Conn whose records the kernel seals.
type Conn interface {
	net.Conn
	ConnectionState() tls.ConnectionState
}

// Send binds claims to conn's session with ChannelBinding when it is TLS
// 1.3, signs them and writes the preamble: for a gateway that makes its own
// connection (kernel TLS, a custom dialer). On TLS 1.2 the frame goes
// unbound; a forwarder that requires binding then rejects it. ctx bounds
// the write. The caller keeps conn, and closes it when Send fails.
func Send(ctx context.Context, conn Conn, signer *Signer, claims Claims) error {
	if signer == nil {
		return errors.New("preamble: Send needs a Signer")
	}
	claims.Binding = nil
	if b, ok := ChannelBinding(conn.ConnectionState()); ok {
		claims.Binding = b
	}
	frame, err := signer.Sign(claims)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("preamble: writing the frame: %w", err)
	}
	if deadline, ok := ctx.Deadline(); ok {
		conn.SetWriteDeadline(deadline)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetWriteDeadline(time.Unix(1, 0)) })
	_, err = conn.Write(frame)
	if !stop() || err != nil {
		if err == nil {
			err = ctx.Err()
		}
		return fmt.Errorf("preamble: writing the frame: %w", err)
	}
	conn.SetWriteDeadline(time.Time{})
	return nil
}
