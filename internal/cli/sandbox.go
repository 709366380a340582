package cli

import (
	"bytes"
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

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "sandbox",
		Short: "Make keys and certificates for, sign, verify and dial with sandbox preambles",
		Long: `
Tools for the signed sandbox preamble that an edge gateway writes first on
its mutual-TLS connection to the forwarder:

  keygen  make an Ed25519 signing key and print its public key with its key ID
  sign    sign a preamble and print it (hex) or write it raw
  verify  check a preamble against a keyring; exit status 1 on rejection
  dial    connect to a forwarder like a gateway and pipe stdin/stdout through
  certs   make the CA, forwarder and gateway certificates of the mutual TLS
  upgrade replace the running forwarder by the installed binary, tunnels kept
` + preambleSpecRef,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.AddCommand(SandboxSubcommands()...)
		},
	})
}

// preambleSpecURL is the preamble's specification, which every "caddy
// sandbox" help text points to.
const preambleSpecURL = "https://github.com/ktlsingress/caddy-ktls/blob/main/docs/preamble.md"

// preambleSpecRef ends the long help of "caddy sandbox" and its subcommands.
const preambleSpecRef = `
The preamble (byte layout, a worked example, every rejection reason):
` + preambleSpecURL + `
`

// SandboxSubcommands builds the subcommands of "caddy sandbox". They read
// and write through cmd.InOrStdin/OutOrStdout so that tests can drive them.
func SandboxSubcommands() []*cobra.Command {
	return []*cobra.Command{keygenCommand(), signCommand(), verifyCommand(), dialCommand(), certsCommand(), upgradeCommand()}
}

func keygenCommand() *cobra.Command {
	var keyOut, pubOut, keyID string
	var appendPub bool
	cmd := &cobra.Command{
		Use:   "keygen --key-out <file> [--pub-out <file> [--append]] [--key-id <id>]",
		Short: "Make an Ed25519 preamble signing key",
		Long: `
Writes a new Ed25519 private key to --key-out (PEM PKCS#8, mode 0600; an
existing file is never overwritten), preceded by a "Key-Id: <id>" line that
keeps the key ID with the key, so "sign" and "dial" need no --key-id (the
line is text outside the PEM block: openssl reads the file as a plain key).
Its public key goes, as a PEM "PUBLIC KEY" block with a "Key-Id:" header, to
--pub-out ("-" = stdout, the default). A keyring file for the forwarder is
such blocks one after another.

--pub-out never replaces an existing file: keygen refuses, unless --append
is given, which adds the new public key to that keyring (made if missing)
after checking that it is a keyring and holds no key with the same ID. The
key ID defaults to the one derived from the key (ed25519-<16 hex digits>).
` + preambleSpecRef,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if keyOut == "" {
				return errors.New("--key-out is required")
			}
			if appendPub && pubOut == "-" {
				return errors.New("--append adds to a keyring file: give it with --pub-out <file>")
			}
			if pubOut == keyOut {
				return fmt.Errorf("--pub-out and --key-out are both %s: the public keyring and the private key are separate files", keyOut)
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
			keyPEM, err := preamble.MarshalSigningKey(keyID, key)
			if err != nil {
				return err
			}
			// Check the keyring before the private key is written, so that
			// a refusal leaves no orphan key behind.
			ring, err := existingKeyring(pubOut, keyID, appendPub)
			if err != nil {
				return err
			}
			if err := writeNewFile(keyOut, keyPEM, 0o600); err != nil {
				return err
			}
			switch {
			case pubOut == "-":
				_, err = cmd.OutOrStdout().Write(pubPEM)
				return err
			case ring != nil:
				return appendKeyring(pubOut, ring, pubPEM)
			}
			if err := writeNewFile(pubOut, pubPEM, 0o644); err != nil {
				return fmt.Errorf("--pub-out: %w", err)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&keyOut, "key-out", "", "private key file to create")
	cmd.Flags().StringVar(&pubOut, "pub-out", "-", `public key file to create ("-" = stdout); never overwritten`)
	cmd.Flags().BoolVar(&appendPub, "append", false, "add the public key to the --pub-out keyring instead of refusing an existing file")
	cmd.Flags().StringVar(&keyID, "key-id", "", "key ID (default: derived from the key)")
	return cmd
}

// existingKeyring checks the --pub-out file before keygen writes anything:
// nil, nil when there is none (or it is stdout); an error when it exists
// and append is off, or when it is no keyring or already holds keyID; its
// contents when keygen is to append to it.
func existingKeyring(path, keyID string, appendPub bool) ([]byte, error) {
	if path == "-" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("--pub-out: %w", err)
	}
	if !appendPub {
		return nil, fmt.Errorf("--pub-out %s exists: keygen never overwrites a keyring; "+
			"give --append to add the new public key to it, or remove the file first", path)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return data, nil
	}
	keys, err := preamble.ParseKeyring(data)
	if err != nil {
		return nil, fmt.Errorf("--pub-out %s: %w", path, err)
	}
	if _, dup := keys[keyID]; dup {
		return nil, fmt.Errorf("--pub-out %s already holds a key with ID %q: give the new key another --key-id", path, keyID)
	}
	return data, nil
}

// appendKeyring adds pubPEM at the end of the keyring at path, whose
// current contents are ring.
func appendKeyring(path string, ring, pubPEM []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return fmt.Errorf("--pub-out: %w", err)
	}
	if len(ring) > 0 && ring[len(ring)-1] != '\n' {
		pubPEM = append([]byte("\n"), pubPEM...)
	}
	if _, err := f.Write(pubPEM); err != nil {
		f.Close()
		return fmt.Errorf("--pub-out: %w", err)
	}
	return f.Close()
}

