// Package preamble implements the signed sandbox preamble of caddy-ktls: the
// one short frame an edge gateway writes first on its mutual-TLS connection
// to the forwarder, naming the sandbox and the private ip:port to reach,
// signed with Ed25519 so that the forwarder trusts it without asking the
// control plane.
//
// The wire format is specified in docs/preamble.md. In short: an 8-byte
// header ("KTLP", version 1, a reserved zero byte, the body length), then a
// body of key ID, issued-at, expires-at, 16-byte nonce, sandbox ID, target
// address and port, optional 32-byte channel binding (the TLS 1.3 exporter of
// the carrying session), optional extension TLVs, and a 64-byte Ed25519
// signature over SignatureContext followed by every preceding byte.
//
// The forwarder reads a frame with ReadFrame, which never reads past it (the
// bytes after the frame are the tenant's and stay in the kernel for splice),
// then checks it with a Verifier: structure, key, signature, validity window,
// channel binding and a bounded replay cache. Every rejection is an *Error
// with a stable Reason; ReasonOf extracts it and Reasons lists them all.
//
// A gateway signs with a Signer, and binds, signs and writes a frame on its
// own TLS connection with Send. Dialing forwarders, and reading how a
// tunnel ended, are the gateway package's (gateway.Dialer,
// gateway.Refused): this package is the wire format. It imports no Caddy
// code.
package preamble
