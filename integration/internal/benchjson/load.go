package benchjson

// LoadKind and LoadSchema identify a load document.
const (
	LoadKind   = "load"
	LoadSchema = 1
)

// LoadReport is the JSON document of an open-loop load run.
type LoadReport struct {
	Header
	Params  LoadParams    `json:"params"`
	Notes   []string      `json:"notes"`
	Results []*LoadResult `json:"results"`
	Skipped []Skipped     `json:"skipped,omitempty"`
	OK      bool          `json:"ok"`
}

// LoadParams are the sizes of a load run.
type LoadParams struct {
	Shapes  []string `json:"shapes"`
	Tunnels int      `json:"tunnels"`
	// Targets: sandbox targets behind the forwarder (ktls; the peers
	// forward to their one configured upstream).
	Targets         int     `json:"targets"`
	Req             int     `json:"req"`
	Resp            int     `json:"resp"`
	StepSeconds     float64 `json:"step_s"`
	UnloadedRate    float64 `json:"unloaded_rate"`
	UnloadedSeconds float64 `json:"unloaded_s"`
	// Rates: fixed rates instead of the capacity search and sweep.
	Rates       []float64 `json:"rates,omitempty"`
	SweepPcts   []float64 `json:"sweep_pcts,omitempty"`
	MaxRate     float64   `json:"max_rate"`
	SearchSteps int       `json:"search_steps"`
	// P99Factor: capacity is the highest rate whose p99 is at most this
	// many times the unloaded p99, with no error and no saturated arrival.
	P99Factor     float64 `json:"p99_factor"`
	CallTimeoutMs int64   `json:"call_timeout_ms"`
	Seed          uint64  `json:"seed"`
	// Bulk tunnels stream BulkBytes per transfer, both ways, through a
	// step at FairnessPct of capacity (or the first fixed rate).
	Bulk         int     `json:"bulk,omitempty"`
	BulkBytes    int64   `json:"bulk_bytes,omitempty"`
	FairnessPct  float64 `json:"fairness_pct,omitempty"`
	PinContender string  `json:"pin_contender,omitempty"`
	PeersMTLS    bool    `json:"peers_mtls"`
	// MaxHandshakes: the forwarder's max_handshakes, and an l4-l4
	// gateway's (0: its default, 128 per CPU it may use; -1: no bound).
	MaxHandshakes int `json:"max_handshakes,omitempty"`
	// MaxSchedulingDelay: the forwarder's max_scheduling_delay, and an
	// l4-l4 gateway's, a Go duration ("": none).
	MaxSchedulingDelay string `json:"max_scheduling_delay,omitempty"`
	// Standby: the standby option of l4-l4-standby's gateway.
	Standby int `json:"standby,omitempty"`
}