// claimFlags are the flags shared by sign and dial.
type claimFlags struct {
	keyFile, keyID, sandbox, target string
	clientAddr, clientID            string
	ttl                             time.Duration
}

func (f *claimFlags) register(cmd *cobra.Command, keyFlag string) {
	cmd.Flags().StringVar(&f.keyFile, keyFlag, "", "Ed25519 private key file (PEM PKCS#8, as keygen --key-out writes it)")
	cmd.Flags().StringVar(&f.keyID, "key-id", "", "key ID (default: the one kept in the key file, else derived from the key); must match the key file's")
	cmd.Flags().StringVar(&f.sandbox, "sandbox", "", "sandbox ID ([a-z0-9._-], up to 128 bytes, starting with a letter or digit; case-insensitive: signed lowercase)")
	cmd.Flags().StringVar(&f.target, "target", "", "target ip:port inside the sandbox (IPv6 as [addr]:port)")
	cmd.Flags().DurationVar(&f.ttl, "ttl", preamble.DefaultTTL, "validity of the preamble")
	cmd.Flags().StringVar(&f.clientAddr, "client-addr", "", "end user's ip:port, signed as the client identity (extension 0x0010)")
	cmd.Flags().StringVar(&f.clientID, "client-id", "", "end user's identity string (up to 255 bytes of UTF-8, no control, line-separator or bidi formatting characters); needs --client-addr")
}

