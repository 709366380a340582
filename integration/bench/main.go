// Command bench is the benchmark harness of caddy-ktls (issue 7): it runs
// every forwarder contender (this project with kTLS on, RX off and offload
// off, caddy-l4's tls+proxy, Caddy's reverse_proxy, HAProxy, nginx, and four
// floors of its own) against the same upstream, through the same gateway
// client, and writes one JSON document (docs/bench/results.json). It also
// runs the edge-gateway paths of issue 19 (l7-l7, l7-l4, l4-l4: a gateway
// Caddy and the hop behind it, its client playing the user;
// docs/bench/gateway.md).
//
// integration/bench.sh builds it and runs it in a VM under qemu -icount,
// where guest time counts instructions; see that script for the modes.
//
//	bench run [flags]      the driver: gateway, upstream, contenders, JSON
//	bench load [flags]     the open-loop load generator (latency against
//	                       offered load, capacity; docs/bench/load.md)
//	bench ttfb [flags]     a new connection's time to first byte through
//	                       the gateway chains, netem between gateway and
//	                       forwarder (docs/bench/ttfb.md)
//	bench floor-ktls ...   the crypto floor: TLS 1.3 → kTLS TX+RX → splice
//	bench floor-plain ...  plain TCP → splice
//	bench floor-rw-ktls ... TLS 1.3 → its own kTLS install → read/write
//	bench floor-rw-plain ... plain TCP → read/write
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
	"github.com/ktlsingress/caddy-ktls/internal/freeport"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

func main() {
	log.SetFlags(0)
	if len(os.Args) < 2 {
		log.Fatal("usage: bench run|load|ttfb|floor-ktls|floor-plain|floor-rw-ktls|floor-rw-plain [flags]")
	}
	var err error
	switch sub := os.Args[1]; sub {
	case "run":
		err = runDriver(os.Args[2:])
	case "load":
		err = runLoad(os.Args[2:])
	case "ttfb":
		err = runTTFB(os.Args[2:])
	case "floor-ktls", "floor-plain":
		err = runFloor(sub, os.Args[2:])
	case "floor-rw-ktls", "floor-rw-plain":
		err = runFloorRW(sub, os.Args[2:])
	default:
		err = fmt.Errorf("unknown subcommand %q", sub)
	}
	if err != nil {
		log.Fatalf("bench: %v", err)
	}
}

// params are the sizes of a run, recorded in the JSON.
type params struct {
	BulkBytes         int64 `json:"bulk_bytes"`
	Repetitions       int   `json:"repetitions"`
	SmallConns        int   `json:"small_conns"`
	SmallCalls        int   `json:"small_calls"`
	SmallPerCallCalls int   `json:"small_per_call_calls"`
	SmallReq          int   `json:"small_req"`
	SmallResp         int   `json:"small_resp"`
	StructuralBytes   int64 `json:"structural_bytes"`
	StructuralCalls   int   `json:"structural_calls"`
	GatewayKTLS       bool  `json:"gateway_ktls,omitempty"`
	PeersMTLS         bool  `json:"peers_mtls,omitempty"`
}

type report struct {
	Schema  int             `json:"schema"`
	Mode    string          `json:"mode"`
	Kernel  string          `json:"kernel"`
	Date    string          `json:"date"`
	Commit  string          `json:"commit,omitempty"` // the checkout measured: git rev-parse HEAD, "-dirty" when code differed from it
	Host    string          `json:"host"`
	Go      string          `json:"go"`
	Params  params          `json:"params"`
	Notes   []string        `json:"notes"`
	Results []*result       `json:"results"`
	Skipped []skipped       `json:"skipped,omitempty"`
	TLSStat kerneltest.Stat `json:"tls_stat_delta"`
	OK      bool            `json:"ok"`
}

type skipped struct {
	Contender string `json:"contender"`
	Reason    string `json:"reason"`
}

type run struct {
	CPUs     float64 `json:"cpu_s"`
	Users    float64 `json:"user_s"`
	Syss     float64 `json:"sys_s"`
	Walls    float64 `json:"wall_s"`
	Bytes    int64   `json:"bytes"`
	Calls    int     `json:"calls"`
	P50us    float64 `json:"p50_us"`
	P99us    float64 `json:"p99_us"`
	SHA256OK bool    `json:"sha256_ok"`
	CPUFrom  string  `json:"cpu_source"`
	// Hops: a chain's CPU per process (cpu_s is their sum).
	Hops  []hopRun `json:"hops,omitempty"`
	Error string   `json:"error,omitempty"`
}

// hopRun is one process's CPU in a run of a chain.
type hopRun struct {
	Name string  `json:"name"`
	CPUs float64 `json:"cpu_s"`
}

// hopResult is one process's share of a chain's cell.
type hopResult struct {
	Name         string  `json:"name"`
	CPUPerGiB    spread  `json:"cpu_s_per_gib"`
	CallsPerCPUs *spread `json:"calls_per_cpu_s,omitempty"`
}

