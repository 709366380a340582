//go:build tools

// Package tools pins the versions of the test tools in go.mod.
package tools

import _ "github.com/summerwind/h2spec/cmd/h2spec"