// LoadResult is one contender and shape.
type LoadResult struct {
	Contender string `json:"contender"`
	Shape     string `json:"shape"`
	Unloaded  *Step  `json:"unloaded,omitempty"`
	// Capacity: the highest rate that met the bound (calls/s), found by
	// the Search steps; 0 with fixed rates.
	Capacity float64 `json:"capacity,omitempty"`
	Search   []Step  `json:"search,omitempty"`
	Steps    []Step  `json:"steps"`
	// GoodputRatio: goodput at 200 % of capacity over goodput at 100 %.
	GoodputRatio float64 `json:"goodput_ratio,omitempty"`
	// Fairness: the step at FairnessPct again, with bulk tunnels.
	Fairness *Step `json:"fairness,omitempty"`
	// Baseline: the step without bulk that Fairness compares with.
	Baseline *Step  `json:"baseline,omitempty"`
	Offload  string `json:"offload"`
	// TLSStat: the change of /proc/net/tls_stat over the shape.
	TLSStat map[string]int64 `json:"tls_stat_delta,omitempty"`
	// RSSBefore and FDsBefore: the contender's resident memory (bytes)
	// and open fds just before the shape opened its tunnels, which each
	// step's ContenderRSS and ContenderFDs are compared with.
	RSSBefore int64 `json:"contender_rss_before_bytes,omitempty"`
	FDsBefore int   `json:"contender_fds_before,omitempty"`
	Tunnels   int64 `json:"tunnels_opened"`
	// Established: of those, the ones with a completed call, which the
	// key-install check counts.
	Established int64 `json:"tunnels_established"`
	// Handshakes: the TLS handshakes the generator's user connections
	// made with the contender (a chain's gateway) over the shape, and
	// Resumed those of them that resumed a session (what a per-call
	// connection pays: a full or a resumed handshake); 0 where not
	// recorded.
	Handshakes int64 `json:"user_handshakes,omitempty"`
	Resumed    int64 `json:"user_resumed,omitempty"`
	// UpstreamConns: a chain's tunnels over the shape, counted as the
	// connections the upstream accepted (one per forwarder tunnel), the
	// unit of its key-install check.
	UpstreamConns int64 `json:"upstream_conns,omitempty"`
	// GatewayTunnels: the tunnels a chain's gateway opened over the shape
	// (its caddy_ktls_gateway_dials_total{result="ok"}), the unit of the
	// key-install check where the gateway counts them (under overload
	// the upstream accepts connections that are no tunnel's), or its
	// completed handshakes with the hop behind it where those are fewer
	// (in ShapeCounters): a tunnel an L7 gateway's pool dialed in an
	// earlier shape and counted ok in this one installed its keys there.
	GatewayTunnels int64 `json:"gateway_tunnels,omitempty"`
	// ULPFallbacks: sockets a chain's processes served in userspace over
	// the shape because TCP_ULP failed on them (their peer had left after
	// the handshake): they install no key, and the key-install check
	// counts them as installed.
	ULPFallbacks int64 `json:"ulp_fallback_sockets,omitempty"`
	// FailedBehind: handshakes the hops behind a chain's gateway failed
	// over the shape for a cause other than shedding (their
	// caddy_ktls_handshake_failures_total without reason="overloaded": the
	// gateway closed, or the handshake_timeout ended it). Past capacity
	// the gateway may count a tunnel as dialed (its own handshake done, the
	// preamble written) whose forwarder never finished its handshake: that
	// socket installs no key and carried nothing, and the key-install
	// check counts it as installed.
	FailedBehind int64 `json:"failed_behind,omitempty"`
	// ShapeCounters: a chain's processes, the gateway first, each with the
	// change of its counters (as Hop.Counters) over the whole shape, from
	// before its tunnels opened to once it had settled after them: the
	// tallies GatewayTunnels, ULPFallbacks and FailedBehind are read from.
	ShapeCounters []Hop `json:"shape_counters,omitempty"`
	// HopsBefore: a chain's processes, the gateway first, each with its
	// resident memory and open fds just before the shape (their sums
	// are RSSBefore and FDsBefore).
	HopsBefore []Hop `json:"hops_before,omitempty"`
	// GoMemory: what the Go runtime of each Caddy process (a chain's
	// gateway first) held per tunnel once the reuse shape's tunnels were
	// open; none for other shapes and for contenders without an admin
	// endpoint (HAProxy, nginx).
	GoMemory []GoMemory `json:"go_memory,omitempty"`
	Errors   []string   `json:"errors,omitempty"`
}

// GoMemory is one process's Go runtime memory per tunnel held: the change
// from just before the tunnels opened to just after, each read right after
// a garbage collection, over the tunnels opened.
type GoMemory struct {
	// Name: gateway or forwarder, as in Hop.
	Name string `json:"name"`
	// HeapLive: the live heap (bytes); HeapInuse: the heap's spans in
	// use (bytes); Stacks: goroutine stacks (bytes); Goroutines: their
	// number.
	HeapLive   float64 `json:"heap_live_bytes_per_tunnel"`
	HeapInuse  float64 `json:"heap_inuse_bytes_per_tunnel"`
	Stacks     float64 `json:"stack_bytes_per_tunnel"`
	Goroutines float64 `json:"goroutines_per_tunnel"`
}

// Hop is one process of a chain over a step: its CPU, memory and the
// changes of its own failure counters.
type Hop struct {
	// Name: gateway or forwarder (l7-l7's dataplane Caddy is its
	// forwarder hop).
	Name string `json:"name"`
	// CPU: its CPU in cores over the step (0 in HopsBefore).
	CPU float64 `json:"cpu,omitempty"`
	// RSS and FDs: its resident memory (bytes) and open file descriptors
	// at the step's end (before the shape, in HopsBefore).
	RSS int64 `json:"rss_bytes,omitempty"`
	FDs int   `json:"fds,omitempty"`
	// Counters: the change over the step of each of its Prometheus
	// series (LoadCounterFamilies) that changed, keyed by the series as
	// /metrics names it (name{labels}).
	Counters map[string]float64 `json:"counters,omitempty"`
}

