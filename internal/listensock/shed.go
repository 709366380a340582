package listensock

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// Shedding at accept. A handler that sheds connections before their TLS
// handshake while the process is overloaded (the layer4 ktls handler's
// max_handshakes and max_scheduling_delay) registers, with Serves, each
// local address its connections arrive at. Before a tcp-retry or
// tcp-handoff listener hands a connection to caddy-l4, it asks every
// handler registered for its address; when each would shed a connection
// arriving now, the listener sheds it in the handler's name (the same
// alert, counted and logged by the handler), and caddy-l4 never sees it:
// no goroutine, no per-connection state, no route. A tcp-handoff listener
// does not even make it a Go connection (accept4, the alert, close).
//
// A listener sheds only for handlers that its connections have reached
// under the configurations loaded now; a route on the same address whose
// connections reach no ktls handler is shed with the others: give it an
// address of its own.

// A Shedder is a handler that sheds connections before their handshake.
type Shedder interface {
	// ShedNow returns why a connection that arrived now would be shed, as
	// log fields; nil admits it.
	ShedNow() []zap.Field
	// Shed counts and logs a connection that a listener shed in the
	// handler's name, with the fields ShedNow gave.
	Shed(remote net.Addr, why []zap.Field)
}

type shedEntry struct {
	addr netip.AddrPort // a local address, unmapped
	s    Shedder
	id   uint64
}

var (
	shedMu     sync.Mutex // serializes writers of shedders
	shedNextID uint64
	// shedders is the registered handlers: a slice replaced, never
	// changed, so that a listener reads it without a lock.
	shedders atomic.Pointer[[]shedEntry]
)

// Serves registers that s handles connections that arrive at local,
// until forget is called (when s's configuration is unloaded).
func Serves(local netip.AddrPort, s Shedder) (forget func()) {
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	shedMu.Lock()
	defer shedMu.Unlock()
	shedNextID++
	id := shedNextID
	var all []shedEntry
	if p := shedders.Load(); p != nil {
		all = slices.Clone(*p)
	}
	all = append(all, shedEntry{addr: local, s: s, id: id})
	shedders.Store(&all)
	return func() {
		shedMu.Lock()
		defer shedMu.Unlock()
		all := slices.DeleteFunc(slices.Clone(*shedders.Load()), func(e shedEntry) bool { return e.id == id })
		shedders.Store(&all)
	}
}

// shedFor returns the handler in whose name a listener bound to bound (in
// canonical form: a wildcard is IPv6's) sheds a connection arriving now,
// and why; nil when no handler is registered for the address, or one of
// them would admit it.
func shedFor(bound netip.AddrPort) (Shedder, []zap.Field) {
	p := shedders.Load()
	if p == nil {
		return nil, nil
	}
	var (
		first Shedder
		why   []zap.Field
	)
	for _, e := range *p {
		if e.addr.Port() != bound.Port() || !bound.Addr().IsUnspecified() && e.addr.Addr() != bound.Addr() {
			continue
		}
		w := e.s.ShedNow()
		if w == nil {
			return nil, nil
		}
		if first == nil {
			first, why = e.s, w
		}
	}
	return first, why
}

// canonicalAddr is addr's key form for shedFor.
func canonicalAddr(addr net.Addr) netip.AddrPort {
	a, ok := addr.(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}
	}
	ap := a.AddrPort()
	return netip.AddrPortFrom(canonicalIP(ap.Addr()), ap.Port())
}

// errShed stands for a connection that a listener accepted and shed.
var errShed = errors.New("listensock: connection shed")

// shedConn sheds c, accepted by a listener bound to bound, if every
// handler registered for the address would; it reports whether it did.
func shedConn(bound netip.AddrPort, c net.Conn) bool {
	s, why := shedFor(bound)
	if s == nil {
		return false
	}
	ktls.Shed(c)
	s.Shed(c.RemoteAddr(), why)
	return true
}

// shedRaw sheds, with accept4(2) on raw, a descriptor of a listening
// socket bound to bound, the connections that arrive while every handler
// registered for the address would shed them. It returns when one arrives
// that a handler would admit (nil, with that connection still queued for
// Go's accept), when halted is set (os.ErrDeadlineExceeded, as from Go's
// accept after a deadline in the past on raw), or with accept's error.
func shedRaw(raw *os.File, bound netip.AddrPort, halted *atomic.Bool) error {
	rc, err := raw.SyscallConn()
	if err != nil {
		return err
	}
	var aerr error
	err = rc.Read(func(fd uintptr) bool {
		for !halted.Load() {
			h, why := shedFor(bound)
			if h == nil {
				return true
			}
			nfd, sa, err := unix.Accept4(int(fd), unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
			switch err {
			case nil:
			case unix.EAGAIN:
				return false // wait for the next connection
			case unix.EINTR, unix.ECONNABORTED:
				continue // as Go's accept: the next one
			default:
				aerr = os.NewSyscallError("accept4", err)
				return true
			}
			ktls.ShedFD(nfd)
			h.Shed(sockaddrAddr(sa), why)
		}
		aerr = os.ErrDeadlineExceeded
		return true
	})
	if err != nil {
		return err
	}
	return aerr
}

// sockaddrAddr is a peer's address from accept4(2).
func sockaddrAddr(sa unix.Sockaddr) net.Addr {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return net.TCPAddrFromAddrPort(netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port)))
	case *unix.SockaddrInet6:
		return net.TCPAddrFromAddrPort(netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), uint16(sa.Port)))
	}
	return &net.TCPAddr{}
}
