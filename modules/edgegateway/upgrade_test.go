package edgegateway

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// withProxies makes list the process's registered sandbox_proxy handlers
// for the test.
func withProxies(t *testing.T, list ...*Proxy) {
	t.Helper()
	proxies.mu.Lock()
	saved, savedRetired, savedDrain := proxies.list, proxies.retired, proxies.exitDrain
	proxies.list, proxies.retired, proxies.exitDrain = list, nil, nil
	proxies.mu.Unlock()
	t.Cleanup(func() {
		proxies.mu.Lock()
		proxies.list, proxies.retired, proxies.exitDrain = saved, savedRetired, savedDrain
		proxies.mu.Unlock()
	})
}

// testProxy is a provisioned-enough handler: a Dialer named name, its
// logs observed.
func testProxy(t *testing.T, name string) (*Proxy, *observer.ObservedLogs) {
	t.Helper()
	ca := testpki.NewCA(t, "gateway-ca")
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := preamble.NewSigner("gw-1", key)
	if err != nil {
		t.Fatal(err)
	}
	d, err := gateway.New(gateway.Config{TLS: &tls.Config{Certificates: []tls.Certificate{ca.Client(t, "gw").TLS}}, Signer: signer, MoveName: name})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	core, logs := observer.New(zapcore.DebugLevel)
	return &Proxy{dialer: d, moveName: name, logger: zap.New(core)}, logs
}

// The gateway participant is registered for the gateway's tunnels, which
// are counted as tunnels and named in the handoff's logs.
func TestGatewayParticipantRegistered(t *testing.T) {
	p, ok := upgrade.ForKind(handoff.KindGatewayTunnel)
	if !ok || p.Name != "gateway" || p.Move == nil || p.Adopt == nil || !p.Tunnels {
		t.Fatalf("upgrade.ForKind(KindGatewayTunnel) = %+v, %v; want the gateway participant, its objects tunnels", p, ok)
	}
	if p.MovedField != "gateway_moved" || p.StayedField != "gateway_stayed" || p.AdoptedField != "gateway_tunnels" || p.StayKey != "tunnel" {
		t.Errorf("log fields %q %q %q %q, want gateway_moved, gateway_stayed, gateway_tunnels and tunnel", p.MovedField, p.StayedField, p.AdoptedField, p.StayKey)
	}
	if _, ok := upgrade.ForKind(handoff.KindTunnel); ok {
		t.Error("the edge gateway's package adopts the forwarder's tunnels")
	}
}

// A handler's move name is its configuration's digest: the same for the
// same configuration, another for another.
func TestProxyMoveName(t *testing.T) {
	a := &Proxy{Forwarder: "{l4.tls.server_name}:8443", Sandbox: "{l4.tls.server_name.labels.2}", Target: "10.0.0.1:80"}
	b := *a
	c := *a
	c.Target = "10.0.0.2:80"
	na, _ := moveNameOf(a)
	nb, _ := moveNameOf(&b)
	nc, _ := moveNameOf(&c)
	if len(na) != 64 || na != nb || na == nc {
		t.Errorf("move names %q, %q (same configuration), %q (another); want one SHA-256 for the same, another for another", na, nb, nc)
	}
}

// A moved tunnel goes to the handler of its name, else to the only one,
// else it is refused; the descriptors stay the caller's.
func TestProxyAdoptDispatch(t *testing.T) {
	one, _ := testProxy(t, "one")
	two, _ := testProxy(t, "two")
	for _, c := range []struct {
		name string
		list []*Proxy
		dial string
		want *Proxy
	}{
		{"by name", []*Proxy{one, two}, "two", two},
		{"by name, first", []*Proxy{one, two}, "one", one},
		{"the only one, another name", []*Proxy{one}, "elsewhere", one},
		{"the only one, unnamed", []*Proxy{two}, "", two},
		{"none of that name among two", []*Proxy{one, two}, "elsewhere", nil},
		{"unnamed among two", []*Proxy{one, two}, "", nil},
		{"no handler", nil, "one", nil},
	} {
		withProxies(t, c.list...)
		got, n := proxies.handlerFor(c.dial)
		if got != c.want || n != len(c.list) {
			t.Errorf("%s: handlerFor(%q) = %p, %d; want %p, %d", c.name, c.dial, got, n, c.want, len(c.list))
		}
	}

	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	withProxies(t, one, two)
	for _, c := range []struct {
		name  string
		state []byte
		want  string
	}{
		{"not a state", []byte("{"), "gateway: moved tunnel version 123"},
		{"no handler of its name", mustEncode(t, gateway.MovedTunnel{Dialer: "elsewhere"}), "2 sandbox_proxy handlers in this configuration, none configured as the one the tunnel ran in"},
		// A state AdoptTunnel refuses: its refusal is the participant's.
		{"the handler's refusal", mustEncode(t, gateway.MovedTunnel{Dialer: "two"}), "the user's session"},
	} {
		run, discard, err := proxies.adopt(c.state, []*os.File{r, w})
		if run != nil || discard != nil || err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: adopt: %v; want a refusal saying %q", c.name, err, c.want)
		}
		for _, f := range []*os.File{r, w} {
			if _, err := f.Stat(); err != nil {
				t.Errorf("%s: a descriptor was closed: %v", c.name, err)
			}
		}
	}
	if one.dialer.Tunnels()+two.dialer.Tunnels() != 0 {
		t.Error("a refused tunnel is carried")
	}
}

