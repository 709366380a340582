package benchjson

// TTFBKind and TTFBSchema identify a time-to-first-byte document.
const (
	TTFBKind   = "ttfb"
	TTFBSchema = 1
)

// TTFBReport is the JSON document of a time-to-first-byte run.
type TTFBReport struct {
	Header
	Params TTFBParams `json:"params"`
	Notes  []string   `json:"notes"`
	// Paths: the delay's check at each RTT (the chains share the delay).
	Paths   []*Path       `json:"paths"`
	Results []*TTFBResult `json:"results"`
	Skipped []Skipped     `json:"skipped,omitempty"`
	OK      bool          `json:"ok"`
}

// TTFBParams are the settings of a run.
type TTFBParams struct {
	Contenders []string `json:"contenders"`
	// RTTsMs: the round-trip times asked between gateway and forwarder.
	RTTsMs []float64 `json:"rtts_ms"`
	// Conns: measured connections per contender and RTT, one after the
	// other, to the chains in turn, each followed by PauseMs + 3 RTT of
	// quiet; before them one uncounted connection per chain, then
	// SettleMs of quiet.
	Conns    int     `json:"conns"`
	PauseMs  float64 `json:"pause_ms"`
	SettleMs float64 `json:"settle_ms"`
	// Standby: the gateway's standby option in the contenders whose name
	// ends in -standby.
	Standby int `json:"standby"`
	// Req and Resp: the one call each connection makes (bytes up, down).
	Req  int `json:"req"`
	Resp int `json:"resp"`
	// Probes: TCP connects whose fastest is a path check's figure.
	Probes int `json:"probes"`
	// A path check passes when the RTT the delay added is within
	// ToleranceRel × the RTT asked + ToleranceMs of it.
	ToleranceRel float64 `json:"tolerance_rel"`
	ToleranceMs  float64 `json:"tolerance_ms"`
	// ForwarderAddr: the loopback address the forwarder hop listens on,
	// the one address netem delays; Device: the interface of the qdisc.
	ForwarderAddr string `json:"forwarder_addr"`
	Device        string `json:"device"`
	CallTimeoutMs int64  `json:"call_timeout_ms"`
	// PinContender: the CPU list every process of the chains runs on.
	PinContender string `json:"pin_contender,omitempty"`
}

// TTFBResult is one contender at one RTT.
type TTFBResult struct {
	Contender string  `json:"contender"`
	RTTMs     float64 `json:"rtt_ms"`
	// WarmupMs: the time to first byte of the uncounted first connection
	// (it opens the L7 gateway's pooled tunnel, and the first standby
	// connections follow it).
	WarmupMs float64 `json:"warmup_ms"`
	// N: connections measured; Failed: connections that failed (not in
	// N), FirstError the first one's error.
	N          int    `json:"n"`
	Failed     int    `json:"failed"`
	FirstError string `json:"first_error,omitempty"`
	// Times to first byte of the N connections (ms): nearest-rank
	// percentiles, and every sample in the order measured.
	MinMs     float64   `json:"min_ms"`
	P50Ms     float64   `json:"p50_ms"`
	P90Ms     float64   `json:"p90_ms"`
	P99Ms     float64   `json:"p99_ms"`
	MaxMs     float64   `json:"max_ms"`
	SamplesMs []float64 `json:"samples_ms,omitempty"`
	// NetemPackets and NetemDrops: what the netem qdisc delayed (and
	// dropped) in this contender's turns: its connections and the quiet
	// after each.
	NetemPackets int64 `json:"netem_packets"`
	NetemDrops   int64 `json:"netem_drops"`
	// ForwarderConns: established connections to the forwarder's
	// listener after the last measured connection: the L7 gateway's
	// pooled tunnels, or the standby connections.
	ForwarderConns int `json:"forwarder_conns"`
	// Errors: what failed this result (the run fails with it).
	Errors []string `json:"errors,omitempty"`
}

// Path is the check that netem delays the gateway↔forwarder path, and
// only it, by the RTT asked. Each figure is the fastest of the run's
// probes (params.probes TCP connects one after the other, one round trip
// each): a connect's own time under TCG varies by milliseconds, upward.
type Path struct {
	RTTMs float64 `json:"rtt_ms"`
	// Batches: the batches of probes taken with the delay in place, until
	// the check passed or the last; the figures with it are the fastest
	// of them all.
	Batches int `json:"batches"`
	// Commands: the tc command lines that installed the delay.
	Commands []string `json:"commands"`
	// ForwarderBeforeMs and ForwarderMs: a connect to the forwarder's
	// address before the delay and with it; AddedMs, the round trip the
	// delay added (their difference), must fall in LowMs to HighMs.
	ForwarderBeforeMs float64 `json:"forwarder_before_ms"`
	ForwarderMs       float64 `json:"forwarder_ms"`
	AddedMs           float64 `json:"added_ms"`
	LowMs             float64 `json:"low_ms"`
	HighMs            float64 `json:"high_ms"`
	// LocalBeforeMs and LocalMs: the same to 127.0.0.1, the address of
	// the client↔gateway and forwarder↔upstream paths; LocalAddedMs must
	// stay below LocalHighMs (half the RTT asked, plus the tolerance's
	// constant).
	LocalBeforeMs float64 `json:"local_before_ms"`
	LocalMs       float64 `json:"local_ms"`
	LocalAddedMs  float64 `json:"local_added_ms"`
	LocalHighMs   float64 `json:"local_high_ms"`
	OK            bool    `json:"ok"`
	// Errors: what failed at this RTT besides a check out of its band
	// (installing the delay, a probe, the sockets on the forwarders'
	// address); the run fails with them.
	Errors []string `json:"errors,omitempty"`
}
