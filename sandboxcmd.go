package caddyktls

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/ktlsingress/caddy-ktls/preamble"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "sandbox",
		Short: "Make keys for, sign, verify and dial with sandbox preambles",
		Long: `
Tools for the signed sandbox preamble (docs/preamble.md) that an edge gateway
writes first on its mutual-TLS connection to the forwarder:

  keygen  make an Ed25519 signing key and print its public key with its key ID
  sign    sign a preamble and print it (hex) or write it raw
  verify  check a preamble against a keyring; exit status 1 on rejection
  dial    connect to a forwarder like a gateway and pipe stdin/stdout through
`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.AddCommand(sandboxSubcommands()...)
		},
	})
}

// sandboxSubcommands builds the subcommands of "caddy sandbox". They read
// and write through cmd.InOrStdin/OutOrStdout so that tests can drive them.
func sandboxSubcommands() []*cobra.Command {
	return []*cobra.Command{keygenCommand(), signCommand(), verifyCommand(), dialCommand()}
}

func keygenCommand() *cobra.Command {
	var keyOut, pubOut, keyID string
	cmd := &cobra.Command{
		Use:   "keygen --key-out <file> [--pub-out <file>] [--key-id <id>]",
		Short: "Make an Ed25519 preamble signing key",
		Long: `
Writes a new Ed25519 private key to --key-out (PEM PKCS#8, mode 0600; an
existing file is never overwritten) and its public key as a PEM "PUBLIC KEY"
block with a "Key-Id:" header to --pub-out ("-" = stdout). Concatenate public
key blocks into a keyring file for the forwarder. The key ID defaults to the
one derived from the key (ed25519-<16 hex digits>).
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if keyOut == "" {
				return errors.New("--key-out is required")
			}
			pub, key, err := ed25519.GenerateKey(rand.Reader)
			if err != nil {
				return err
			}
			if keyID == "" {
				keyID = preamble.KeyIDFor(pub)
			}
			pubPEM, err := preamble.MarshalPublicKey(keyID, pub)
			if err != nil {
				return err
			}
			keyPEM, err := preamble.MarshalPrivateKey(key)
			if err != nil {
				return err
			}
			if err := writeNewFile(keyOut, keyPEM, 0o600); err != nil {
				return err
			}
			return writeOutput(cmd, pubOut, pubPEM, 0o644)
		},
	}
	cmd.Flags().StringVar(&keyOut, "key-out", "", "private key file to create")
	cmd.Flags().StringVar(&pubOut, "pub-out", "-", `public key file ("-" = stdout)`)
	cmd.Flags().StringVar(&keyID, "key-id", "", "key ID (default: derived from the key)")
	return cmd
}

// claimFlags are the flags shared by sign and dial.
type claimFlags struct {
	keyFile, keyID, sandbox, target string
	ttl                             time.Duration
}

func (f *claimFlags) register(cmd *cobra.Command, keyFlag string) {
	cmd.Flags().StringVar(&f.keyFile, keyFlag, "", "Ed25519 private key file (PEM PKCS#8)")
	cmd.Flags().StringVar(&f.keyID, "key-id", "", "key ID (default: derived from the key)")
	cmd.Flags().StringVar(&f.sandbox, "sandbox", "", "sandbox ID ([A-Za-z0-9._-], up to 128 bytes)")
	cmd.Flags().StringVar(&f.target, "target", "", "target ip:port inside the sandbox (IPv6 as [addr]:port)")
	cmd.Flags().DurationVar(&f.ttl, "ttl", preamble.DefaultTTL, "validity of the preamble")
}

func (f *claimFlags) signerAndClaims(keyFlag string) (*preamble.Signer, preamble.Claims, error) {
	if f.keyFile == "" || f.sandbox == "" || f.target == "" {
		return nil, preamble.Claims{}, fmt.Errorf("--%s, --sandbox and --target are required", keyFlag)
	}
	data, err := os.ReadFile(f.keyFile)
	if err != nil {
		return nil, preamble.Claims{}, err
	}
	key, err := preamble.ParsePrivateKey(data)
	if err != nil {
		return nil, preamble.Claims{}, err
	}
	if f.keyID == "" {
		f.keyID = preamble.KeyIDFor(key.Public().(ed25519.PublicKey))
	}
	signer, err := preamble.NewSigner(f.keyID, key)
	if err != nil {
		return nil, preamble.Claims{}, err
	}
	target, err := netip.ParseAddrPort(f.target)
	if err != nil {
		return nil, preamble.Claims{}, fmt.Errorf("--target %q: want an IP address and port, no host names: %v", f.target, err)
	}
	if f.ttl < time.Second {
		return nil, preamble.Claims{}, fmt.Errorf("--ttl %v: want at least 1s", f.ttl)
	}
	now := time.Now()
	return signer, preamble.Claims{SandboxID: f.sandbox, Target: target, IssuedAt: now, ExpiresAt: now.Add(f.ttl)}, nil
}

// warnTTL tells the operator, on w, when --ttl is longer than a forwarder
// with default settings accepts: such a preamble is signed all the same,
// and rejected as ttl-too-long by every forwarder whose max_preamble_ttl
// was not raised to cover it.
func (f *claimFlags) warnTTL(w io.Writer) {
	if f.ttl <= preamble.DefaultMaxTTL {
		return
	}
	fmt.Fprintf(w, "warning: --ttl %v is longer than the %v a forwarder accepts by default (max_preamble_ttl); "+
		"a forwarder rejects this preamble as %s unless its max_preamble_ttl is at least %v\n",
		f.ttl, preamble.DefaultMaxTTL, preamble.ReasonTTLTooLong, f.ttl.Truncate(time.Second))
}

func signCommand() *cobra.Command {
	var (
		cf              claimFlags
		binding, format string
		out             string
	)
	cmd := &cobra.Command{
		Use:   "sign --key <file> --sandbox <id> --target <ip:port> [--ttl 30s] [--binding <hex>] [--format hex|raw] [--out <file>]",
		Short: "Sign a sandbox preamble",
		Long: `
Signs a preamble for --sandbox and --target, valid from now for --ttl, and
writes it as one line of hex (default) or as raw bytes to --out ("-" =
stdout). --binding is the 32-byte TLS 1.3 exporter of the session that will
carry it, in hex; without it the preamble is unbound. A --ttl longer than a
forwarder accepts by default (` + preamble.DefaultMaxTTL.String() + `; its max_preamble_ttl option raises
that) is signed with a warning on stderr.
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			signer, claims, err := cf.signerAndClaims("key")
			if err != nil {
				return err
			}
			cf.warnTTL(cmd.ErrOrStderr())
			if binding != "" {
				if claims.Binding, err = hex.DecodeString(binding); err != nil {
					return fmt.Errorf("--binding: %v", err)
				}
			}
			frame, err := signer.Sign(claims)
			if err != nil {
				return err
			}
			switch format {
			case "hex":
				frame = []byte(hex.EncodeToString(frame) + "\n")
			case "raw":
			default:
				return fmt.Errorf("--format %q: want hex or raw", format)
			}
			return writeOutput(cmd, out, frame, 0o644)
		},
	}
	cf.register(cmd, "key")
	cmd.Flags().StringVar(&binding, "binding", "", "channel binding, 32 bytes in hex")
	cmd.Flags().StringVar(&format, "format", "hex", "output format: hex or raw")
	cmd.Flags().StringVar(&out, "out", "-", `output file ("-" = stdout)`)
	return cmd
}

