// Command caddy is Caddy with caddy-l4 and caddy-ktls compiled in: the same
// main that `xcaddy build --with github.com/mholt/caddy-l4 --with
// github.com/ktlsingress/caddy-ktls` generates, kept in the repository so that
// tests and CI build a real Caddy with plain `go build` from the pinned go.sum.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/mholt/caddy-l4"

	_ "github.com/ktlsingress/caddy-ktls"
)

func main() {
	caddycmd.Main()
}
