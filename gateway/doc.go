// Package gateway is the edge gateway's mechanism, with no Caddy code: it
// opens tunnels to sandbox forwarders and relays user connections through
// them.
//
// A Dialer connects to a forwarder, completes mutual TLS with the gateway's
// client certificate (on kernel TLS through ktls.Client where this host has
// it, so that the kernel seals what the gateway sends), signs a preamble for
// the Route (sandbox ID and target, always bound to the session with its
// TLS 1.3 exporter) and writes it. What follows on the connection is the
// tenant's: an HTTP transport writes requests on it, Relay splices a user's
// connection into it.
//
// How a tunnel ends says what happened at the far side (docs/preamble.md §9, step 6):
//
//   - close_notify (io.EOF): the tunnel ran and ended in order;
//   - the fatal alert access_denied: the forwarder refused the tunnel (its
//     preamble, its target, the sandbox's tunnel cap, a drain) and nothing
//     reached the sandbox, so the request is safe to send again (Refused);
//   - anything else (internal_error, a reset, a timeout): a failure after
//     the tunnel may have opened; bytes may have reached the sandbox.
//
// EndOf classifies an error that way. A forwarder in userspace TLS (a host
// without kTLS) refuses with a TCP reset, which is a failure here.
package gateway
