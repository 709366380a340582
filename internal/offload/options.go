package offload

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/logsummary"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// OffloadOptions are the kTLS offload options shared by the layer4 `ktls`
// handler (KTLSHandler) and the `ktls` HTTP listener wrapper
// (ListenerWrapper). Both embed it, so its fields sit at the top level of
// their JSON and of their Caddyfile blocks.
type Options struct {
	// DisableOffload keeps the whole TLS session in userspace (Go's
	// crypto/tls), exactly as on a kernel without kTLS, with everything else
	// unchanged: for side-by-side measurements, and as an escape hatch from
	// a kernel kTLS bug. Connections report the reason "disabled". It cannot
	// be combined with require_offload.
	DisableOffload bool `json:"disable_offload,omitempty"`

	// DisableRX keeps decryption in userspace: the kernel seals outgoing
	// records (TX) while incoming records are decrypted in Go with the
	// session keys. The receiving direction (request bodies in the listener
	// wrapper, client-to-sandbox bytes in the layer4 handler) then costs a
	// copy and the decryption in Go; outgoing bytes still leave through the
	// kernel.
	DisableRX bool `json:"disable_rx,omitempty"`

	// RequireOffload refuses connections that cannot be offloaded (kernel
	// without kTLS, cipher the kernel refuses, TLS 1.0/1.1, bytes buffered
	// past the handshake...) instead of serving them with userspace TLS.
	// A refused connection ends with a TCP reset after its handshake (the
	// session is in userspace TLS: never a close_notify, which would read
	// as a complete stream), is logged at DEBUG and counted in
	// caddy_ktls_connections_closed_total{event="refused"}. On a kernel
	// without kTLS every connection is refused: the configuration still
	// loads (it means the same on every machine), with one WARN per load.
	RequireOffload bool `json:"require_offload,omitempty"`

	// ExpectNoPad sets TLS_RX_EXPECT_NO_PAD on TLS 1.3 connections (Linux
	// 6.0+): the kernel decrypts straight into the reader's buffer. For
	// trusted peers only: a peer that pads its records makes each one
	// decrypt twice. Ignored with disable_rx.
	ExpectNoPad bool `json:"expect_no_pad,omitempty"`

	// TXZeroCopyRO sets TLS_TX_ZEROCOPY_RO (Linux 5.19+): with NIC (device)
	// TLS offload, sendfile pages go to the NIC without a copy. It only
	// matters with sendfile and device offload, and a file that changes while
	// it is being sent makes retransmitted records fail authentication at the
	// peer (a broken connection, never wrong data). The listener wrapper
	// requires `sendfile` with it.
	TXZeroCopyRO bool `json:"tx_zerocopy_ro,omitempty"`

	// KeyUpdateRate is the sustained rate (per second) of TLS control
	// records (TLS 1.3 KeyUpdate messages) a peer may send before it is
	// disconnected. Zero: the ktls package default (10/s).
	KeyUpdateRate float64 `json:"keyupdate_rate,omitempty"`

	// KeyUpdateBurst is the number of KeyUpdate messages allowed in a burst
	// above KeyUpdateRate. Zero: the ktls package default (20).
	KeyUpdateBurst int `json:"keyupdate_burst,omitempty"`

	// KeyRecordLimit is how many TLS records one traffic key may protect,
	// in either direction, before the connection acts (RFC 8446 section
	// 5.5 bounds an AES-GCM key to 2^24.5 full records; the kernel
	// enforces nothing): on TLS 1.3 with a kernel that rekeys (Linux
	// 6.14+) it renews its own key with a KeyUpdate and asks the peer to
	// renew its key; on TLS 1.2, on older kernels, or when the peer does
	// not renew by twice the limit, it ends the connection as a failure
	// (internal_error) before the key goes further, logged at WARN and
	// counted as caddy_ktls_connections_closed_total{event="key-exhausted"}.
	// Zero: 8388608 (2^23); at most 16777216 (2^24).
	KeyRecordLimit uint64 `json:"key_record_limit,omitempty"`

	// HandshakeTimeout bounds the TLS handshake (in the listener wrapper it
	// runs on the first read or write of a connection, never in the accept
	// loop). Default: 10s.
	HandshakeTimeout caddy.Duration `json:"handshake_timeout,omitempty"`
}