// verifiedClaims is the JSON that "caddy sandbox verify" prints.
type verifiedClaims struct {
	KeyID      string    `json:"key_id"`
	SandboxID  string    `json:"sandbox_id"`
	Target     string    `json:"target"`
	IssuedAt   time.Time `json:"issued_at"`
	ExpiresAt  time.Time `json:"expires_at"`
	Nonce      string    `json:"nonce"`
	Binding    string    `json:"binding,omitempty"`
	Extensions []string  `json:"extensions,omitempty"`
}

func verifyCommand() *cobra.Command {
	var (
		keyring, in, format, binding string
		requireBinding               bool
		maxSkew, maxTTL              time.Duration
	)
	cmd := &cobra.Command{
		Use:   "verify --keyring <file> [--in <file>] [--format auto|hex|raw] [--binding <hex>] [--require-binding]",
		Short: "Verify a sandbox preamble",
		Long: `
Reads one preamble from --in ("-" = stdin) as hex or raw bytes (auto: raw if
it starts with "KTLP") and checks it like the forwarder does against the
public keys in --keyring. Prints the claims as JSON and exits 0, or prints
the stable rejection reason and exits 1. --binding is the channel binding of
the connection the preamble arrived on (hex); without it a bound preamble is
rejected (binding-mismatch).
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if keyring == "" {
				return errors.New("--keyring is required")
			}
			ringPEM, err := os.ReadFile(keyring)
			if err != nil {
				return err
			}
			keys, err := preamble.ParseKeyring(ringPEM)
			if err != nil {
				return err
			}
			frame, err := readFrameInput(cmd, in, format)
			if err != nil {
				return err
			}
			var connBinding []byte
			if binding != "" {
				if connBinding, err = hex.DecodeString(binding); err != nil {
					return fmt.Errorf("--binding: %v", err)
				}
			}
			v, err := preamble.NewVerifier(preamble.VerifierConfig{
				Keys: keys, MaxSkew: maxSkew, MaxTTL: maxTTL, RequireBinding: requireBinding,
			})
			if err != nil {
				return err
			}
			c, err := v.Verify(frame, connBinding)
			if err != nil {
				return fmt.Errorf("rejected: %s: %w", preamble.ReasonOf(err), err)
			}
			out := verifiedClaims{
				KeyID: c.KeyID, SandboxID: c.SandboxID, Target: c.Target.String(),
				IssuedAt: c.IssuedAt.UTC(), ExpiresAt: c.ExpiresAt.UTC(),
				Nonce: hex.EncodeToString(c.Nonce[:]), Binding: hex.EncodeToString(c.Binding),
			}
			for _, e := range c.Extensions {
				out.Extensions = append(out.Extensions, fmt.Sprintf("%#04x:%x", e.Type, e.Value))
			}
			enc := json.NewEncoder(cmd.OutOrStdout())
			enc.SetIndent("", "  ")
			return enc.Encode(out)
		},
	}
	cmd.Flags().StringVar(&keyring, "keyring", "", "keyring file: PEM PUBLIC KEY blocks with Key-Id headers")
	cmd.Flags().StringVar(&in, "in", "-", `preamble file ("-" = stdin)`)
	cmd.Flags().StringVar(&format, "format", "auto", "input format: auto, hex or raw")
	cmd.Flags().StringVar(&binding, "binding", "", "channel binding of the carrying connection, hex")
	cmd.Flags().BoolVar(&requireBinding, "require-binding", false, "reject unbound preambles")
	cmd.Flags().DurationVar(&maxSkew, "max-skew", preamble.DefaultMaxSkew, "allowed clock difference")
	cmd.Flags().DurationVar(&maxTTL, "max-ttl", preamble.DefaultMaxTTL, "longest validity window accepted")
	return cmd
}

// readFrameInput reads one preamble in the given format from a file or stdin.
func readFrameInput(cmd *cobra.Command, path, format string) ([]byte, error) {
	var data []byte
	var err error
	if path == "-" {
		data, err = io.ReadAll(io.LimitReader(cmd.InOrStdin(), 4*preamble.MaxFrameLen))
	} else {
		data, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, err
	}
	if format == "auto" {
		format = "hex"
		if bytes.HasPrefix(data, []byte(preamble.Magic)) {
			format = "raw"
		}
	}
	switch format {
	case "raw":
		return data, nil
	case "hex":
		frame, err := hex.DecodeString(strings.Join(strings.Fields(string(data)), ""))
		if err != nil {
			return nil, fmt.Errorf("preamble is not hex: %v", err)
		}
		return frame, nil
	default:
		return nil, fmt.Errorf("--format %q: want auto, hex or raw", format)
	}
}

func dialCommand() *cobra.Command {
	var (
		cf                              claimFlags
		addr, certFile, keyFile, caFile string
		serverName                      string
		timeout                         time.Duration
	)
	cmd := &cobra.Command{
		Use:   "dial --addr <host:port> --cert <file> --key <file> --ca <file> --signing-key <file> --sandbox <id> --target <ip:port>",
		Short: "Open a sandbox tunnel like a gateway and pipe stdin/stdout through it",
		Long: `
Connects to the forwarder at --addr with mutual TLS (client certificate
--cert/--key, forwarder verified against --ca), signs a preamble bound to the
TLS 1.3 session with --signing-key, writes it, then copies stdin to the tunnel
and the tunnel to stdout, like "openssl s_client -quiet". At the end of stdin
it half-closes (close_notify); it returns when the forwarder closes its side.
A forwarder that rejects the preamble (or its target) sends no byte: on
kernel TLS it refuses with the TLS alert access_denied ("the forwarder
refused the tunnel, ...: remote error: tls: access denied"), in userspace
TLS with a reset ("the forwarder reset the tunnel before its first byte");
its log and metrics carry the reason.
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if addr == "" || certFile == "" || keyFile == "" || caFile == "" {
				return errors.New("--addr, --cert, --key and --ca are required")
			}
			signer, claims, err := cf.signerAndClaims("signing-key")
			if err != nil {
				return err
			}
			cf.warnTTL(cmd.ErrOrStderr())
			cert, err := tls.LoadX509KeyPair(certFile, keyFile)
			if err != nil {
				return fmt.Errorf("client certificate: %w", err)
			}
			caPEM, err := os.ReadFile(caFile)
			if err != nil {
				return err
			}
			roots := x509.NewCertPool()
			if !roots.AppendCertsFromPEM(caPEM) {
				return fmt.Errorf("--ca %s holds no PEM certificate", caFile)
			}
			tlsConfig := &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: roots, ServerName: serverName, MinVersion: tls.VersionTLS12}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			conn, err := preamble.Dial(ctx, "tcp", addr, tlsConfig, signer, claims)
			if err != nil {
				return err
			}
			defer conn.Close()
			uploaded := make(chan error, 1)
			go func() {
				_, err := io.Copy(conn, cmd.InOrStdin())
				if err == nil {
					err = conn.CloseWrite()
				}
				uploaded <- err
			}()
			received, err := io.Copy(cmd.OutOrStdout(), conn)
			switch {
			case err != nil && received == 0 && preamble.Refused(err):
				return fmt.Errorf("the forwarder refused the tunnel, nothing reached the target; its log (\"sandbox tunnel rejected\") and metrics name the reason: %w", err)
			case err != nil && received == 0 && errors.Is(err, syscall.ECONNRESET):
				return fmt.Errorf("the forwarder reset the tunnel before its first byte: a refusal (a forwarder in userspace TLS refuses this way) or a failure; its log names which: %w", err)
			case err != nil:
				return fmt.Errorf("reading from the tunnel: %w", err)
			}
			// The forwarder has closed its side. An upload error is worth
			// reporting; an upload still blocked on a terminal stdin is not
			// waited for.
			select {
			case err := <-uploaded:
				if err != nil {
					return fmt.Errorf("writing to the tunnel: %w", err)
				}
			default:
			}
			return nil
		},
	}
	cf.register(cmd, "signing-key")
	cmd.Flags().StringVar(&addr, "addr", "", "forwarder address host:port")
	cmd.Flags().StringVar(&certFile, "cert", "", "client certificate (PEM)")
	cmd.Flags().StringVar(&keyFile, "key", "", "client certificate key (PEM)")
	cmd.Flags().StringVar(&caFile, "ca", "", "CA certificates that sign the forwarder's certificate (PEM)")
	cmd.Flags().StringVar(&serverName, "server-name", "", "name to verify in the forwarder's certificate (default: host of --addr)")
	cmd.Flags().DurationVar(&timeout, "timeout", 10*time.Second, "bound on connecting, handshake and writing the preamble")
	return cmd
}

// writeNewFile creates path with data and mode, refusing to overwrite.
func writeNewFile(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// writeOutput writes data to stdout for "-", else to path (replacing it).
func writeOutput(cmd *cobra.Command, path string, data []byte, mode os.FileMode) error {
	if path == "-" {
		_, err := cmd.OutOrStdout().Write(data)
		return err
	}
	return os.WriteFile(path, data, mode)
}
