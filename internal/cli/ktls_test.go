package cli

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

var noULP = ktls.Capabilities{
	Kernel:   "6.18.0-test",
	NetAdmin: true,
	ULP:      fmt.Errorf("setsockopt(TCP_ULP, \"tls\"): %w", unix.ENOENT),
	Config:   ktls.KernelConfig{TLS: ktls.KernelTLSModule, Source: "/boot/config-6.18.0-test"},
}

var fullULP = ktls.Capabilities{
	Kernel:   "7.3.4-test",
	NetAdmin: true,
	Ciphers: []ktls.CipherSupport{
		{Version: tls.VersionTLS13, CipherSuite: tls.TLS_AES_128_GCM_SHA256, Name: "TLS_AES_128_GCM_SHA256", TX: true, RX: true},
		{Version: tls.VersionTLS12, CipherSuite: tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384, Name: "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384", TX: true, RX: false},
	},
	ExpectNoPad:  true,
	TXZeroCopyRO: true,
	Rekey:        true,
}

func decodeReport(t *testing.T, b []byte) ProbeReport {
	t.Helper()
	var r ProbeReport
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("decode probe JSON: %v\n%s", err, b)
	}
	return r
}

func TestWriteProbeUnavailable(t *testing.T) {
	var human bytes.Buffer
	if err := writeProbe(&human, noULP, false); err != nil {
		t.Fatal(err)
	}
	first, rest, _ := strings.Cut(human.String(), "\n")
	wantFirst := `kernel TLS unavailable: setsockopt(TCP_ULP, "tls"): no such file or directory; ` + offload.EnableHint
	if first != wantFirst {
		t.Errorf("first line:\n got %q\nwant %q", first, wantFirst)
	}
	for _, want := range []string{"modprobe tls", "CAP_NET_ADMIN", "/etc/modules-load.d/tls.conf"} {
		if !strings.Contains(first, want) {
			t.Errorf("hint lacks %q: %q", want, first)
		}
	}
	if !strings.Contains(rest, "6.18.0-test") {
		t.Errorf("details lack the kernel release:\n%s", rest)
	}

	var js bytes.Buffer
	if err := writeProbe(&js, noULP, true); err != nil {
		t.Fatal(err)
	}
	got := decodeReport(t, js.Bytes())
	want := ProbeReport{
		Kernel:    "6.18.0-test",
		Available: false,
		ULPError:  `setsockopt(TCP_ULP, "tls"): no such file or directory`,
		Hint:      offload.EnableHint,
		NetAdmin:  true,
		Ciphers:   []ProbeCipher{},

		ConfigTLS:    "m",
		ConfigSource: "/boot/config-6.18.0-test",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("JSON report:\n got %+v\nwant %+v", got, want)
	}
	// An empty list, not null: consumers iterate it without a nil check.
	if !strings.Contains(js.String(), `"ciphers": []`) {
		t.Errorf("ciphers not an empty JSON array:\n%s", js.String())
	}
}

// writeKernelConfig writes a fake kernel build configuration and returns
// what ktls reads from it, as the probe does from /boot/config-$(uname -r).
func writeKernelConfig(t *testing.T, name, body string) ktls.KernelConfig {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return ktls.ReadKernelConfig(p)
}