// DefaultHandshakeTimeout bounds handshakes when HandshakeTimeout is zero.
const DefaultHandshakeTimeout = 10 * time.Second

// provision validates the options and fills in the defaults, for a module
// that checks them in its Provision. Callers prefix the error with their
// module's name.
func (o *Options) ProvisionOptions() error {
	if err := o.ValidateOptions(); err != nil {
		return err
	}
	o.SetDefaults()
	return nil
}

// SetDefaults fills in the default handshake timeout.
func (o *Options) SetDefaults() {
	if o.HandshakeTimeout == 0 {
		o.HandshakeTimeout = caddy.Duration(DefaultHandshakeTimeout)
	}
}

// validate rejects what no kernel could make work: negative limits, a
// record limit above RFC 8446's, offload off with fallback refuse. Its
// errors name the Caddyfile option and the JSON field, and the fix.
func (o *Options) ValidateOptions() error {
	if o.KeyUpdateRate < 0 || o.KeyUpdateBurst < 0 {
		return fmt.Errorf("%s must not be negative: give a rate per second and a burst above 0, or leave it out (10/s, 20)", Option("keyupdate_rate", "keyupdate_rate, keyupdate_burst"))
	}
	if o.HandshakeTimeout < 0 {
		return fmt.Errorf("%s must not be negative: give a duration such as 10s, or leave it out (10s)", Option("handshake_timeout", "handshake_timeout"))
	}
	if o.KeyRecordLimit > ktls.MaxRecordLimit {
		return fmt.Errorf("%s %d is above %d (2^24): RFC 8446 bounds an AES-GCM key to 2^24.5 records; give at most %d, or leave it out (2^23)",
			Option("key_record_limit", "key_record_limit"), o.KeyRecordLimit, ktls.MaxRecordLimit, ktls.MaxRecordLimit)
	}
	if o.DisableOffload && o.RequireOffload {
		return fmt.Errorf("%s and %s together would refuse every connection: remove one of them",
			Option("offload off", "disable_offload"), Option("fallback refuse", "require_offload"))
	}
	return nil
}

// Option names a configuration option in an error the way both forms of
// configuration spell it: the Caddyfile option, and the JSON field where it
// differs. A load error cannot tell which form the configuration came in.
func Option(caddyfile, json string) string {
	if caddyfile == json {
		return "`" + caddyfile + "`"
	}
	return "`" + caddyfile + "` (JSON " + json + ")"
}

// KTLSOptions converts the options for the ktls engine, with observer as
// its event callback.
func (o *Options) KTLSOptions(observer func(ktls.Event)) ktls.Options {
	return ktls.Options{
		Disable:        o.DisableOffload,
		DisableRX:      o.DisableRX,
		RequireOffload: o.RequireOffload,
		ExpectNoPad:    o.ExpectNoPad,
		TXZeroCopyRO:   o.TXZeroCopyRO,
		KeyUpdateLimit: ktls.Rate{PerSecond: o.KeyUpdateRate, Burst: o.KeyUpdateBurst},
		RecordLimit:    o.KeyRecordLimit,
		Observer:       observer,
	}
}

// Messages of the line logKernel logs.
const (
	KernelAvailableMsg   = "kernel TLS available"
	KernelUnavailableMsg = "kernel TLS unavailable: connections use userspace TLS"
	offloadDisabledMsg   = "kernel TLS offload disabled: connections use userspace TLS"
)

// KernelCanOffload reports whether connections under o can have their TX
// in the kernel: offload is on and the kernel accepts TLS_TX.
func (o *Options) KernelCanOffload() bool {
	if o.DisableOffload {
		return false
	}
	return KernelFeatures(ktls.Probe())["tx"]
}

