// Package caddyktls is the Caddy glue of caddy-ktls: it registers the Caddy
// modules and subcommands that move TLS sessions into the Linux kernel (kTLS)
// after Caddy's own handshake, and the caddy-l4 handlers that carry sandbox
// tunnels with splice(2).
//
// The mechanisms live in packages that import no Caddy code:
//   - ktls: moves a crypto/tls session into the kernel (TLS_TX/TLS_RX), with
//     a userspace fallback behind the same API;
//   - splice: the zero-copy data path between two sockets;
//   - preamble: the signed sandbox preamble (wire format, signing, verification).
//
// This package stays thin: configuration, Caddyfile parsing, logging and
// metrics wiring.
package caddyktls
