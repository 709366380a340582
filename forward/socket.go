package forward

import (
	"context"
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// socketOptions are the TCP liveness settings applied to both sockets of a
// tunnel. After the preamble a tunnel has no read or idle deadline (a
// sandbox session may legitimately sit idle for hours; MaxTunnelLifetime,
// when set, bounds only its total age), so dead peers are found by the
// kernel: keepalive probes for a silent peer, TCP_USER_TIMEOUT for
// unacknowledged data.
type socketOptions struct {
	keepAlive   time.Duration
	userTimeout time.Duration
}

func (o socketOptions) keepAliveConfig() net.KeepAliveConfig {
	return net.KeepAliveConfig{Enable: true, Idle: o.keepAlive, Interval: o.keepAlive, Count: 3}
}

// dial connects to target with the liveness options already set on the
// socket before connect.
func (o socketOptions) dial(ctx context.Context, target string, timeout time.Duration) (*net.TCPConn, error) {
	d := net.Dialer{
		Timeout:         timeout,
		KeepAliveConfig: o.keepAliveConfig(),
		Control: func(_, _ string, rc syscall.RawConn) error {
			return o.setUserTimeout(rc)
		},
	}
	c, err := d.DialContext(ctx, "tcp", target)
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

func (o socketOptions) setUserTimeout(rc syscall.RawConn) error {
	if o.userTimeout <= 0 {
		return nil
	}
	var serr error
	err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(o.userTimeout/time.Millisecond))
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("set TCP_USER_TIMEOUT: %w", err)
	}
	return nil
}

// applyToClient sets the liveness options on the kernel socket under c,
// reached through syscall.Conn (*ktls.Conn and *net.TCPConn implement it).
// A conn without one (a test pipe) is left alone.
func (o socketOptions) applyToClient(c net.Conn) error {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	secs := max(int(o.keepAlive/time.Second), 1)
	var serr error
	err = rc.Control(func(fd uintptr) {
		for _, opt := range []struct{ level, name, value int }{
			{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
			{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, secs},
			{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, secs},
			{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 3},
		} {
			if serr = unix.SetsockoptInt(int(fd), opt.level, opt.name, opt.value); serr != nil {
				return
			}
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("set client keepalive: %w", err)
	}
	return o.setUserTimeout(rc)
}
