package forward

// Reason says why a tunnel was refused. The values are stable strings: they
// appear in logs, metrics labels and the admin API, so they never change
// meaning once released. A refused preamble carries the preamble package's
// own reason unchanged (preamble.Reason: "timeout", "bad-signature", ...);
// the reasons below are the forwarder's: ReasonNoClientCertificate and
// ReasonDraining before the preamble is read, the others after it verified.
type Reason string

const (
	// ReasonNoClientCertificate: Config.RequireClientCertificate is set and
	// the connection did not come with a verified client certificate
	// (Gateway.CertificateVerified): no TLS session, or one in which
	// the client sent no certificate or one that was not verified against
	// a trust pool. Refused before the preamble is read.
	ReasonNoClientCertificate Reason = "no-client-certificate"
	// ReasonTargetDenied: the signed target is not allowed by the target policy.
	ReasonTargetDenied Reason = "target-denied"
	// ReasonDialFailed: the target could not be reached within the dial timeout.
	ReasonDialFailed Reason = "dial-failed"
	// ReasonWakeFailed: the target did not answer and the control plane
	// did not accept the wake of its sandbox (Config.Wake).
	ReasonWakeFailed Reason = "wake-failed"
	// ReasonDraining: the process is exiting and accepts no new tunnels.
	ReasonDraining Reason = "draining"
	// ReasonTunnelLimit: the sandbox already has as many open tunnels as
	// the forwarder allows one sandbox.
	ReasonTunnelLimit Reason = "tunnel-limit"
	// ReasonKeyNotForClient: the frame's key is bound to other clients
	// (Config.KeyClients) than the certificate the connection arrived with.
	ReasonKeyNotForClient Reason = "key-not-for-client"
	// ReasonSandboxClosed: Registry.Close closed the sandbox and refuses
	// new tunnels to it for a while (CloseRequest.RefuseFor).
	ReasonSandboxClosed Reason = "sandbox-closed"
	// ReasonOverloaded: Config.MaxDials tunnels were dialing their targets
	// (or waking them) already. Refused before the dial; the gateway may try
	// again at once.
	ReasonOverloaded Reason = "overloaded"
	// ReasonGatewayGone: the gateway left (its connection reset, or ended
	// without close_notify, with nothing past the preamble) after the
	// preamble verified, before the target was dialed or its sandbox
	// woken: nothing was dialed or woken, for nobody waits.
	ReasonGatewayGone Reason = "gateway-gone"
)

// The forwarder's own reasons, in the order Reasons returns them.
var allReasons = []Reason{ReasonTargetDenied, ReasonDialFailed, ReasonWakeFailed, ReasonDraining, ReasonTunnelLimit, ReasonKeyNotForClient, ReasonNoClientCertificate, ReasonSandboxClosed, ReasonOverloaded, ReasonGatewayGone}

// Reasons returns every rejection reason this package raises itself (a
// refused preamble's reasons are preamble.Reasons), so that metrics can
// pre-register one series per reason.
func Reasons() []Reason {
	return append([]Reason(nil), allReasons...)
}

// RefusalError is returned by Forwarder.Serve when a tunnel is refused before
// any client byte reaches the target.
type RefusalError struct {
	Reason Reason
	Err    error
}

func (e *RefusalError) Error() string {
	return "tunnel rejected (" + string(e.Reason) + "): " + e.Err.Error()
}

func (e *RefusalError) Unwrap() error { return e.Err }
