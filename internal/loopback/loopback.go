// Package loopback builds throwaway loopback TCP connections on raw file
// descriptors, for probing what the kernel allows on an established socket
// (attaching the "tls" ULP). It imports nothing of this module, so both the
// ktls package and its test helpers (internal/kerneltest) can use it.
package loopback

import "golang.org/x/sys/unix"

// WithConn connects a loopback TCP pair on 127.0.0.1, runs f on the
// client end's file descriptor while the connection is ESTABLISHED, and
// closes both ends.
func WithConn(f func(fd int) error) error {
	ln, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(ln)
	if err := unix.Bind(ln, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		return err
	}
	if err := unix.Listen(ln, 1); err != nil {
		return err
	}
	sa, err := unix.Getsockname(ln)
	if err != nil {
		return err
	}
	cl, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(cl)
	if err := unix.Connect(cl, sa); err != nil {
		return err
	}
	// Accept the peer so the pair closes cleanly on both ends.
	if srv, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC); err == nil {
		defer unix.Close(srv)
	}
	return f(cl)
}
