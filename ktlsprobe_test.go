package caddyktls

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"reflect"
	"testing"

	"github.com/ktlsingress/caddy-ktls/internal/cli"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestKernelProbeCommand runs the real binary's `ktls probe --json` on a
// kTLS kernel and checks it against the in-process probe and the kernel's
// counters (the subprocess's installs show up in the shared tls_stat).
func TestKernelProbeCommand(t *testing.T) {
	kerneltest.Require(t)
	caddy := caddyBinary(t)
	var stdout, stderr bytes.Buffer
	delta := kerneltest.StatDelta(t, func() {
		cmd := exec.Command(caddy, "ktls", "probe", "--json")
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s ktls probe --json: %v\nstderr: %s", caddy, err, stderr.String())
		}
	})
	var got cli.ProbeReport
	dec := json.NewDecoder(bytes.NewReader(stdout.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("decode probe JSON: %v\n%s", err, stdout.Bytes())
	}
	t.Logf("caddy ktls probe --json on %s:\n%s", got.Kernel, stdout.String())
	if !got.Available || got.ULPError != "" || got.Hint != "" {
		t.Fatalf("the binary reports kTLS unavailable on a kTLS kernel: %+v", got)
	}
	if want := cli.NewProbeReport(ktls.Probe()); !reflect.DeepEqual(got, want) {
		t.Errorf("binary and in-process probe disagree:\n binary %+v\nprocess %+v", got, want)
	}
	var tx, rx int64
	for _, c := range got.Ciphers {
		if c.TX {
			tx++
		}
		if c.RX {
			rx++
		}
	}
	// Each accepted first install is one new software context in the kernel.
	if tx == 0 || delta["TlsTxSw"] != tx || delta["TlsRxSw"] != rx {
		t.Errorf("tls_stat TlsTxSw +%d TlsRxSw +%d while the binary reported %d TX and %d RX installs",
			delta["TlsTxSw"], delta["TlsRxSw"], tx, rx)
	}
}
