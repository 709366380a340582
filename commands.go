package caddyktls

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "ktls",
		Short: "Inspect this machine's kernel TLS (kTLS) support",
		Long: `
Commands about the kernel side of caddy-ktls:

  probe   try the tls ULP and every cipher suite on throwaway loopback sockets
          and print what this kernel accepts
`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.AddCommand(probeCommand())
		},
	})
}

func probeCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "probe [--json]",
		Short: "Report what kernel TLS this machine supports",
		Long: `
Finds out by trying, as the listener does at run time: attaches the "tls"
upper layer protocol to a loopback TCP connection, then installs throwaway
keys for each TLS 1.2/1.3 cipher suite in both directions (TLS_TX, TLS_RX),
and tries TLS_RX_EXPECT_NO_PAD, TLS_TX_ZEROCOPY_RO and a TLS 1.3 rekey.

It is a report: the exit status is 0 whether or not kTLS is available.
Run it with the privileges Caddy runs with: the kernel loads the tls module
on demand only for a caller with CAP_NET_ADMIN.
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return writeProbe(cmd.OutOrStdout(), ktls.Probe(), asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

// enableHint is what to do when the tls ULP does not attach.
const enableHint = "to enable: modprobe tls (the kernel autoloads it only for a caller with CAP_NET_ADMIN); " +
	"to load it at boot: echo tls > /etc/modules-load.d/tls.conf"

// probeReport is the JSON form of ktls.Capabilities (whose ULP field is an
// error and does not marshal).
type probeReport struct {
	Kernel       string        `json:"kernel"`
	Available    bool          `json:"available"`
	ULPError     string        `json:"ulp_error,omitempty"`
	Hint         string        `json:"hint,omitempty"`
	NetAdmin     bool          `json:"cap_net_admin"`
	Ciphers      []probeCipher `json:"ciphers"`
	ExpectNoPad  bool          `json:"rx_expect_no_pad"`
	TXZeroCopyRO bool          `json:"tx_zerocopy_ro"`
	Rekey        bool          `json:"tls13_rekey"`
}

type probeCipher struct {
	Version string `json:"version"`
	Suite   string `json:"suite"`
	TX      bool   `json:"tx"`
	RX      bool   `json:"rx"`
}

func newProbeReport(caps ktls.Capabilities) probeReport {
	r := probeReport{
		Kernel:       caps.Kernel,
		Available:    caps.ULP == nil,
		NetAdmin:     caps.NetAdmin,
		Ciphers:      []probeCipher{},
		ExpectNoPad:  caps.ExpectNoPad,
		TXZeroCopyRO: caps.TXZeroCopyRO,
		Rekey:        caps.Rekey,
	}
	if caps.ULP != nil {
		r.ULPError = caps.ULP.Error()
		r.Hint = enableHint
	}
	for _, c := range caps.Ciphers {
		r.Ciphers = append(r.Ciphers, probeCipher{Version: tls.VersionName(c.Version), Suite: c.Name, TX: c.TX, RX: c.RX})
	}
	return r
}

// writeProbe prints caps for humans (a verdict line, then the details) or
// as one JSON object.
func writeProbe(w io.Writer, caps ktls.Capabilities, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(newProbeReport(caps))
	}
	verdict := "kernel TLS available"
	if caps.ULP != nil {
		verdict = fmt.Sprintf("kernel TLS unavailable: %v; %s", caps.ULP, enableHint)
	}
	_, err := fmt.Fprintf(w, "%s\n\n%s", verdict, caps)
	return err
}