type result struct {
	Contender    string          `json:"contender"`
	Shape        string          `json:"shape"`
	Runs         []run           `json:"runs"`
	CPUPerGiB    spread          `json:"cpu_s_per_gib"`
	GiBPerS      spread          `json:"gib_per_s"`
	CallsPerCPUs *spread         `json:"calls_per_cpu_s,omitempty"`
	P50us        float64         `json:"p50_us,omitempty"`
	P99us        float64         `json:"p99_us,omitempty"`
	Structural   *structural     `json:"structural,omitempty"`
	Offload      string          `json:"offload"`
	TLSStat      kerneltest.Stat `json:"tls_stat_delta,omitempty"`
	// GatewayTX: of TLSStat's TX keys, those of the gateway's own sockets
	// (-gateway-ktls).
	GatewayTX int64 `json:"gateway_tx,omitempty"`
	// Tunnels: the tunnels the gateway opened over the cell (L4
	// contenders); a kernel direction needs a key install for each.
	Tunnels int64 `json:"tunnels,omitempty"`
	// Resumed: of those tunnels, the ones whose TLS handshake resumed a
	// session (small-per-call-resumed).
	Resumed int64 `json:"resumed,omitempty"`
	// Hops: a chain's figures per process (cpu_s_per_gib and
	// calls_per_cpu_s above are of all its processes together).
	Hops []hopResult `json:"hops,omitempty"`
	// UpstreamConns: the connections the upstream accepted over the cell;
	// for a chain, its forwarder's tunnels, the unit of its key-install
	// check.
	UpstreamConns int64 `json:"upstream_conns,omitempty"`
	// keyless: sockets the contender served in userspace because their
	// peer had left before the key install (a load run's chains): the
	// key-install check counts them as installed.
	keyless int64
	Errors  []string `json:"errors,omitempty"`
}

var shapes = []string{"upload", "download", "small-reuse", "small-per-call", "small-per-call-resumed"}

// resumedShape is the shape whose gateway keeps a TLS session cache, so
// that a call's handshake resumes a session the contender issued before.
const resumedShape = "small-per-call-resumed"

const gib = 1 << 30

// harness is what every contender of a run (bench run, bench load)
// shares: the Caddy binary and this executable (the floors run it again)
// by absolute path, a temporary directory holding the run's PKI and the
// contenders' files, and the upstream.
type harness struct {
	caddy, self, dir string
	pki              *pki
	up               *upstream
}

// newHarness makes a harness whose directory's name starts with
// tmpPrefix; on an error it undoes what it made.
func newHarness(caddyBin, tmpPrefix string) (_ *harness, err error) {
	h := &harness{}
	if h.caddy, err = filepath.Abs(caddyBin); err != nil {
		return nil, err
	}
	if h.self, err = os.Executable(); err != nil {
		return nil, err
	}
	if h.dir, err = os.MkdirTemp("", tmpPrefix); err != nil {
		return nil, err
	}
	if h.pki, err = newPKI(h.dir); err == nil {
		h.up, err = startUpstream()
	}
	if err != nil {
		os.RemoveAll(h.dir)
		return nil, err
	}
	return h, nil
}

// close stops the upstream and removes the directory.
func (h *harness) close() {
	h.up.close()
	os.RemoveAll(h.dir)
}

