package caddyktls

import "github.com/ktlsingress/caddy-ktls/internal/listensock"

// acceptRetryNetwork names the `tcp-retry` listener network. It lives in
// internal/listensock with `tcp-handoff`; importing that package here puts
// both networks in the binary.
const acceptRetryNetwork = listensock.RetryNetwork
