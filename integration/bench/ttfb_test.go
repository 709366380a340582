package main

import (
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// -rtts takes positive durations, each once, whose halves (netem's delay
// each way) are whole microseconds.
func TestParseRTTs(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []time.Duration
	}{
		{"1ms,20ms", []time.Duration{time.Millisecond, 20 * time.Millisecond}},
		{" 20ms , 1ms ,", []time.Duration{20 * time.Millisecond, time.Millisecond}},
		{"2us", []time.Duration{2 * time.Microsecond}},
		{"1.5ms", []time.Duration{1500 * time.Microsecond}},
	} {
		got, err := parseRTTs(c.in)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("parseRTTs(%q) = %v, %v; want %v", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{"", ",", "0", "0ms", "-1ms", "1ms,1ms", "1ms,1000us", "20", "fast", "3us", "1001ns"} {
		if got, err := parseRTTs(in); err == nil {
			t.Errorf("parseRTTs(%q) = %v, want an error", in, got)
		}
	}
}

// The forwarder's address is an IPv4 loopback address of its own: not
// 127.0.0.1, which the paths that must not be delayed use.
func TestForwarderAddr(t *testing.T) {
	for _, ok := range []string{"127.0.0.2", "127.1.2.3"} {
		if a, err := forwarderAddr(ok); err != nil || a.String() != ok {
			t.Errorf("forwarderAddr(%q) = %v, %v", ok, a, err)
		}
	}
	for _, bad := range []string{"127.0.0.1", "::1", "10.0.0.2", "192.0.2.1", "localhost", ""} {
		if a, err := forwarderAddr(bad); err == nil {
			t.Errorf("forwarderAddr(%q) = %v, want an error", bad, a)
		}
	}
}

// A nearest-rank percentile is the smallest sample with at least p % of
// the samples at or below it, whatever their order; the input is left as
// it was.
func TestNearestRank(t *testing.T) {
	xs := []float64{7, 3, 10, 1, 5, 9, 2, 8, 4, 6}
	orig := slices.Clone(xs)
	for _, c := range []struct{ p, want float64 }{{0, 1}, {10, 1}, {11, 2}, {50, 5}, {90, 9}, {91, 10}, {99, 10}, {100, 10}} {
		if got := nearestRank(xs, c.p); got != c.want {
			t.Errorf("nearestRank(p%g) = %g, want %g", c.p, got, c.want)
		}
	}
	if !slices.Equal(xs, orig) {
		t.Errorf("nearestRank reordered its input: %v", xs)
	}
	if got := nearestRank([]float64{4.5}, 99); got != 4.5 {
		t.Errorf("nearestRank of one sample = %g, want it", got)
	}
	if got := nearestRank(nil, 50); got != 0 {
		t.Errorf("nearestRank of none = %g, want 0", got)
	}
}

// The delay: a prio qdisc that sends everything to its first band, netem
// of half the RTT on the third, and the packets to and from the
// forwarder's address, only they, filtered to that band.
func TestNetemCommands(t *testing.T) {
	zeros := strings.TrimSpace(strings.Repeat(" 0", 16))
	want := []string{
		"qdisc add dev lo root handle 1: prio bands 3 priomap " + zeros,
		"qdisc add dev lo parent 1:3 handle 30: netem delay 10000us limit 10000",
		"filter add dev lo parent 1: protocol ip prio 1 u32 match ip dst 127.0.0.2/32 flowid 1:3",
		"filter add dev lo parent 1: protocol ip prio 2 u32 match ip src 127.0.0.2/32 flowid 1:3",
	}
	var got []string
	for _, c := range netemCommands("lo", netip.MustParseAddr("127.0.0.2"), 20*time.Millisecond) {
		got = append(got, strings.Join(c, " "))
	}
	if !slices.Equal(got, want) {
		t.Errorf("netemCommands at 20ms:\n got  %q\n want %q", got, want)
	}
	for _, c := range []struct {
		rtt  time.Duration
		each string
	}{{time.Millisecond, "500us"}, {1500 * time.Microsecond, "750us"}, {2 * time.Microsecond, "1us"}} {
		cmds := netemCommands("eth1", netip.MustParseAddr("127.0.0.9"), c.rtt)
		netem := strings.Join(cmds[1], " ")
		if netem != "qdisc add dev eth1 parent 1:3 handle 30: netem delay "+c.each+" limit 10000" {
			t.Errorf("at %v: %q, want a delay of %s each way", c.rtt, netem, c.each)
		}
		if !strings.Contains(strings.Join(cmds[2], " "), "match ip dst 127.0.0.9/32 flowid 1:3") ||
			!strings.Contains(strings.Join(cmds[3], " "), "match ip src 127.0.0.9/32 flowid 1:3") {
			t.Errorf("at %v the filters do not match the address both ways: %q", c.rtt, cmds[2:])
		}
	}
	if got := strings.Join(netemRemove("lo"), " "); got != "qdisc del dev lo root" {
		t.Errorf("netemRemove = %q", got)
	}
}

// The path check's band: ±rel of the RTT asked, ±ms more, not below 0.
func TestPathBand(t *testing.T) {
	for _, c := range []struct {
		rtt       time.Duration
		rel, ms   float64
		low, high float64
	}{
		{20 * time.Millisecond, 0.3, 0.5, 13.5, 26.5},
		{time.Millisecond, 0.3, 0.5, 0.2, 1.8},
		{100 * time.Microsecond, 0.3, 0.5, 0, 0.63},
		{20 * time.Millisecond, 0.3, 5, 9, 31},
		{20 * time.Millisecond, 0, 0, 20, 20},
	} {
		if low, high := pathBand(c.rtt, c.rel, c.ms); low != c.low || high != c.high {
			t.Errorf("pathBand(%v, %g, %g) = %g–%g, want %g–%g", c.rtt, c.rel, c.ms, low, high, c.low, c.high)
		}
	}
}

// The counters are the netem qdisc's, from tc's JSON, which must show
// exactly one.
func TestParseNetemCounters(t *testing.T) {
	const shown = `[{"kind":"prio","handle":"1:","root":true,"refcnt":2,"options":{"bands":3,"priomap":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],"multiqueue":false},"bytes":90210,"packets":300,"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0},` +
		`{"kind":"pfifo","handle":"8001:","parent":"1:1","options":{"limit":1000},"bytes":80000,"packets":250,"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0},` +
		`{"kind":"netem","handle":"30:","parent":"1:3","options":{"limit":10000,"delay":{"delay":0.01,"jitter":0,"correlation":0},"ecn":false,"gap":0},"bytes":10210,"packets":50,"drops":2,"overlimits":0,"requeues":0,"backlog":0,"qlen":0}]`
	packets, drops, err := parseNetemCounters([]byte(shown))
	if err != nil || packets != 50 || drops != 2 {
		t.Errorf("parseNetemCounters = %d packets, %d drops, %v; want 50, 2", packets, drops, err)
	}
	for _, bad := range []string{`[{"kind":"noqueue","handle":"0:","packets":9}]`, `[{"kind":"netem","packets":1},{"kind":"netem","packets":2}]`, `not json`} {
		if _, _, err := parseNetemCounters([]byte(bad)); err == nil {
			t.Errorf("parseNetemCounters(%s): no error", bad)
		}
	}
}

// /proc/net/tcp as the kernel writes it: addresses in the host's byte
// order (little endian), ports and states in hex.
func TestParseProcNetTCP(t *testing.T) {
	const table = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0200007F:9C4D 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
   1: 0100007F:D431 0200007F:9C4D 01 00000000:00000000 00:00000000 00000000     0        0 1002 1 0000000000000000 20 4 30 10 -1
   2: 0200007F:9C4D 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0000000000000000 20 4 30 10 -1
`
	socks, err := parseProcNetTCP([]byte(table))
	if err != nil {
		t.Fatal(err)
	}
	want := []tcpSocket{
		{netip.MustParseAddrPort("127.0.0.2:40013"), netip.MustParseAddrPort("0.0.0.0:0"), 0x0a},
		{netip.MustParseAddrPort("127.0.0.1:54321"), netip.MustParseAddrPort("127.0.0.2:40013"), tcpEstablished},
		{netip.MustParseAddrPort("127.0.0.2:40013"), netip.MustParseAddrPort("127.0.0.1:54321"), tcpEstablished},
	}
	if !slices.Equal(socks, want) {
		t.Errorf("parseProcNetTCP:\n got  %v\n want %v", socks, want)
	}
	fwd, other := netip.MustParseAddrPort("127.0.0.2:40013"), netip.MustParseAddrPort("127.0.0.2:49153")
	n, err := checkForwarderSockets([]byte(table), []netip.AddrPort{fwd, other})
	if err != nil || n[fwd] != 1 || n[other] != 0 || len(n) != 1 {
		t.Errorf("checkForwarderSockets = %v, %v; want 1 connection at %s, none elsewhere, no error", n, err, fwd)
	}
	// A connection from the forwarders' address to elsewhere (the
	// upstream on 127.0.0.1:8080) would be delayed too.
	stray := table + "   3: 0200007F:C001 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 1004 1 0000000000000000 20 4 30 10 -1\n"
	if _, err := checkForwarderSockets([]byte(stray), []netip.AddrPort{fwd}); err == nil {
		t.Error("a connection 127.0.0.2:49153 → 127.0.0.1:8080 passed the check")
	}
	// Unless 127.0.0.2:49153 is a forwarder's listener too.
	if n, err := checkForwarderSockets([]byte(stray), []netip.AddrPort{fwd, other}); err != nil || n[fwd] != 1 || n[other] != 1 {
		t.Errorf("with two forwarders: %v, %v; want a connection at each", n, err)
	}
	// One that is not established (TIME_WAIT, 06) holds nothing up.
	closed := table + "   3: 0200007F:C001 0100007F:1F90 06 00000000:00000000 00:00000000 00000000     0        0 1004 1 0000000000000000 20 4 30 10 -1\n"
	if _, err := checkForwarderSockets([]byte(closed), []netip.AddrPort{fwd}); err != nil {
		t.Errorf("a closed connection failed the check: %v", err)
	}
	for _, bad := range []string{"", "0: 0100007F:0050 0100007F:0051 01\n", "sl local\n 0: 7F000001 0100007F:0051 01\n", "sl local\n 0: 0100007F:0050 0100007F:0051 zz\n"} {
		if _, err := parseProcNetTCP([]byte(bad)); err == nil {
			t.Errorf("parseProcNetTCP(%q): no error", bad)
		}
	}
}

// On this kernel, a connection to the forwarder's address leaves from
// 127.0.0.1 (the loopback route's source), so the check counts it at the
// forwarder's listener; one that leaves from the forwarder's address to
// 127.0.0.1 fails the check. The address stands for the bench's
// forwarders' 127.0.0.2, on the same loopback route: /proc/net/tcp lists
// every process's sockets, and other packages' tests, run beside this one,
// hold connections on 127.0.0.2 that the check would rightly fail.
func TestCheckForwarderSocketsOnThisKernel(t *testing.T) {
	if _, err := os.Stat("/proc/net/tcp"); err != nil {
		t.Skipf("SKIP: no /proc/net/tcp: %v", err)
	}
	fwdAddr := netip.MustParseAddr("127.0.0.77")
	ln, err := net.Listen("tcp", netip.AddrPortFrom(fwdAddr, 0).String())
	if err != nil {
		t.Skipf("SKIP: no %s on this host's loopback: %v", fwdAddr, err)
	}
	defer ln.Close()
	fwd := netip.MustParseAddrPort(ln.Addr().String())
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if from := netip.MustParseAddrPort(c.LocalAddr().String()).Addr(); from == fwdAddr {
		t.Fatalf("a connection to %s left from %s", fwd, from)
	}
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	if n, err := checkForwarderSockets(data, []netip.AddrPort{fwd}); err != nil || n[fwd] != 1 {
		t.Fatalf("with one connection to the forwarder: %v connections, %v", n, err)
	}

	up, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(fwdAddr, 0))}
	stray, err := d.Dial("tcp", up.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer stray.Close()
	if data, err = os.ReadFile("/proc/net/tcp"); err != nil {
		t.Fatal(err)
	}
	if _, err := checkForwarderSockets(data, []netip.AddrPort{fwd}); err == nil {
		t.Errorf("a connection %s → %s passed the check", stray.LocalAddr(), stray.RemoteAddr())
	}
}

// A probe connect completes against a listener and fails, not hangs,
// where nothing listens.
func TestConnectTime(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := netip.MustParseAddrPort(ln.Addr().String())
	if d, err := connectTime(addr); err != nil || d <= 0 {
		t.Errorf("connectTime(%s) = %v, %v; want a connect", addr, d, err)
	}
	if c, err := ln.Accept(); err != nil {
		t.Errorf("the listener accepted no probe: %v", err)
	} else {
		c.Close()
	}
	ln.Close()
	if d, err := connectTime(addr); err == nil {
		t.Errorf("connectTime(%s) after its listener closed = %v, want an error", addr, d)
	}
}

// Over as many rounds as there are chains, each chain comes at each place
// of a round once, and every round has each chain once.
func TestTTFBOrder(t *testing.T) {
	for _, n := range []int{1, 2, 3, 4} {
		at := make([]map[int]int, n) // place -> chain -> rounds
		for i := range at {
			at[i] = map[int]int{}
		}
		for round := range n {
			order := ttfbOrder(round, n)
			seen := map[int]bool{}
			for place, c := range order {
				if c < 0 || c >= n || seen[c] {
					t.Fatalf("%d chains, round %d: order %v", n, round, order)
				}
				seen[c] = true
				at[place][c]++
			}
		}
		for place := range at {
			for c := range n {
				if at[place][c] != 1 {
					t.Errorf("%d chains: chain %d at place %d in %d of %d rounds, want 1", n, c, place, at[place][c], n)
				}
			}
		}
	}
}

// The quiet after a connection leaves a standby refill (2 RTT) room.
func TestTTFBPause(t *testing.T) {
	if got := ttfbPause(250*time.Millisecond, 20*time.Millisecond); got != 310*time.Millisecond {
		t.Errorf("ttfbPause(250ms, 20ms) = %v, want 310ms", got)
	}
	if got := ttfbPause(0, 100*time.Millisecond); got != 300*time.Millisecond {
		t.Errorf("ttfbPause(0, 100ms) = %v, want 300ms", got)
	}
}
