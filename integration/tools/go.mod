// The test tools built from the Go module proxy at pinned versions
// (`make tools`): h2spec, the HTTP/2 conformance suite that
// TestKernelListenerWrapperConformance runs against stock Caddy and the
// ktls wrapper side by side.
module github.com/ktlsingress/caddy-ktls/integration/tools

go 1.26.0

require github.com/summerwind/h2spec v2.2.1+incompatible

require (
	github.com/fatih/color v1.19.0 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/mattn/go-colorable v0.1.14 // indirect
	github.com/mattn/go-isatty v0.0.20 // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
	golang.org/x/text v0.43.0 // indirect
)