func mustEncode(t *testing.T, mt gateway.MovedTunnel) []byte {
	t.Helper()
	b, err := mt.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A handler cleaned up (a reload) adopts nothing, and leaves the registry
// once its Dialer carries no tunnel (until then its tunnels move).
func TestProxyRetired(t *testing.T) {
	one, _ := testProxy(t, "one")
	two, _ := testProxy(t, "two")
	withProxies(t, one)
	proxies.add(two)
	proxies.retire(one)
	if got, n := proxies.handlerFor("one"); got != two || n != 1 {
		t.Errorf("handlerFor(the retired handler's name) = %p, %d; want the only live one %p, 1", got, n, two)
	}
	if all := proxies.snapshot(false); len(all) != 1 || all[0] != two {
		t.Errorf("registered after retiring a handler that carries no tunnel: %v; want only the live one", all)
	}
}

// Moving finds every registered handler's tunnels: with none carried, none
// moves and m is never asked.
func TestProxyMoveNothingCarried(t *testing.T) {
	one, _ := testProxy(t, "one")
	two, _ := testProxy(t, "two")
	withProxies(t, one, two)
	m := &countingMover{}
	if res := proxies.move(t.Context(), m); res.Moved != 0 || len(res.Stays) != 0 || m.offers != 0 {
		t.Errorf("move: %+v, %d offers; want nothing", res, m.offers)
	}
}

type countingMover struct{ offers int }

func (m *countingMover) Move(uint16, []byte, ...syscall.Conn) (bool, error) {
	m.offers++
	return false, nil
}

func (m *countingMover) Window() int { return 1 }

// A tunnel that moved did not end: it is logged at DEBUG as moved, and
// neither its end nor its bytes are counted (the new process counts them
// from the tunnel's start); a tunnel that ended is counted.
func TestProxyTunnelMovedIsNoEnd(t *testing.T) {
	h, logs := testProxy(t, "one")
	route := gateway.Route{Forwarder: "fwd:8443", Sandbox: "sbx", Target: netip.MustParseAddrPort("10.0.0.1:80")}
	where := tunnelFields("192.0.2.1:5555", route)
	var st splice.Stats
	st.AToB.Bytes, st.AToB.SpliceBytes = 100, 100
	ends := func() float64 {
		var sum float64
		for _, e := range []gateway.End{gateway.EndClosed, gateway.EndRefused, gateway.EndFailed} {
			sum += counterValue(GatewayEnds.WithLabelValues(moduleid.SandboxProxy, string(e)))
		}
		return sum
	}
	endsBefore, bytesBefore := ends(), counterValue(gatewayRelayBytes.WithLabelValues(relayPathSplice))
	h.tunnelEnded(where, st, gateway.EndMoved, nil)
	if got := ends() - endsBefore; got != 0 {
		t.Errorf("a moved tunnel counted %v tunnel ends, want 0", got)
	}
	if got := counterValue(gatewayRelayBytes.WithLabelValues(relayPathSplice)) - bytesBefore; got != 0 {
		t.Errorf("a moved tunnel counted %v relayed bytes, want 0", got)
	}
	moved := logs.FilterMessageSnippet("moved to the new process").All()
	if len(moved) != 1 || moved[0].Level != zapcore.DebugLevel || logs.Len() != 1 {
		t.Errorf("logs %+v; want one DEBUG line saying the tunnel moved to the new process", logs.All())
	}

	h.tunnelEnded(where, st, gateway.EndClosed, nil)
	if got := ends() - endsBefore; got != 1 {
		t.Errorf("a closed tunnel counted %v tunnel ends, want 1", got)
	}
	if got := counterValue(gatewayRelayBytes.WithLabelValues(relayPathSplice)) - bytesBefore; got != 100 {
		t.Errorf("a closed tunnel counted %v relayed bytes, want 100", got)
	}
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	c.Write(&m)
	return m.GetCounter().GetValue()
}

// The drain at exit covers every registered handler, the retired ones
// included, once: from it on each handler's Dialer refuses new tunnels,
// and a later handler's Cleanup at exit waits for it rather than drain
// again with its own grace period.
func TestDrainAtExitCoversEveryHandler(t *testing.T) {
	live, liveLogs := testProxy(t, "live")
	retired, _ := testProxy(t, "retired")
	live.DrainGracePeriod = caddy.Duration(time.Hour)
	retired.DrainGracePeriod = caddy.Duration(time.Hour)
	withProxies(t, live, retired)
	proxies.mu.Lock()
	proxies.retired = map[*Proxy]bool{retired: true}
	proxies.mu.Unlock()

	done := make(chan struct{})
	go func() { proxies.drainAtExit(live); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the drain of handlers without tunnels did not return at once")
	}
	second := make(chan struct{})
	go func() { proxies.drainAtExit(retired); close(second) }()
	select {
	case <-second:
	case <-time.After(10 * time.Second):
		t.Fatal("a second handler's drain at exit did not return once the first ended")
	}
	for _, h := range []*Proxy{live, retired} {
		user, peer := net.Pipe()
		peer.Close()
		if _, end, err := h.dialer.Carry(context.Background(), gateway.Route{Forwarder: "127.0.0.1:1", Sandbox: "sbx", Target: netip.MustParseAddrPort("10.0.0.1:80")},
			user, nil, nil); !errors.Is(err, gateway.ErrDraining) || end != "" {
			t.Errorf("handler %s: Carry after the drain at exit: %q, %v; want ErrDraining", h.moveName, end, err)
		} else if r := dialResult(err); r != gatewayDialDraining {
			t.Errorf("a refusal while draining counts as dial result %q, want %q", r, gatewayDialDraining)
		}
	}
	if n := liveLogs.FilterMessageSnippet("draining open tunnels").Len(); n != 0 {
		t.Errorf("%d drain logs with no tunnel open, want none", n)
	}
}
