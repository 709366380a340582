// Package caddyktls is caddy-ktls for Caddy: importing it registers every
// module and subcommand. It is the map of the Caddy glue, and holds the TLS
// offload feature itself.
//
// The mechanisms live in packages that import no Caddy code:
//   - ktls: moves a crypto/tls session into the kernel (TLS_TX/TLS_RX), with
//     a userspace fallback behind the same API;
//   - splice: the zero-copy data path between two sockets;
//   - preamble: the signed sandbox preamble (wire format, keys, signing,
//     verification);
//   - forward: the forwarder that serves one tunnel (preamble, policy, dial,
//     relay, registry, activity reports);
//   - gateway: the edge gateway's side (dial a forwarder, sign, relay, pool
//     tunnels, look a sandbox up in the control plane).
//
// The Caddy glue is one package per feature (docs/architecture.md):
//
//	module ID                              package              file
//	caddy.listeners.ktls                   caddyktls (here)     listenerwrapper.go
//	layer4.handlers.ktls                   caddyktls (here)     l4handler.go
//	layer4.handlers.ktls_session           caddyktls (here)     ktlssession.go
//	layer4.handlers.sandbox                modules/forwarder    handler.go
//	layer4.matchers.sandbox                modules/forwarder    matcher.go
//	admin.api.sandbox                      modules/forwarder    admin.go
//	http.reverse_proxy.transport.sandbox   modules/edgegateway  transport.go
//	layer4.handlers.sandbox_proxy          modules/edgegateway  proxy.go
//	http.handlers.sandbox_lookup           modules/edgegateway  lookup.go
//	layer4.handlers.sandbox_lookup         modules/edgegateway  lookupl4.go
//	sandbox_handoff                        modules/handoff      handoff.go
//	admin.api.sandbox_handoff              modules/handoff      admin.go
//
// The `tcp-retry` and `tcp-handoff` listener networks are
// internal/listensock (acceptretry.go imports it); the `caddy ktls` and
// `caddy sandbox` subcommands are internal/cli. What the features share
// sits below them in internal/: moduleid (the module IDs and which metrics
// each moves), caddymetrics (how process-level metrics reach every
// configuration's registry), offload (the kTLS offload options, handshake
// logging and the engine's metrics), listensock (the listener networks:
// listening sockets that ride out accept errors, outlive config reloads
// and pass to the process of a binary upgrade), controlplane, l4conn,
// logsummary and caddyfileargs. TestImportLayers (layers_test.go) holds
// who may import whom.
package caddyktls

import (
	// The features' modules register themselves.
	_ "github.com/ktlsingress/caddy-ktls/internal/cli"
	_ "github.com/ktlsingress/caddy-ktls/modules/edgegateway"
	_ "github.com/ktlsingress/caddy-ktls/modules/forwarder"
	_ "github.com/ktlsingress/caddy-ktls/modules/handoff"
)
