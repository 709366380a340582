// Package forward is the sandbox forwarder's mechanism, with no Caddy code:
// for each tunnel it reads the signed preamble exactly (under one deadline),
// verifies it, checks that the signing key may be used by the client's
// certificate (Config.KeyClients), checks the target against a policy and
// the sandbox's open tunnels against its cap, dials the target, forwards
// any client bytes a caller has already buffered, and relays both directions
// with package splice while metering every byte.
//
// Process-level state lives in a Registry: open tunnels, per-tunnel and
// per-sandbox byte counters, last activity, rejections by reason, and the
// drain that runs when the process exits. A Pusher reports per-sandbox byte
// deltas to a control plane over HTTP without ever blocking the data path.
//
// Tunnels outlive configuration reloads on purpose: nothing here is tied to
// a configuration's lifetime. Besides its own end, a tunnel is ended only by
// Registry.Drain (process exit), Registry.Revoke (its signing key is no
// longer trusted) and Config.MaxTunnelLifetime.
package forward