// Step is one step of a run at a fixed offered rate.
type Step struct {
	// Rate is the offered rate (calls/s); Pct its share of the
	// contender's capacity in a sweep (0 elsewhere).
	Rate    float64 `json:"rate"`
	Pct     float64 `json:"pct,omitempty"`
	Seconds float64 `json:"seconds"`
	// Offered: arrivals scheduled; Completed: calls whose bytes were all
	// right; Saturated: arrivals that found no free slot (the generator's
	// limit, not the contender's: not started, not an error).
	Offered   int `json:"offered"`
	Completed int `json:"completed"`
	Saturated int `json:"generator_saturated"`
	// Errors per class (Classes), and per "class: cause".
	Errors map[string]int `json:"errors,omitempty"`
	Causes map[string]int `json:"causes,omitempty"`
	// Goodput: calls completed within the step's span, per second.
	Goodput float64 `json:"goodput"`
	// Latencies of the completed calls from their scheduled arrival (µs).
	P50us  float64 `json:"p50_us"`
	P99us  float64 `json:"p99_us"`
	P999us float64 `json:"p999_us"`
	MaxUs  float64 `json:"max_us"`
	// LagP99us, LagMaxus: how late the generator started calls after
	// their scheduled arrival (its own lag, inside the latencies above).
	LagP99us float64 `json:"lag_p99_us"`
	LagMaxus float64 `json:"lag_max_us"`
	// GenCPU: the generator process's CPU (it also runs the upstream) in
	// cores over the step: near its vCPU count, the generator, not the
	// contender, may be the limit.
	GenCPU float64 `json:"gen_cpu"`
	// ContenderCPU: the contender's CPU in cores over the step.
	ContenderCPU float64 `json:"contender_cpu"`
	// ContenderRSS and ContenderFDs: the contender's resident memory
	// (bytes) and open file descriptors at the step's end, the tunnels it
	// holds and the calls still in flight included (0: not recorded).
	ContenderRSS int64 `json:"contender_rss_bytes,omitempty"`
	ContenderFDs int   `json:"contender_fds,omitempty"`
	// Hops: a chain's processes over the step, the gateway first; the
	// contender's CPU, RSS and fds above are their sums.
	Hops []Hop `json:"hops,omitempty"`
	// SettleSeconds: how long the step waited, before it began, for the
	// contender to be idle (the work a previous step left it).
	SettleSeconds float64 `json:"settle_s"`
	// Bulk: the bulk tunnels streaming alongside (fairness steps), and
	// the bytes they moved and their errors.
	Bulk       int    `json:"bulk,omitempty"`
	BulkBytes  int64  `json:"bulk_bytes,omitempty"`
	BulkErrors int    `json:"bulk_errors,omitempty"`
	FirstError string `json:"first_error,omitempty"`
}

// ErrorCount is the step's failed calls over every class.
func (s *Step) ErrorCount() int {
	n := 0
	for _, v := range s.Errors {
		n += v
	}
	return n
}

// The classes of a failed load call (the keys of Step.Errors), each named
// for who caused it.
const (
	// ClassRefused: the proxy refused the call: a TLS alert before or
	// during the handshake (access_denied there is the forwarder shedding
	// an overloaded connection), access_denied on the first read after the
	// preamble (the forwarder's bound on pending dials), the peer closing
	// before the handshake completed, a refused TCP connection, or an
	// HTTP 503 (reverse_proxy's own refusal).
	ClassRefused = "refused"
	// ClassTarget: the upstream's own failure, as the proxy reports it
	// (HTTP 502 from a one-process contender).
	ClassTarget = "target"
	// ClassGateway: a chain's gateway answered for a failure behind it
	// (its HTTP 502): the forwarder's refusal, its shedding, or the
	// target's failure; the hops' counters (Hop.Counters) say which.
	ClassGateway = "gateway"
	// ClassTimeout: the generator's own per-call deadline passed (a
	// proxy-side timeout shows as a close or an alert instead).
	ClassTimeout = "timeout"
	// ClassReset: a TCP reset (ECONNRESET, EPIPE).
	ClassReset = "reset"
	// ClassCorrupt: a response byte that differs from the payload: the
	// call failed, whatever else happened.
	ClassCorrupt = "corrupt"
	// ClassOther: anything else, the error's text as its cause.
	ClassOther = "other"
)

// Classes are the classes in the order the reports list them.
var Classes = []string{ClassRefused, ClassGateway, ClassTarget, ClassTimeout, ClassReset, ClassCorrupt, ClassOther}

// LoadCounterFamilies are the Prometheus counter families a load run reads
// from each hop of a chain before and after every step (Hop.Counters):
// the gateway modules' dials by result and those that resumed a session
// with the forwarder, their tunnels' ends, their standby connections, the
// ktls handlers' and the sandbox handler's refusals by reason, and the kTLS
// engine's handshakes by offload outcome, its directions by where their
// records are processed, and the connections it ended after a handshake
// (where a socket's keys did not go to the kernel, and why).
var LoadCounterFamilies = []string{
	"caddy_ktls_handshakes_total",
	"caddy_ktls_offload_directions_total",
	"caddy_ktls_connections_closed_total",
	"caddy_ktls_gateway_dials_total",
	"caddy_ktls_gateway_dials_resumed_total",
	"caddy_ktls_gateway_tunnel_ends_total",
	"caddy_ktls_gateway_standby_total",
	"caddy_ktls_handshake_failures_total",
	"caddy_ktls_sandbox_rejects_total",
}
