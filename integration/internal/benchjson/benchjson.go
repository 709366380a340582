// Package benchjson is the JSON documents of the bench runs that have one
// of their own: bench load and bench ttfb (integration/bench) write them,
// benchreport load and ttfb (integration/benchreport) render them
// (docs/bench/load.json into load.md, ttfb.json into ttfb.md). Their types
// are the documents' schemas, declared once for both: a field added here
// is written by the one and read by the other.
package benchjson

// Header opens every document: what ran, where and when.
type Header struct {
	Schema int    `json:"schema"`
	Kind   string `json:"kind"` // LoadKind, TTFBKind
	Mode   string `json:"mode"`
	Label  string `json:"label,omitempty"`
	Kernel string `json:"kernel"`
	Date   string `json:"date"`
	Commit string `json:"commit,omitempty"`
	Host   string `json:"host"`
	Go     string `json:"go"`
	// CPUs: the CPUs the bench process (the generator, the client) may
	// run on.
	CPUs int `json:"cpus"`
}

// Skipped is a contender the run could not start or drive, and why.
type Skipped struct {
	Contender string `json:"contender"`
	Reason    string `json:"reason"`
}
