// Package forward is the sandbox forwarder's mechanism, with no Caddy code:
// for each tunnel it reads the signed preamble exactly (under one deadline),
// verifies it, checks the target against a policy, dials the target, forwards
// any client bytes a caller has already buffered, and relays both directions
// with package splice while metering every byte.
//
// Process-level state lives in a Registry: open tunnels, per-tunnel and
// per-sandbox byte counters, last activity, rejections by reason, and the
// drain that runs when the process exits. A Pusher reports per-sandbox byte
// deltas to a control plane over HTTP without ever blocking the data path.
//
// Tunnels outlive configuration reloads on purpose: nothing here is tied to
// a configuration's lifetime. Only Registry.Drain ends them.
package forward