func runDriver(args []string) error {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	var p params
	fs.Int64Var(&p.BulkBytes, "bulk-bytes", 64<<20, "bytes per bulk run (upload, download)")
	fs.IntVar(&p.Repetitions, "reps", 3, "runs per contender and shape (CPU pass)")
	fs.IntVar(&p.SmallConns, "small-conns", 16, "concurrent connections of the small-call shapes")
	fs.IntVar(&p.SmallCalls, "small-calls", 2000, "calls per small-reuse run")
	fs.IntVar(&p.SmallPerCallCalls, "small-per-call-calls", 400, "calls per small-per-call run (each a full handshake) and per small-per-call-resumed run")
	fs.IntVar(&p.SmallReq, "small-req", 1024, "request bytes per small call")
	fs.IntVar(&p.SmallResp, "small-resp", 4096, "response bytes per small call")
	fs.Int64Var(&p.StructuralBytes, "structural-bytes", 16<<20, "bytes per bulk run of the traced (structural) pass")
	fs.IntVar(&p.StructuralCalls, "structural-calls", 400, "calls per small run of the traced pass")
	fs.BoolVar(&p.GatewayKTLS, "gateway-ktls", false, "the gateway seals its records in its own kernel (kTLS TX), so one write hands over many records")
	fs.BoolVar(&p.PeersMTLS, "peers-mtls", false, "the TLS peers (l4-proxy, reverse-proxy, haproxy, nginx) also require and verify the gateway's client certificate, as the ktls contenders do")
	mode := fs.String("mode", "vm-icount", "where this runs: vm-icount, vm or native (recorded; vm modes require kTLS)")
	only := fs.String("contenders", strings.Join(contenderNames(), ","), "contenders to run")
	shapeList := fs.String("shapes", strings.Join(shapes, ","), "shapes to run")
	caddyBin := fs.String("caddy", "bin/caddy", "Caddy binary with caddy-l4 and this module")
	out := fs.String("out", "results.json", "JSON output file")
	noTrace := fs.Bool("no-structural", false, "skip the structural passes (untraced count and strace)")
	timeout := fs.Duration("run-timeout", 30*time.Minute, "bound on one run of one shape")
	commit := fs.String("commit", "", "the commit of the checkout the binaries were built from, recorded (bench.sh passes git rev-parse HEAD, with -dirty when tracked code differs from it)")
	pprofDir := fs.String("pprof", "", "after each shape's CPU pass, profile more runs of it with the forwarder's Go CPU profiler (Caddy contenders: their admin endpoint on a unix socket) and write the profiles to this directory")
	fs.Parse(args)
	if p.Repetitions < 1 || p.SmallConns < 1 || p.BulkBytes < 1 || p.SmallReq < 1 || p.SmallResp < 1 ||
		p.SmallReq > maxCallLen || p.SmallResp > maxCallLen {
		return errors.New("sizes must be positive (small sizes at most 1 MiB)")
	}
	shapeNames := strings.Split(*shapeList, ",")
	for _, s := range shapeNames {
		if !slices.Contains(shapes, s) {
			return fmt.Errorf("unknown shape %q (have %s)", s, strings.Join(shapes, ", "))
		}
	}
	if *pprofDir != "" {
		if err := os.MkdirAll(*pprofDir, 0o755); err != nil {
			return err
		}
	}
	h, err := newHarness(*caddyBin, "ktls-bench-")
	if err != nil {
		return err
	}
	defer h.close()

	var uts syscall.Utsname
	syscall.Uname(&uts)
	rep := &report{
		Schema: 1, Mode: *mode, Kernel: utsString(uts.Release[:]), Date: time.Now().UTC().Format(time.RFC3339), Commit: *commit,
		Host: strings.Join([]string{utsString(uts.Sysname[:]), utsString(uts.Nodename[:]), utsString(uts.Release[:]),
			utsString(uts.Version[:]), utsString(uts.Machine[:])}, " "),
		Go: runtime.Version(), Params: p, Notes: notes(*mode, p.GatewayKTLS, p.PeersMTLS), TLSStat: kerneltest.Stat{}, OK: true,
	}
	kernelTLS := kerneltest.Available()
	if kernelTLS != nil && (*mode != "native" || p.GatewayKTLS) {
		return fmt.Errorf("mode %s (gateway kTLS %v) needs kernel TLS: %v", *mode, p.GatewayKTLS, kernelTLS)
	}
	stat0, _ := kerneltest.ReadStat()
	chains := false
	for _, name := range strings.Split(*only, ",") {
		c, ok := findContender(name)
		if !ok {
			return fmt.Errorf("unknown contender %q (have %s)", name, strings.Join(contenderNames(), ", "))
		}
		if (c.kernelTX || c.kernelRX) && kernelTLS != nil {
			// A fallback run would be labelled kTLS and measure userspace TLS.
			reason := fmt.Sprintf("this kernel has no kTLS (%v): refusing a contender that must run on it", kernelTLS)
			log.Printf("REFUSED %s: %s", c.name, reason)
			rep.Skipped = append(rep.Skipped, skipped{c.name, reason})
			continue
		}
		env := &runEnv{dir: h.dir, caddy: h.caddy, self: h.self, listen: freeAddr(), up: h.up, pki: h.pki, countRequired: *mode != "native", gatewayKTLS: p.GatewayKTLS, peersMTLS: p.PeersMTLS}
		if c.chain != nil {
			env.hopListen = freeAddr()
			chains = true
		}
		if *pprofDir != "" && c.chain == nil {
			env.adminSock = filepath.Join(h.dir, c.name+".admin.sock")
		}
		results, err := benchContender(c, env, p, shapeNames, !*noTrace, *timeout, *pprofDir)
		rep.Results = append(rep.Results, results...)
		if err != nil {
			log.Printf("FAIL %s: %v", c.name, err)
			rep.OK = false
		}
		for _, r := range results {
			if len(r.Errors) > 0 {
				rep.OK = false
			}
		}
	}
	if chains {
		rep.Notes = append(rep.Notes, chainNote)
	}
	if stat1, err := kerneltest.ReadStat(); err == nil {
		rep.TLSStat = stat1.Sub(stat0)
	}
	printTable(rep)
	return writeReport(*out, rep, rep.OK, "bench", len(rep.Results),
		"a contender did not move the exact bytes or ran on the wrong data path (see errors in "+*out+")")
}

// newHeader is the header of a run of kind and schema on this machine,
// now.
func newHeader(kind string, schema int, mode, label, commit string) benchjson.Header {
	var uts syscall.Utsname
	syscall.Uname(&uts)
	return benchjson.Header{Schema: schema, Kind: kind, Mode: mode, Label: label, Kernel: utsString(uts.Release[:]),
		Date: time.Now().UTC().Format(time.RFC3339), Commit: commit,
		Host: strings.Join([]string{utsString(uts.Sysname[:]), utsString(uts.Release[:]), utsString(uts.Machine[:])}, " "),
		Go:   runtime.Version(), CPUs: runtime.NumCPU()}
}

// writeReport writes rep as indented JSON to out; a run that was not ok
// fails with why, one that was logs what it wrote.
func writeReport(out string, rep any, ok bool, run string, results int, why string) error {
	data, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(out, append(data, '\n'), 0o644); err != nil {
		return err
	}
	if !ok {
		return errors.New("FAIL: " + why)
	}
	log.Printf("%s: OK, %d results in %s", run, results, out)
	return nil
}