// LogKernel logs, in one INFO line, what this kernel does for o's
// connections and, when it cannot offload, why and what to do: at a
// module's start, never per connection. fields say where (a server and
// its listener). offloaded says whether the connections' records go to the
// kernel (each may still fall back, counted by reason); the line holds
// only what is true: rx_in_kernel and the kernel's suites only when they
// do.
func (o *Options) LogKernel(logger *zap.Logger, fields ...zap.Field) {
	caps := ktls.Probe()
	fallback := "allow"
	if o.RequireOffload {
		fallback = "refuse"
	}
	fields = append(fields, zap.String("kernel", caps.Kernel), zap.String("fallback", fallback))
	switch {
	case o.DisableOffload:
		// Whatever the kernel can do, no connection is offloaded; the
		// probe result still says whether turning offload on would help.
		logger.Info(offloadDisabledMsg, append(fields, zap.Bool("offloaded", false),
			zap.String("why", "disabled by configuration (offload off)"), zap.Bool("kernel_tls_available", caps.ULP == nil))...)
		return
	case caps.ULP != nil:
		fields = append(fields, zap.Bool("offloaded", false), zap.NamedError("why", caps.ULP),
			zap.String("fix", ProbeHint(caps.Config)), zap.Bool("cap_net_admin", caps.NetAdmin))
		if o.RequireOffload {
			// Not a load error: what a configuration means must not
			// depend on the kernel of the machine that validates it.
			logger.Warn(RefuseAllWarning, fields...)
			return
		}
		logger.Info(KernelUnavailableMsg, fields...)
		return
	}
	var suites []string
	for _, s := range caps.Ciphers {
		if s.TX && (s.RX || o.DisableRX) {
			suites = append(suites, tls.VersionName(s.Version)+" "+s.Name)
		}
	}
	logger.Info(KernelAvailableMsg, append(fields, zap.Bool("offloaded", true), zap.Bool("rx_in_kernel", !o.DisableRX),
		zap.Strings("suites", suites), zap.Bool("rekey", caps.Rekey), zap.Bool("expect_no_pad_supported", caps.ExpectNoPad),
		zap.Bool("tx_zerocopy_ro_supported", caps.TXZeroCopyRO))...)
	if o.ExpectNoPad && !caps.ExpectNoPad {
		logger.Warn("expect_no_pad is set but this kernel does not accept TLS_RX_EXPECT_NO_PAD: TLS 1.3 connections will fail to offload RX")
	}
	if o.TXZeroCopyRO && !caps.TXZeroCopyRO {
		logger.Warn("tx_zerocopy_ro is set but this kernel does not accept TLS_TX_ZEROCOPY_RO: connections will fail to offload")
	}
}

// RefuseAllWarning is what logKernel says, at WARN, for fallback refuse on
// a kernel that cannot offload TLS.
const RefuseAllWarning = "fallback refuse is set but this kernel cannot offload TLS: every connection will be refused (see `caddy ktls probe`)"

// HandshakeFailureReasons are why a TLS handshake failed, as counted in
// caddy_ktls_handshake_failures_total and logged: the reasons a peer that
// may never authenticate can cause, so none of them is worth an ERROR.
var HandshakeFailureReasons = []string{
	"not-tls",                 // the first bytes are no TLS record (plain HTTP, a scanner)
	"no-client-certificate",   // mutual TLS and the client sent no certificate
	"untrusted-certificate",   // the client's certificate chain does not verify (another CA, expired)
	"certificate-not-allowed", // a verifier refused the certificate (not on the leaf allowlist)
	reasonUnknownServerName,   // the client asked for a server name no certificate carries
	"timeout",                 // no complete handshake within handshake_timeout
	ReasonOverloaded,          // shed before the handshake: max_handshakes, or max_scheduling_delay (Shed)
	"closed",                  // the peer closed or reset the connection during the handshake
	"other",                   // any other handshake error (no common version or cipher, a bad message)
}

// ReasonOverloaded is the handshake failure reason of a connection shed
// before its handshake (HandshakeFailureLog.Shed).
const ReasonOverloaded = "overloaded"

