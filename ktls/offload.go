package ktls

import "fmt"

// Offload is what happened to a connection after its handshake. TX and RX
// come from the kernel's sock_diag answer (INET_DIAG_ULP_INFO); when that
// cannot be read (no inet_diag/tcp_diag module, or no CAP_NET_ADMIN) an
// installed direction is reported as ModeSW, the mode every kernel starts
// in and falls back to when a device refuses the connection.
type Offload struct {
	TX, RX      Mode
	Reason      Reason
	Version     uint16
	CipherSuite uint16
	// RXNoPad: TLS_RX_EXPECT_NO_PAD is in effect, as the kernel reports it
	// (sock_diag; false where the kernel withholds the details).
	RXNoPad bool
}

// OffloadError is returned by the handshake when Options.RequireOffload is
// set and the connection cannot be offloaded, and by the connection when a
// failure after TX was installed closed it.
type OffloadError struct {
	Reason Reason
	Err    error
}

func (e *OffloadError) Error() string {
	if e.Err == nil {
		return "ktls: not offloaded: " + string(e.Reason)
	}
	return fmt.Sprintf("ktls: not offloaded: %s: %v", e.Reason, e.Err)
}

func (e *OffloadError) Unwrap() error { return e.Err }