// benchContender starts one contender and runs every shape on it.
func benchContender(c contender, env *runEnv, p params, shapeNames []string, trace bool, timeout time.Duration, pprofDir string) ([]*result, error) {
	hops, err := c.hops(env)
	if err != nil {
		return nil, err
	}
	// The hop behind starts first: the gateway in front of it dials it.
	procs := make([]*process, len(hops))
	for i := len(hops) - 1; i >= 0; i-- {
		name := c.name
		if c.chain != nil {
			name += "." + hops[i].name
		}
		p, err := startProcess(hops[i], filepath.Join(env.dir, name+".log"))
		if err != nil {
			return nil, err
		}
		defer p.stop()
		procs[i] = p
		if err := waitListening(hops[i].listen, p.exited); err != nil {
			return nil, fmt.Errorf("%s: %w; log:\n%s", hops[i].name, err, tail(p.log))
		}
	}
	front := procs[0]
	pids := make([]int, len(procs))
	for i, p := range procs {
		pids[i] = p.cmd.Process.Pid
	}
	logs := func() string {
		var b strings.Builder
		for _, p := range procs {
			fmt.Fprintf(&b, "%s log:\n%s", p.name, tail(p.log))
		}
		return b.String()
	}
	// Every shape has the gateway without a session cache but the resumed
	// one, which has its own, filled by its first handshakes.
	full, resuming := c.gateway(env, false), c.gateway(env, true)
	g := full
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	// A first transfer: the contender works end to end before any figure.
	warm0, warmStatErr := kerneltest.ReadStat()
	sealed0, conns0 := g.sealed.Load(), env.up.conns.Load()
	if _, err := g.download(ctx, 64<<10); err != nil {
		return nil, fmt.Errorf("warm-up download: %w; %s", err, logs())
	}
	if warm1, err := kerneltest.ReadStat(); c.chain != nil && warmStatErr == nil && err == nil {
		// The L7 gateways pool the tunnels the warm-up opens, and later
		// cells may use them without opening any: their key installs are
		// checked here.
		d := warm1.Sub(warm0)
		tx, rx := d["TlsTxSw"]+d["TlsTxDevice"]-(g.sealed.Load()-sealed0), d["TlsRxSw"]+d["TlsRxDevice"]
		if errs := keyInstallErrors(c, tx, rx, env.up.conns.Load()-conns0); len(errs) > 0 {
			return nil, fmt.Errorf("warm-up download: %s", strings.Join(errs, "; "))
		}
	}
	log.Printf("== %s (pids %v)", c.name, pids)
	var results []*result
	for _, shape := range shapeNames {
		g := full
		if shape == resumedShape {
			g = resuming
		}
		r := &result{Contender: c.name, Shape: shape}
		results = append(results, r)
		stat0, statErr := kerneltest.ReadStat()
		sealed0, tunnels0, resumed0, asked0 := g.sealed.Load(), g.tunnels.Load(), g.resumed.Load(), g.certAsked.Load()
		conns0 := env.up.conns.Load()
		do := shapeFunc(g, shape, p)
		for i := range p.Repetitions {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			run := measure(ctx, hops, pids, func(ctx context.Context, ready func()) (transfer, error) { return do(ctx, false, ready) })
			cancel()
			r.Runs = append(r.Runs, run)
			log.Printf("   %s run %d: %d bytes, %d calls, forwarder cpu %.3fs%s, wall %.3fs %s", shape, i+1, run.Bytes, run.Calls, run.CPUs, hopsCPU(run.Hops), run.Walls, run.Error)
		}
		if _, err := os.Stat(env.adminSock); pprofDir != "" && err == nil {
			// The profiler samples for a fixed span: runs as slow as the
			// CPU pass's slowest, with room to spare; at 100 Hz, ten
			// runs at least.
			var walls float64
			for _, run := range r.Runs {
				walls = max(walls, run.Walls)
			}
			reps := max(p.Repetitions, 10)
			span := time.Duration(float64(reps)*walls*1.5*float64(time.Second)) + 2*time.Second
			if err := pprofProfile(env.adminSock, filepath.Join(pprofDir, c.name+"."+shape+".pprof"), reps, span, do, timeout); err != nil {
				r.Errors = append(r.Errors, "profile pass: "+err.Error())
			}
		}
		if trace {
			pid := front.cmd.Process.Pid
			untraced, untracedErr := countSyscalls(pid, do, timeout)
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			var tr transfer
			traced0, preamble0 := g.tunnels.Load(), g.preambleBytes.Load()
			s, err := traceSyscalls(pid, filepath.Join(env.dir, "strace."+c.name+"."+shape), func() (err error) {
				tr, err = do(ctx, true, nil)
				return err
			})
			cancel()
			if err != nil {
				r.Errors = append(r.Errors, "structural pass: "+err.Error())
			} else {
				s.Bytes, s.Calls = tr.bytes, tr.calls
				s.Tunnels, s.PreambleBytes = g.tunnels.Load()-traced0, g.preambleBytes.Load()-preamble0
				if c.chain != nil && c.dialKind == "tls" {
					// The traced gateway writes a preamble per tunnel.
					s.PreambleBytes = s.Tunnels * int64(env.gatewayFrameLen())
				}
				s.SyscallsPerGiB = round(float64(s.Syscalls)*gib/float64(tr.bytes), 0)
				s.UserspaceBytesPerGiB = round(float64(s.UserspaceBytes)*gib/float64(tr.bytes), 0)
				s.DataSyscallsPerGiB = round(float64(s.DataSyscalls)*gib/float64(tr.bytes), 0)
				if tr.calls > 0 {
					s.SyscallsPerCall = round(float64(s.Syscalls)/float64(tr.calls), 2)
				}
				switch {
				case errors.Is(untracedErr, errCounter) && !env.countRequired:
					s.UntracedError = untracedErr.Error()
					log.Printf("   %s: %v", shape, untracedErr)
				case untracedErr != nil:
					r.Errors = append(r.Errors, "untraced structural pass: "+untracedErr.Error())
				default:
					s.UntracedSyscalls, s.UntracedTop, s.UntracedSource = untraced.syscalls, untraced.top, countSource
					s.UntracedSyscallsPerGiB = round(float64(untraced.syscalls)*gib/float64(untraced.bytes), 0)
					if untraced.calls > 0 {
						s.UntracedSyscallsPerCall = round(float64(untraced.syscalls)/float64(untraced.calls), 2)
					}
				}
				r.Structural = &s
				log.Printf("   %s traced: %d syscalls, %d userspace bytes (%d before key installs) for %d bytes over %d tunnels (%d preamble bytes); untraced: %d syscalls for %d bytes %v",
					shape, s.Syscalls, s.UserspaceBytes, s.PreOffloadBytes, s.Bytes, s.Tunnels, s.PreambleBytes, untraced.syscalls, untraced.bytes, untraced.top)
			}
		}
		if statErr == nil {
			stat1, _ := kerneltest.ReadStat()
			r.TLSStat = stat1.Sub(stat0)
			r.GatewayTX = g.sealed.Load() - sealed0
		}
		r.Tunnels = g.tunnels.Load() - tunnels0
		r.UpstreamConns = env.up.conns.Load() - conns0
		if c.peer && p.PeersMTLS && g.certAsked.Load() == asked0 {
			r.Errors = append(r.Errors, "peers_mtls: the server never asked the gateway for its certificate")
		}
		if shape == resumedShape {
			// Reported, not required: a contender that issues no tickets
			// (caddy-l4's tls handler) does full handshakes here, and
			// the report says so beside its figures.
			r.Resumed = g.resumed.Load() - resumed0
		}
		summarize(r, c)
		for _, e := range r.Errors {
			log.Printf("FAIL %s %s: %s", c.name, shape, e)
		}
	}
	return results, nil
}

