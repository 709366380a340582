package gateway

import (
	"context"
	"fmt"
	"net"

	"github.com/ktlsingress/caddy-ktls/splice"
)

// Relay carries a user's connection through tunnel, a connection Dial
// returned, until both directions end, and closes both. buffered are
// bytes already read from user (a layer that read ahead), sent first.
// Where user's receive side and tunnel's send side are in the kernel (a
// kTLS session on each side), and the other way round, the bytes move
// with splice(2) and never enter userspace: the kernel opens the user's
// records and seals the forwarder's. Direction AToB is user → sandbox.
//
// The ends travel on: an orderly end on one side half-closes the other; a
// forwarder's refusal (EndRefused, before the sandbox sent a byte) ends
// user as refused too (its Refuse: access_denied on a kTLS session), as
// does the forwarder's refusal of the gateway's certificate
// (CertificateAlert; with TLS 1.3 it arrives after Dial returned), and
// any failure ends both sides as failures. The forwarder ends every tunnel
// it ends in order with close_notify, so the tunnel's end without one (a
// forwarder that died, or a reset the kernel reported as an end) is a
// failure too, never an orderly end for the user. opts.Refused and
// opts.RequireCloseNotify[BToA] are set here.
func Relay(ctx context.Context, user net.Conn, buffered []byte, tunnel net.Conn, opts splice.Options) (splice.Stats, error) {
	if len(buffered) > 0 {
		n, err := tunnel.Write(buffered)
		if opts.OnBytes != nil && n > 0 {
			opts.OnBytes(splice.AToB, n)
		}
		if err != nil {
			splice.Abort(user)
			splice.Abort(tunnel)
			st := splice.Stats{}
			st.AToB.Bytes, st.AToB.CopyBytes = int64(n), int64(n)
			return st, fmt.Errorf("gateway: bytes buffered before the tunnel: %w", err)
		}
	}
	opts.Refused = func(err error) bool {
		_, cert := CertificateAlert(err)
		return cert || Refused(err)
	}
	opts.RequireCloseNotify[splice.BToA] = true
	st, err := splice.Run(ctx, user, tunnel, opts)
	if len(buffered) > 0 {
		st.AToB.Bytes += int64(len(buffered))
		st.AToB.CopyBytes += int64(len(buffered))
	}
	return st, err
}

// RelayEnd is the End of a relay that returned st and err: how the
// forwarder's side ended.
func RelayEnd(st splice.Stats, err error) End {
	if err == nil {
		return EndClosed
	}
	if e := st.BToA.Err; e != nil && Refused(e) && st.BToA.Bytes == 0 {
		return EndRefused
	}
	return EndFailed
}
