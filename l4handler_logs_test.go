package caddyktls

import (
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
)

// TestL4HandlerKernelLine: the layer4 ktls handler says once per config
// load, at start, what this kernel does for its connections and, where it
// cannot offload, why and what to do: one line for a configuration with two
// ktls handlers (two layer4 servers), one more for a reload, none for a
// connection. On a host without kTLS no connection adds a WARN of the
// handler's own.
func TestL4HandlerKernelLine(t *testing.T) {
	kernel := kerneltest.Available() == nil
	msg := offload.KernelUnavailableMsg
	if kernel {
		msg = offload.KernelAvailableMsg
	}
	e := newSandboxConfig(t, nil)
	servers := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)
	second := map[string]any{}
	for k, v := range servers["tunnels"].(map[string]any) {
		second[k] = v
	}
	second["listen"] = []string{loopbackAddr(t)}
	servers["second"] = second
	e.start(t)

	lines := e.logLines(t, msg)
	if len(lines) != 1 {
		t.Fatalf("%d %q lines for one load with two ktls handlers, want 1", len(lines), msg)
	}
	l := lines[0]
	if l["logger"] != moduleid.L4Handler || l["level"] != "info" || l["kernel"] == nil {
		t.Errorf("start line %v: want INFO from %s naming the kernel", l, moduleid.L4Handler)
	}
	if kernel {
		if l["offloaded"] != true || l["rx_in_kernel"] != true || l["suites"] == nil {
			t.Errorf("start line %v: want offloaded, RX in the kernel and the suites", l)
		}
	} else if fix, _ := l["fix"].(string); l["offloaded"] != false || l["why"] == nil || l["rx_in_kernel"] != nil || !strings.Contains(fix, "modprobe tls") && !strings.Contains(fix, "CONFIG_TLS") {
		t.Errorf("start line %v: want offloaded false, why, no rx_in_kernel, and a fix (modprobe tls or the kernel's CONFIG_TLS)", l)
	}

	// Connections: offloaded or not, none logs a line of this kind, nor a
	// WARN of the handler's own.
	up := forwardtest.NewUpstream(t, 0)
	for range 3 {
		c := e.dial(t, "sbx", up.Addr())
		c.Close()
	}
	e.load(t) // a reload
	if n := len(e.logLines(t, msg)); n != 2 {
		t.Errorf("%d %q lines after three connections and a reload, want 2 (one per load)", n, msg)
	}
	data, err := os.ReadFile(e.logFile)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(data)) {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["logger"] == moduleid.L4Handler && m["level"] == "warn" {
			t.Errorf("a WARN of the ktls handler: %v", m)
		}
	}
}