// shapeFunc returns one run of a shape (one of shapes); structural picks the
// traced pass's (smaller) size.
//
// ready, when not nil, is called once the shape's setup is done and its
// measured part begins (small-reuse: after every connection is open).
func shapeFunc(g *gateway, shape string, p params) func(ctx context.Context, structural bool, ready func()) (transfer, error) {
	bulk := func(structural bool) int64 {
		if structural {
			return p.StructuralBytes
		}
		return p.BulkBytes
	}
	calls := func(structural bool, n int) int {
		if structural {
			return min(p.StructuralCalls, n)
		}
		return n
	}
	switch shape {
	case "upload":
		return func(ctx context.Context, s bool, _ func()) (transfer, error) { return g.upload(ctx, bulk(s)) }
	case "download":
		return func(ctx context.Context, s bool, _ func()) (transfer, error) { return g.download(ctx, bulk(s)) }
	case "small-reuse":
		return func(ctx context.Context, s bool, ready func()) (transfer, error) {
			return g.small(ctx, p.SmallConns, calls(s, p.SmallCalls), p.SmallReq, p.SmallResp, true, ready)
		}
	case "small-per-call":
		return func(ctx context.Context, s bool, ready func()) (transfer, error) {
			return g.small(ctx, p.SmallConns, calls(s, p.SmallPerCallCalls), p.SmallReq, p.SmallResp, false, ready)
		}
	case resumedShape:
		// The first run fills the gateway's empty session cache with one
		// uncounted call before its measured part, so that every measured
		// handshake can resume (as small-reuse opens its connections
		// before its measured part); later runs find the cache filled.
		warmed := false
		return func(ctx context.Context, s bool, ready func()) (transfer, error) {
			if !warmed {
				if _, err := g.small(ctx, 1, 1, p.SmallReq, p.SmallResp, false, nil); err != nil {
					return transfer{}, fmt.Errorf("warming the session cache: %w", err)
				}
				warmed = true
			}
			return g.small(ctx, p.SmallConns, calls(s, p.SmallPerCallCalls), p.SmallReq, p.SmallResp, false, ready)
		}
	}
	return nil
}

// measure runs one shape and charges the CPU of the contender's processes
// (pids, one per hop) to it. A shape that calls ready starts the
// measurement there instead.
func measure(ctx context.Context, hops []hop, pids []int, do func(context.Context, func()) (transfer, error)) run {
	sample := func() ([]cpuSample, error) {
		out := make([]cpuSample, len(pids))
		for i, pid := range pids {
			s, err := sampleCPU(pid)
			if err != nil {
				return nil, fmt.Errorf("%s gone: %w", hops[i].name, err)
			}
			out[i] = s
		}
		return out, nil
	}
	before, err := sample()
	if err != nil {
		return run{Error: err.Error()}
	}
	start := time.Now()
	tr, runErr := do(ctx, func() {
		if b, err := sample(); err == nil {
			before = b
		}
		start = time.Now()
	})
	wall := time.Since(start)
	after, err := sample()
	if err != nil {
		return run{Error: err.Error()}
	}
	r := run{Walls: wall.Seconds(), Bytes: tr.bytes, Calls: tr.calls, SHA256OK: runErr == nil, CPUFrom: "schedstat"}
	for i := range pids {
		cpu, user, sys, from := cpuUsed(before[i], after[i])
		r.CPUs += cpu
		r.Users += user
		r.Syss += sys
		if from != "schedstat" {
			r.CPUFrom = from
		}
		if len(pids) > 1 {
			r.Hops = append(r.Hops, hopRun{Name: hops[i].name, CPUs: cpu})
		}
	}
	if runErr != nil {
		r.Error = runErr.Error()
	}
	if len(tr.latencies) > 0 {
		slices.Sort(tr.latencies)
		r.P50us, r.P99us = percentile(tr.latencies, 50), percentile(tr.latencies, 99)
	}
	return r
}

// hopsCPU formats a chain run's CPU per hop for the log ("" for one
// process).
func hopsCPU(hops []hopRun) string {
	var b strings.Builder
	for _, h := range hops {
		fmt.Fprintf(&b, " %s %.3fs", h.Name, h.CPUs)
	}
	if b.Len() == 0 {
		return ""
	}
	return " (" + strings.TrimSpace(b.String()) + ")"
}

