package caddyktls

import "github.com/ktlsingress/caddy-ktls/internal/listensock"

// acceptRetryNetwork names the `tcp-retry` listener network. It lives in
// internal/listensock; importing that package here puts it in the binary.
const acceptRetryNetwork = listensock.RetryNetwork