func (f *claimFlags) signerAndClaims(keyFlag string) (*preamble.Signer, preamble.Claims, error) {
	if f.keyFile == "" || f.sandbox == "" || f.target == "" {
		return nil, preamble.Claims{}, fmt.Errorf("--%s, --sandbox and --target are required", keyFlag)
	}
	data, err := os.ReadFile(f.keyFile)
	if err != nil {
		return nil, preamble.Claims{}, err
	}
	key, fileID, err := preamble.ParseSigningKey(data)
	if err != nil {
		return nil, preamble.Claims{}, fmt.Errorf("--%s %s: %w", keyFlag, f.keyFile, err)
	}
	switch {
	case fileID != "" && f.keyID != "" && f.keyID != fileID:
		return nil, preamble.Claims{}, fmt.Errorf("--key-id %q does not match the key ID %q kept with the key in %s: "+
			"leave --key-id out, or give %q", f.keyID, fileID, f.keyFile, fileID)
	case fileID != "":
		f.keyID = fileID
	case f.keyID == "":
		f.keyID = preamble.KeyIDFor(key.Public().(ed25519.PublicKey))
	}
	signer, err := preamble.NewSigner(f.keyID, key)
	if err != nil {
		return nil, preamble.Claims{}, err
	}
	sandbox, err := preamble.CanonicalSandboxID(f.sandbox)
	if err != nil {
		return nil, preamble.Claims{}, fmt.Errorf("--sandbox: %w", err)
	}
	target, err := netip.ParseAddrPort(f.target)
	if err != nil {
		return nil, preamble.Claims{}, fmt.Errorf("--target %q: want an IP address and port, no host names: %v", f.target, err)
	}
	if f.ttl < time.Second {
		return nil, preamble.Claims{}, fmt.Errorf("--ttl %v: want at least 1s", f.ttl)
	}
	now := time.Now()
	claims := preamble.Claims{SandboxID: sandbox, Target: target, IssuedAt: now, ExpiresAt: now.Add(f.ttl)}
	if f.clientID != "" && f.clientAddr == "" {
		return nil, preamble.Claims{}, errors.New("--client-id needs --client-addr: the client identity always carries the end user's address")
	}
	if f.clientAddr != "" {
		ap, err := netip.ParseAddrPort(f.clientAddr)
		if err != nil {
			return nil, preamble.Claims{}, fmt.Errorf("--client-addr %q: want an IP address and port: %v", f.clientAddr, err)
		}
		ext, err := preamble.ClientIdentity{Addr: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), ID: f.clientID}.Extension()
		if err != nil {
			return nil, preamble.Claims{}, fmt.Errorf("--client-addr/--client-id: %w", err)
		}
		claims.Extensions = []preamble.Extension{ext}
	}
	return signer, claims, nil
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
that) is signed with a warning on stderr. The key ID is the one keygen kept
with the key; --key-id is needed only for a key file that names none.
` + preambleSpecRef,
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

// VerifiedClaims is the JSON that "caddy sandbox verify" prints.
type VerifiedClaims struct {
	KeyID      string    `json:"key_id"`
	SandboxID  string    `json:"sandbox_id"`
	Target     string    `json:"target"`
	IssuedAt   time.Time `json:"issued_at"`
	ExpiresAt  time.Time `json:"expires_at"`
	Nonce      string    `json:"nonce"`
	Binding    string    `json:"binding,omitempty"`
	Extensions []string  `json:"extensions,omitempty"`
	// ClientAddr and ClientID are the client identity extension (0x0010)
	// decoded, when the frame carries one.
	ClientAddr string `json:"client_addr,omitempty"`
	ClientID   string `json:"client_id,omitempty"`
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
` + preambleSpecRef,
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
				return fmt.Errorf("--keyring %s: %w", keyring, err)
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
				return rejectedError(err)
			}
			out := VerifiedClaims{
				KeyID: c.KeyID, SandboxID: c.SandboxID, Target: c.Target.String(),
				IssuedAt: c.IssuedAt.UTC(), ExpiresAt: c.ExpiresAt.UTC(),
				Nonce: hex.EncodeToString(c.Nonce[:]), Binding: hex.EncodeToString(c.Binding),
			}
			for _, e := range c.Extensions {
				out.Extensions = append(out.Extensions, fmt.Sprintf("%#04x:%x", e.Type, e.Value))
			}
			if ci, ok := c.ClientIdentity(); ok {
				out.ClientAddr, out.ClientID = ci.Addr.String(), ci.ID
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

// rejectedError is how verify reports a rejection: "rejected: <reason>:
// <detail>", the reason stated once (a *preamble.Error's own text repeats
// it); Unwrap gives err.
func rejectedError(err error) error {
	var pe *preamble.Error
	if !errors.As(err, &pe) {
		return &dialError{err: err, msg: "rejected: " + preamble.ReasonOf(err) + ": " + err.Error()}
	}
	msg := "rejected: " + string(pe.Reason) + ": " + pe.Detail
	if pe.Err != nil {
		msg += ": " + pe.Err.Error()
	}
	return &dialError{err: err, msg: msg}
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
refused the tunnel before its first byte (remote error: tls: access
denied): ..."), in userspace TLS with a reset ("the forwarder reset the
tunnel before its first byte (connection reset by peer): ..."); either is
reported the same way whether the command met it reading or writing. Its
log and metrics carry the reason. A forwarder that refuses the client
certificate sends a certificate alert, which with TLS 1.3 arrives after the
handshake ("the forwarder refused the gateway's client certificate
(bad_certificate) ...: it lacks the clientAuth extended key usage ...");
nothing reached the target.
` + preambleSpecRef,
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
			// A gateway's dialer, in userspace TLS: it sends the certificate
			// whatever CAs the forwarder names, so that a refusal says what
			// is wrong with it.
			d, err := gateway.New(gateway.Config{
				TLS:    &tls.Config{RootCAs: roots, ServerName: serverName, Certificates: []tls.Certificate{cert}},
				Signer: signer, KTLS: ktls.Options{Disable: true}, DisableResumption: true,
				DialTimeout: timeout, PreambleTTL: cf.ttl,
			})
			if err != nil {
				return err
			}
			client, _ := claims.ClientIdentity()
			conn, err := d.Dial(cmd.Context(), gateway.Route{Forwarder: addr, Sandbox: claims.SandboxID, Target: claims.Target, Client: client})
			if err != nil {
				var refused *gateway.CertificateRefusedError
				if errors.As(err, &refused) {
					return refused
				}
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
			received, rerr := io.Copy(cmd.OutOrStdout(), conn)
			// The forwarder has closed its side. An upload error is worth
			// reporting; an upload still blocked on a terminal stdin is not
			// waited for, except briefly after an empty tunnel: a refusal
			// may have met the upload first (a reset is reported once, to
			// the call that meets it, and the read after it ends at EOF).
			var werr error
			if received == 0 && rerr == nil {
				select {
				case werr = <-uploaded:
				case <-time.After(refusalOnWriteWait):
				}
			} else {
				select {
				case werr = <-uploaded:
				default:
				}
			}
			if received == 0 {
				if refused := certificateRefused(cert.Leaf, rerr, werr); refused != nil {
					return refused
				}
			}
			return DialEnd(received, rerr, werr)
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

// certificateRefused is the error that says the forwarder refused the
// client certificate leaf, when one of errs, met before the tunnel's
// first byte, is that refusal (gateway.CertificateAlert); nil otherwise.
func certificateRefused(leaf *x509.Certificate, errs ...error) error {
	for _, err := range errs {
		if name, ok := gateway.CertificateAlert(err); ok {
			return &gateway.CertificateRefusedError{Alert: name, Certificate: leaf, Err: err}
		}
	}
	return nil
}

// refusalOnWriteWait bounds how long dial waits, after a tunnel that ended
// before its first byte, for the upload to say whether it met a refusal.
const refusalOnWriteWait = time.Second

// dialError is how dial reports the end of a tunnel: its message states
// what happened once; Unwrap gives the underlying error.
type dialError struct {
	msg string
	err error
}

func (e *dialError) Error() string { return e.msg }
func (e *dialError) Unwrap() error { return e.err }

// DialEnd says how a dialled tunnel ended, given what it received, how the
// read from it ended (rerr) and how the upload ended (werr, nil also when
// it had not ended). A refusal before the first byte is reported the same
// way whichever of the two met it.
func DialEnd(received int64, rerr, werr error) error {
	isReset := func(err error) bool {
		return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
	}
	if received == 0 {
		for _, err := range []error{rerr, werr} {
			if err != nil && gateway.Refused(err) {
				return &dialError{err: err, msg: "the forwarder refused the tunnel before its first byte (remote error: tls: access denied): " +
					"nothing reached the target; its log (\"sandbox tunnel rejected\") and metrics name the reason"}
			}
		}
		if err := rerr; isReset(err) || (err == nil && isReset(werr)) {
			if err == nil {
				err = werr
			}
			return &dialError{err: err, msg: "the forwarder reset the tunnel before its first byte (" + syscall.ECONNRESET.Error() + "): " +
				"a refusal (a forwarder that cannot send the alert, such as one behind caddy-l4's tls handler, refuses this way) or a failure; its log names which"}
		}
	}
	switch {
	case rerr != nil:
		return fmt.Errorf("reading from the tunnel: %w", rerr)
	case werr != nil:
		return fmt.Errorf("writing to the tunnel: %w", werr)
	}
	return nil
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