// handshakeFailureReason says why a handshake failed with err.
func handshakeFailureReason(err error) string {
	var rhe tls.RecordHeaderError
	var cve *tls.CertificateVerificationError
	switch {
	case errors.As(err, &rhe):
		return "not-tls"
	case strings.Contains(err.Error(), "client didn't provide a certificate"):
		return "no-client-certificate"
	case errors.As(err, &cve):
		return "untrusted-certificate"
	case strings.Contains(err.Error(), "client leaf certificate failed validation"):
		return "certificate-not-allowed"
	case unknownServerName(err):
		return reasonUnknownServerName
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded):
		return "timeout"
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed):
		return "closed"
	}
	return "other"
}

// HandshakeFailureLog counts one module's failed handshakes by reason and
// logs each at DEBUG: anyone who can reach the port can fail a handshake, so
// each one is no WARN or ERROR of its own. A failureSummary WARNs, at most
// once a minute, the failures since its last.
type HandshakeFailureLog struct {
	module  string
	logger  *zap.Logger
	summary *logsummary.FailureSummary
}

// HandshakeFailureSummary is the message of that WARN.
const HandshakeFailureSummary = "TLS handshakes failed"

func NewHandshakeFailureLog(module string, logger *zap.Logger) *HandshakeFailureLog {
	return &HandshakeFailureLog{module: module, logger: logger, summary: logsummary.NewFailureSummary(logger, HandshakeFailureSummary,
		HandshakeFailureReasons, "each at DEBUG; caddy_ktls_handshake_failures_total counts them by reason; "+
			"overloaded: shed before the handshake, max_handshakes were in progress or the scheduling delay was above max_scheduling_delay")}
}

// Shed counts and logs a connection shed before its handshake (ktls.Shed):
// a failed handshake of reason overloaded, as the peer sees it. why is the
// bound that shed it, as log fields.
func (f *HandshakeFailureLog) Shed(remote net.Addr, why ...zap.Field) {
	handshakeFails.Add(FailKey{f.module, ReasonOverloaded})
	handshakeOutcomes.Add(OutcomeKey{f.module, ktls.ReasonHandshakeFailed})
	f.logger.Debug("TLS handshake refused: overloaded", append([]zap.Field{zap.String("reason", ReasonOverloaded),
		zap.Stringer("remote", remote)}, why...)...)
	f.summary.Add(ReasonOverloaded)
}

// Record counts a failed handshake (ev.Offload.Reason is
// ktls.ReasonHandshakeFailed) and logs it.
func (f *HandshakeFailureLog) Record(ev ktls.Event) {
	reason := handshakeFailureReason(ev.Err)
	handshakeFails.Add(FailKey{f.module, reason})
	f.logger.Debug("TLS handshake failed", append([]zap.Field{zap.String("reason", reason), zap.Stringer("remote", ev.Remote), zap.Error(ev.Err)},
		handshakeFailureDetail(reason, ev.Err)...)...)
	f.summary.Add(reason)
}

// AdoptedObserver is the Observer of a session adopted from another
// process (ktls.Adopt, in an upgrade): a session that the layer4 ktls
// handler there made, so its closes count under that module; an event
// with an error is logged at WARN.
func AdoptedObserver(logger *zap.Logger) func(ktls.Event) {
	return func(ev ktls.Event) {
		CountClose(moduleid.L4Handler, ev.Kind)
		if ev.Err != nil {
			logger.Warn("kTLS connection event", zap.String("event", string(ev.Kind)), zap.Stringer("remote", ev.Remote), zap.Error(ev.Err))
		}
	}
}

// LogHandshake logs the outcome of one connection's handshake and offload
// (ktls.EventHandshake) at DEBUG: where each direction's records are
// processed and why, as the kernel reports it.
func LogHandshake(logger *zap.Logger, ev ktls.Event) {
	if ce := logger.Check(zap.DebugLevel, "kernel TLS handshake"); ce != nil {
		ce.Write(zap.Stringer("remote", ev.Remote),
			zap.String("tx", ev.Offload.TX.String()), zap.String("rx", ev.Offload.RX.String()),
			zap.String("reason", string(ev.Offload.Reason)),
			zap.String("version", tls.VersionName(ev.Offload.Version)),
			zap.String("cipher_suite", tls.CipherSuiteName(ev.Offload.CipherSuite)),
			zap.Bool("rx_no_pad", ev.Offload.RXNoPad),
			zap.Error(ev.Err))
	}
}