// summarize fills a result's spreads and checks its data path: the exact
// bytes every run, and kernel TLS exactly where the contender claims it.
func summarize(r *result, c contender) {
	var cpuPerGiB, gibPerS, callsPerCPU, p50, p99 []float64
	for _, run := range r.Runs {
		if !run.SHA256OK {
			r.Errors = append(r.Errors, "run: "+run.Error)
			continue
		}
		cpuPerGiB = append(cpuPerGiB, run.CPUs*gib/float64(run.Bytes))
		gibPerS = append(gibPerS, float64(run.Bytes)/gib/run.Walls)
		if run.Calls > 0 {
			p50, p99 = append(p50, run.P50us), append(p99, run.P99us)
			if run.CPUs > 0 {
				callsPerCPU = append(callsPerCPU, float64(run.Calls)/run.CPUs)
			}
		}
	}
	r.CPUPerGiB, r.GiBPerS = spreadOf(cpuPerGiB), spreadOf(gibPerS)
	r.Hops = hopResults(r.Runs)
	if len(p50) > 0 {
		cs := spreadOf(callsPerCPU)
		r.CallsPerCPUs = &cs
		r.P50us, r.P99us = spreadOf(p50).Median, spreadOf(p99).Median
	}
	r.Offload = offloadOf(r, c)
	if c.zeroCopy && r.Structural != nil {
		if e := zeroCopyError(r.Structural, c.dialKind != "plain", max(c.alertSockets, 1)); e != "" {
			r.Errors = append(r.Errors, e)
		}
	}
}

// hopResults are a chain's per-process spreads over its good runs (nil for
// one process).
func hopResults(runs []run) []hopResult {
	var names []string
	var cpu, calls [][]float64
	for _, run := range runs {
		if !run.SHA256OK || len(run.Hops) == 0 {
			continue
		}
		if names == nil {
			names = make([]string, len(run.Hops))
			cpu, calls = make([][]float64, len(run.Hops)), make([][]float64, len(run.Hops))
		}
		for i, h := range run.Hops {
			names[i] = h.Name
			cpu[i] = append(cpu[i], h.CPUs*gib/float64(run.Bytes))
			if run.Calls > 0 && h.CPUs > 0 {
				calls[i] = append(calls[i], float64(run.Calls)/h.CPUs)
			}
		}
	}
	var out []hopResult
	for i, name := range names {
		h := hopResult{Name: name, CPUPerGiB: spreadOf(cpu[i])}
		if len(calls[i]) > 0 {
			cs := spreadOf(calls[i])
			h.CallsPerCPUs = &cs
		}
		out = append(out, h)
	}
	return out
}

// alertBytesPerTunnel is what a TLS tunnel's forwarder moves through
// userspace after its key install besides the preamble: a close_notify each
// way (2 bytes each), which kernel TLS hands over out of band (recvmsg and
// sendmsg with the record type).
const alertBytesPerTunnel = 2 * 2

// zeroCopyError checks a zero-copy contender's traced pass: after the
// handshakes, the only bytes its forwarder may move through userspace are
// the preambles' and the alerts'; a payload byte there is a copy.
//
// sockets is how many kTLS sockets per tunnel the traced process has (an
// edge gateway: the user's and the forwarder's), each with its alerts.
func zeroCopyError(s *structural, tls bool, sockets int) string {
	var alerts int64
	if tls {
		alerts = alertBytesPerTunnel * int64(sockets)
	}
	if limit := s.Tunnels * int64(sockets) * maxControlBytesPerSocket; s.ControlRecordBytes > limit {
		return fmt.Sprintf("zero copy: %d control-record bytes read by recvmsg after the key installs, want at most %d (%d tunnels × %d sockets × %d)",
			s.ControlRecordBytes, limit, s.Tunnels, sockets, maxControlBytesPerSocket)
	}
	allowed := s.PreambleBytes + s.Tunnels*alerts
	moved := s.UserspaceBytes - s.PreOffloadBytes - s.ControlRecordBytes
	if moved <= allowed {
		return ""
	}
	return fmt.Sprintf("zero copy: %d bytes through the forwarder's userspace after the key installs (%d in all, %d before them, %d control records read by recvmsg) while it moved %d payload bytes, want at most %d (%d preamble bytes + %d tunnels × %d alert bytes)",
		moved, s.UserspaceBytes, s.PreOffloadBytes, s.ControlRecordBytes, s.Bytes, allowed, s.PreambleBytes, s.Tunnels, alerts)
}

// maxControlBytesPerSocket bounds the control records one kTLS socket of a
// tunnel may read in userspace: one record's plaintext (a TLS 1.3 server's
// session ticket to a resuming client, which carries the client's
// certificate, is about 1 KiB; an alert 2 bytes). More is payload read
// through recvmsg.
const maxControlBytesPerSocket = 16 << 10

