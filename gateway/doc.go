// Package gateway is the edge gateway's mechanism, with no Caddy code: it
// finds sandboxes, opens tunnels to their forwarders, pools tunnels for
// HTTP and relays user connections through them.
//
// A Dialer connects to a forwarder, completes mutual TLS, always
// presenting the gateway's client certificate (on kernel TLS through
// ktls.Client where this host has it, so that the kernel seals what the
// gateway sends), signs a preamble for the Route (sandbox ID and target,
// always bound to the session with its TLS 1.3 exporter) and writes it. It
// is the one dialer of forwarders; the preamble package is the wire
// format. What follows on the connection is the tenant's: a Pool writes
// HTTP requests on it, Relay splices a user's connection into it, and
// Dialer.Carry does both steps for one user connection, telling its owner
// whether the tunnel opened, as a Pool does. At process exit,
// Dialer.Drain refuses new tunnels, lets the carried ones finish until its
// deadline and ends the rest (EndDrained).
//
// A Pool is an HTTP transport whose connections are tunnels, pooled per
// Route (never shared between routes) with the least recently used route
// dropped beyond a bound. It decides what each tunnel counts as and hands
// that to its owner through callbacks (PoolConfig.OnDial, OnEnd,
// OnFailure): a dial is open at the tunnel's first byte (with TLS 1.3 only
// the forwarder's answer says it took the certificate) and failed when
// the forwarder's refusal of the certificate comes first; a tunnel's end
// is the first refused or failed end a request on it saw, else its own.
//
// A Lookup finds where a sandbox is through a Fetcher (HTTPFetcher asks a
// control plane), caching answers, remembering "not found" for less, and
// coalescing concurrent lookups of one sandbox into one fetch.
//
// How a tunnel ends says what happened at the far side (docs/preamble.md §9, step 6):
//
//   - close_notify (io.EOF): the tunnel ran and ended in order;
//   - the fatal alert access_denied (ktls.AlertAccessDenied, which the
//     forwarder sends with ktls.Conn.Refuse): the forwarder refused the
//     tunnel (its preamble, its target, the sandbox's tunnel cap, a drain)
//     and nothing reached the sandbox, so the request is safe to send
//     again (Refused);
//   - anything else (internal_error, a reset, a timeout): a failure after
//     the tunnel may have opened; bytes may have reached the sandbox.
//
// EndOf classifies an error that way. A forwarder in userspace TLS that
// cannot send the alert (a TLS 1.2 session, or one that already wrote)
// refuses with a TCP reset, which is a failure here.
package gateway
