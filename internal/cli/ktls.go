package cli

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/ktlsingress/caddy-ktls/internal/offload"
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
on demand only for a caller with CAP_NET_ADMIN. When the tls ULP does not
attach, it reads the kernel's build configuration (/boot/config-$(uname -r),
else /proc/config.gz) to tell a kernel built without CONFIG_TLS, where no
module can help, from one whose tls module is not loaded; where neither
file is readable it says it could not tell.
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return writeProbe(cmd.OutOrStdout(), ktls.Probe(), asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

// ProbeReport is the JSON form of ktls.Capabilities (whose ULP field is an
// error and does not marshal).
type ProbeReport struct {
	Kernel       string        `json:"kernel"`
	Available    bool          `json:"available"`
	ULPError     string        `json:"ulp_error,omitempty"`
	Hint         string        `json:"hint,omitempty"`
	ConfigTLS    string        `json:"kernel_config_tls,omitempty"`
	ConfigSource string        `json:"kernel_config,omitempty"`
	NetAdmin     bool          `json:"cap_net_admin"`
	Ciphers      []ProbeCipher `json:"ciphers"`
	ExpectNoPad  bool          `json:"rx_expect_no_pad"`
	TXZeroCopyRO bool          `json:"tx_zerocopy_ro"`
	Rekey        bool          `json:"tls13_rekey"`
}

type ProbeCipher struct {
	Version string `json:"version"`
	Suite   string `json:"suite"`
	TX      bool   `json:"tx"`
	RX      bool   `json:"rx"`
}

func NewProbeReport(caps ktls.Capabilities) ProbeReport {
	r := ProbeReport{
		Kernel:       caps.Kernel,
		Available:    caps.ULP == nil,
		NetAdmin:     caps.NetAdmin,
		Ciphers:      []ProbeCipher{},
		ExpectNoPad:  caps.ExpectNoPad,
		TXZeroCopyRO: caps.TXZeroCopyRO,
		Rekey:        caps.Rekey,
	}
	if caps.ULP != nil {
		r.ULPError = caps.ULP.Error()
		r.Hint = offload.ProbeHint(caps.Config)
		r.ConfigTLS = caps.Config.TLS.String()
		r.ConfigSource = caps.Config.Source
	}
	for _, c := range caps.Ciphers {
		r.Ciphers = append(r.Ciphers, ProbeCipher{Version: tls.VersionName(c.Version), Suite: c.Name, TX: c.TX, RX: c.RX})
	}
	return r
}

// writeProbe prints caps for humans (a verdict line, then the details) or
// as one JSON object.
func writeProbe(w io.Writer, caps ktls.Capabilities, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(NewProbeReport(caps))
	}
	verdict := "kernel TLS available"
	if caps.ULP != nil {
		verdict = fmt.Sprintf("kernel TLS unavailable: %v; %s", caps.ULP, offload.ProbeHint(caps.Config))
	}
	_, err := fmt.Fprintf(w, "%s\n\n%s", verdict, caps)
	return err
}