// offloadOf says which data path the kernel's counters show and records a
// mismatch with the contender's claim as an error.
func offloadOf(r *result, c contender) string {
	if c.dialKind == "plain" {
		return "no TLS (plain TCP)"
	}
	if r.TLSStat == nil {
		return "userspace (this kernel has no /proc/net/tls_stat)"
	}
	tx, rx := r.TLSStat["TlsTxSw"]+r.TLSStat["TlsTxDevice"]-r.GatewayTX, r.TLSStat["TlsRxSw"]+r.TLSStat["TlsRxDevice"]
	for k, v := range r.TLSStat {
		if strings.Contains(k, "Error") && v != 0 {
			r.Errors = append(r.Errors, fmt.Sprintf("tls_stat %s +%d", k, v))
		}
	}
	tunnels := r.Tunnels
	if c.chain != nil {
		tunnels = r.UpstreamConns
	}
	r.Errors = append(r.Errors, keyInstallErrors(c, tx+r.keyless, rx+r.keyless, tunnels)...)
	where := map[bool]string{true: "kernel", false: "userspace"}
	if c.chain != nil && tunnels == 0 && (c.kernelTX || c.kernelRX) {
		return fmt.Sprintf("TX %s, RX %s on tunnels pooled before the cell (none opened in it; their key installs were checked where they opened)",
			where[c.kernelTX], where[c.kernelRX])
	}
	return fmt.Sprintf("TX %s, RX %s (tls_stat TlsTxSw %+d, TlsRxSw %+d over the cell's connections)", where[tx > 0], where[rx > 0], tx, rx)
}

// keyInstallErrors checks a cell's kernel key installs (tls_stat, the
// gateway's own left out) against the contender's claim: in a kernel
// direction one per tunnel at least, in a userspace direction none.
//
// A chain's L7 gateway pools its tunnels, so a cell may open none: then it
// installs no key, and the tunnels it used were checked in the cell (or
// the warm-up) that opened them.
//
// A chain counts its tunnels at the upstream (one connection per forwarder
// tunnel) and installs c.keySockets keys per tunnel in each kernel
// direction: l4-l4 the gateway's user socket, its forwarder socket and the
// forwarder's; l7-l4 the last two.
func keyInstallErrors(c contender, tx, rx, tunnels int64) []string {
	per := int64(max(c.keySockets, 1))
	var errs []string
	for _, d := range []struct {
		name     string
		installs int64
		kernel   bool
	}{{"TX", tx, c.kernelTX}, {"RX", rx, c.kernelRX}} {
		switch {
		case d.kernel && (d.installs < per*tunnels || (d.installs == 0 && (c.chain == nil || tunnels > 0))):
			errs = append(errs, fmt.Sprintf("data path: tls_stat %s +%d key installs for %d tunnels, want %d per tunnel (kernel %s)", d.name, d.installs, tunnels, per, d.name))
		case !d.kernel && d.installs != 0:
			errs = append(errs, fmt.Sprintf("data path: tls_stat %s +%d key installs, want none (%s in userspace)", d.name, d.installs, d.name))
		}
	}
	return errs
}

// chainNote is the report's note on the edge-gateway chains.
const chainNote = "chains (l7-l7, l7-l4, l4-l4; issue 19): the bench's client is the user (TLS 1.3 with the pinned suite, no client certificate, no preamble) and the contender is two Caddy processes, the gateway (on the address the client dials) and the hop behind it (forwarder: this project's ktls+sandbox for l7-l4 and l4-l4; for l7-l7 a dataplane Caddy reverse_proxy with mutual TLS), which reach the app (the upstream's HTTP listener; its raw one for l4-l4). The gateway dials the second hop over mutual TLS with its client certificate (Go's default TLS 1.3 suite and key exchange there, not pinned), HTTP/1.1 on L7 hops, a signed channel-bound preamble per tunnel on the sandbox paths. cpu_s is the sum of both processes; hops[] has each one's share (run.hops, result.hops). The key-install check counts the tunnels as the upstream's accepted connections (upstream_conns; one per forwarder tunnel) and wants keySockets installs per tunnel in each direction: l4-l4 3 (the gateway's user socket, its forwarder socket, the forwarder's), l7-l4 2 (the gateway's forwarder socket, the forwarder's), l7-l7 none. The structural passes trace the gateway process; l4-l4's zero-copy check allows its preambles (one frame per tunnel) and a close_notify each way on each of its two kTLS sockets."