// TestWriteProbeKernelWithoutTLS: on a kernel built without CONFIG_TLS the
// probe says so, and suggests no modprobe that cannot work; where no
// configuration can be read, it says it could not tell.
func TestWriteProbeKernelWithoutTLS(t *testing.T) {
	caps := noULP
	caps.Config = writeKernelConfig(t, "config-6.18.0-test", "CONFIG_NET=y\n# CONFIG_TLS is not set\n")
	var human bytes.Buffer
	if err := writeProbe(&human, caps, false); err != nil {
		t.Fatal(err)
	}
	first, rest, _ := strings.Cut(human.String(), "\n")
	for _, want := range []string{"kernel TLS unavailable", "built without CONFIG_TLS", caps.Config.Source, "no tls module to load", "CONFIG_TLS=m or =y"} {
		if !strings.Contains(first, want) {
			t.Errorf("verdict lacks %q: %q", want, first)
		}
	}
	if strings.Contains(human.String(), "modprobe") {
		t.Errorf("modprobe suggested for a kernel without CONFIG_TLS:\n%s", human.String())
	}
	if !strings.Contains(rest, "CONFIG_TLS:       not set ("+caps.Config.Source+")") {
		t.Errorf("details lack the CONFIG_TLS line:\n%s", rest)
	}
	var js bytes.Buffer
	if err := writeProbe(&js, caps, true); err != nil {
		t.Fatal(err)
	}
	got := decodeReport(t, js.Bytes())
	if got.ConfigTLS != "not set" || got.ConfigSource != caps.Config.Source || strings.Contains(got.Hint, "modprobe") {
		t.Errorf("JSON report %+v", got)
	}

	// No readable configuration: the probe cannot tell, and says so.
	caps.Config = ktls.ReadKernelConfig(filepath.Join(t.TempDir(), "config-missing"))
	human.Reset()
	if err := writeProbe(&human, caps, false); err != nil {
		t.Fatal(err)
	}
	first, _, _ = strings.Cut(human.String(), "\n")
	for _, want := range []string{"could not tell whether this kernel was built with CONFIG_TLS", "config-missing", "modprobe tls"} {
		if !strings.Contains(first, want) {
			t.Errorf("verdict lacks %q: %q", want, first)
		}
	}

	// Built in: no module is missing either.
	caps.Config = writeKernelConfig(t, "config-6.18.0-test", "CONFIG_NET=y\nCONFIG_TLS=y\n")
	human.Reset()
	if err := writeProbe(&human, caps, false); err != nil {
		t.Fatal(err)
	}
	if first, _, _ = strings.Cut(human.String(), "\n"); !strings.Contains(first, "CONFIG_TLS=y built in") || strings.Contains(first, "modprobe") {
		t.Errorf("verdict for a built-in CONFIG_TLS: %q", first)
	}
}

func TestWriteProbeAvailable(t *testing.T) {
	var human bytes.Buffer
	if err := writeProbe(&human, fullULP, false); err != nil {
		t.Fatal(err)
	}
	if first, _, _ := strings.Cut(human.String(), "\n"); first != "kernel TLS available" {
		t.Errorf("first line %q, want %q", first, "kernel TLS available")
	}
	if strings.Contains(human.String(), "modprobe") {
		t.Errorf("hint printed although kTLS is available:\n%s", human.String())
	}
	var js bytes.Buffer
	if err := writeProbe(&js, fullULP, true); err != nil {
		t.Fatal(err)
	}
	got := decodeReport(t, js.Bytes())
	want := ProbeReport{
		Kernel:    "7.3.4-test",
		Available: true,
		NetAdmin:  true,
		Ciphers: []ProbeCipher{
			{Version: "TLS 1.3", Suite: "TLS_AES_128_GCM_SHA256", TX: true, RX: true},
			{Version: "TLS 1.2", Suite: "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384", TX: true, RX: false},
		},
		ExpectNoPad:  true,
		TXZeroCopyRO: true,
		Rekey:        true,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("JSON report:\n got %+v\nwant %+v", got, want)
	}
}

// TestProbeCommandReportsThisKernel runs the cobra command as `caddy ktls
// probe --json` would, against this process's kernel.
func TestProbeCommandReportsThisKernel(t *testing.T) {
	cmd := probeCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"--json"})
	if err := cmd.Execute(); err != nil {
		t.Fatalf("probe --json: %v", err)
	}
	got := decodeReport(t, out.Bytes())
	if want := NewProbeReport(ktls.Probe()); !reflect.DeepEqual(got, want) {
		t.Errorf("command report:\n got %+v\nwant %+v", got, want)
	}
	if avail := kerneltest.Available() == nil; got.Available != avail {
		t.Errorf("available = %v, but the ULP check says %v", got.Available, avail)
	}
	cmd.SetArgs([]string{"--bogus"})
	cmd.SetErr(&bytes.Buffer{})
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "bogus") {
		t.Errorf("unknown flag: err = %v, want one naming --bogus", err)
	}
}