func notes(mode string, gatewayKTLS, peersMTLS bool) []string {
	n := []string{
		"cpu_s: user+system CPU of the forwarder process (all its threads; every contender is one process but the chains, below, whose processes are summed) while one run of the shape ran; from the sum of /proc/<pid>/task/*/schedstat run times (ns) when no thread exited during the run (cpu_source schedstat), else /proc/<pid>/stat utime+stime (10 ms ticks, cpu_source stat). user_s/sys_s always come from the ticks. CPU pass: no tracing.",
		"cpu_s_per_gib: cpu_s scaled to one GiB of payload (both directions of a small call count). The overhead above the crypto floor is ktls minus floor-ktls in the same run.",
		"structural: two separate passes at params.structural_bytes / structural_calls: one with strace attached to the forwarder (see structural.source; syscalls_per_gib, data_syscalls_per_gib and userspace_bytes_per_gib scale its exact counts to one GiB; tracing slows the forwarder, so only counts come from it), and one untraced, with the forwarder's syscalls counted in the kernel (structural.untraced_source; untraced_syscalls_per_gib and untraced_syscalls_per_call, or untraced_error where the kernel offers no counter).",
		"small shapes: p50_us/p99_us are per-call latencies measured by the gateway (median over runs). small-reuse measures calls on established connections: each connection is opened and makes one uncounted call first (handshake, preamble, the forwarder's dial), and CPU and latencies are taken from when all are open; its structural passes count the setup too. small-per-call latencies include the TCP connect and the full TLS 1.3 handshake (no resumption); small-per-call-resumed is the same with a gateway that keeps a TLS session cache, so a handshake can resume a session the contender issued before (the shape's first run makes one uncounted call first, which fills the cache, so every measured handshake can resume; resumed counts those that did, over every pass of the shape: a contender that issues no session tickets does full handshakes there too). calls_per_cpu_s = calls / forwarder cpu_s.",
		"Every contender terminates TLS 1.3 with TLS_AES_128_GCM_SHA256 and X25519 (checked on every connection) with the same ECDSA P-256 certificate; floor-plain speaks plain TCP. ktls* contenders also require and verify the gateway's client certificate (mutual TLS, ECDSA P-256: two more signature verifications per full handshake) and verify a signed, channel-bound preamble per connection; the others authenticate no client.",
		"offload: TX/RX placement from /proc/net/tls_stat deltas over the cell (TlsTxSw/TlsRxSw count sockets that installed a kernel key); a contender on the wrong path fails the run, and so does a kernel direction with fewer key installs than the cell's tunnels.",
		"zero copy: " + strings.Join(zeroCopyNames(), ", ") + " splice both ways, so in their traced pass the bytes their forwarder moves through userspace after its key installs (structural.userspace_bytes minus pre_offload_bytes, the handshakes) must be at most the preambles' (preamble_bytes) and a 2-byte close_notify each way per TLS tunnel; more fails the cell.",
		"payload: a stream without a period (splitmix64; small calls with a seed per tunnel), so a replayed, swapped or misplaced stretch, or another tunnel's bytes, fail; every reader reads to the end of its stream, and an upload's upstream answers the count and SHA-256 of all it received, so an appended byte fails too.",
	}
	if peersMTLS {
		n = append(n, "peers_mtls: l4-proxy, reverse-proxy, haproxy and nginx also require and verify the gateway's client certificate (mutual TLS, the same CA and certificate the ktls contenders verify); a cell whose server never asked the gateway for its certificate fails. The floors authenticate no client.")
	}
	if gatewayKTLS {
		n = append(n, "gateway_ktls: the gateway seals its records in its own kernel (kTLS TX; RX stays in crypto/tls), so one write of a MiB hands its kernel 64 records at once, where crypto/tls writes each record on its own; a receiver then finds several records per wake-up. The gateway's own TX keys (gateway_tx) are left out of the offload check.")
	}
	switch mode {
	case "vm-icount":
		n = append(n, "mode vm-icount: qemu TCG, one vCPU, -icount shift=0: guest time counts executed instructions (1 ns each), so CPU and wall figures are a deterministic cost model, not real time; gib_per_s is informational.")
	case "native":
		n = append(n, "mode native: real hardware and wall-clock time; figures vary with host load.")
	}
	return n
}

func printTable(rep *report) {
	fmt.Printf("%-14s %-15s %12s %8s %10s %14s %16s %10s %10s  %s\n", "contender", "shape", "cpu_s/GiB", "spread%", "GiB/s", "syscalls/GiB", "userspace B/GiB", "p50_us", "p99_us", "offload")
	for _, r := range rep.Results {
		var sc, ub float64
		if r.Structural != nil {
			sc, ub = r.Structural.SyscallsPerGiB, r.Structural.UserspaceBytesPerGiB
		}
		status := r.Offload
		if len(r.Errors) > 0 {
			status = "FAIL: " + strings.Join(r.Errors, "; ")
		}
		fmt.Printf("%-14s %-15s %12.3f %8.1f %10.4f %14.0f %16.0f %10.0f %10.0f  %s\n", r.Contender, r.Shape,
			r.CPUPerGiB.Median, r.CPUPerGiB.SpreadPct, r.GiBPerS.Median, sc, ub, r.P50us, r.P99us, status)
	}
	for _, s := range rep.Skipped {
		fmt.Printf("%-14s REFUSED: %s\n", s.Contender, s.Reason)
	}
}

// freeAddr picks a loopback port for the next contender (freeAddrOn).
func freeAddr() string { return freeAddrOn(netip.AddrFrom4([4]byte{127, 0, 0, 1})) }

// freeAddrOn picks a port on addr for the next contender: a fresh one each
// (no TIME_WAIT or lingering listener of an earlier contender in the way),
// outside the ephemeral range, so that no connection made before the
// contender binds it (the readiness dials, the hop behind it starting)
// takes it as its local port (internal/freeport).
func freeAddrOn(addr netip.Addr) string {
	a, err := freeport.Addr(addr)
	if err != nil {
		log.Fatal(err)
	}
	return a.String()
}

func waitListening(addr string, exited <-chan struct{}) error {
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return errors.New("exited before listening")
		default:
		}
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("not listening on %s after 2m", addr)
}

// process is one running process of a contender.
type process struct {
	name, log string
	cmd       *exec.Cmd
	logFile   *os.File
	// exited is closed when the process has ended.
	exited chan struct{}
}

// startProcess starts h with its output in logName.
func startProcess(h hop, logName string) (*process, error) {
	f, err := os.Create(logName)
	if err != nil {
		return nil, err
	}
	h.cmd.Stdout, h.cmd.Stderr = f, f
	if err := h.cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", h.name, err)
	}
	p := &process{name: h.name, log: logName, cmd: h.cmd, logFile: f, exited: make(chan struct{})}
	go func() { h.cmd.Wait(); close(p.exited) }()
	return p, nil
}

// stop ends a process: SIGTERM, then SIGKILL after 15 s.
func (p *process) stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(15 * time.Second):
		p.cmd.Process.Kill()
		<-p.exited
	}
	p.logFile.Close()
}

func tail(file string) string {
	b, _ := os.ReadFile(file)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

func utsString(b []int8) string {
	s := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(bytes.TrimSpace(s))
}
