// Package listensock holds caddy-ktls's listener networks for Caddy
// servers (caddy-l4's "listen" addresses): `tcp-retry`, plain TCP whose
// Accept rides out a shortage of descriptors or memory, and `tcp-handoff`,
// which does the same on a listening socket that outlives config reloads
// and can be handed to the process that replaces this one. Both shed, in
// the ktls handlers' name, the connections those handlers would shed,
// before caddy-l4 accepts them (shed.go).
//
// # tcp-handoff
//
// Caddy on Linux binds a new SO_REUSEPORT socket for a "tcp" address at
// every config load: during a reload two sockets split the incoming
// connections, and those queued on the old one are reset when it closes.
// A `tcp-handoff/<host>:<port>` address instead has one socket per address
// in the process, bound without SO_REUSEPORT, which every configuration
// that listens on the address shares: a reload's new configuration takes
// it before the old one lets it go, so it stays open, and the socket
// closes when the last configuration that listens on it is unloaded.
//
// For a binary upgrade, the old process passes Export's descriptors to the
// new one, which Adopts each under its address before its configuration
// loads; its `tcp-handoff` listens then take the adopted socket instead of
// binding. Both processes accept from the one kernel queue until the old
// one calls StopAccepting: from then on only the new process accepts, and
// a connection the kernel queued is accepted by exactly one of them.
//
// The address is the socket's key: the host must be an IP address or empty
// (a name could resolve to another address in the adopting process), and
// it is written in one canonical form (Exported.Address): the IP as
// netip writes it, IPv4-mapped IPv6 addresses as IPv4, and every wildcard
// (no host, 0.0.0.0, ::) as [::], since Go binds one dual-stack socket for
// each of them. Port 0 binds a new socket on a port the kernel picks,
// registered under the address it got. A port range is a socket per port.
//
// Each listener that Caddy's configuration holds is a wrapper of the
// shared socket. One goroutine per socket accepts, and only while some
// wrapper's Accept waits; it hands each connection to the longest-waiting
// Accept. Closing a wrapper ends its own Accepts only (net.ErrClosed);
// when no Accept is left waiting, a deadline in the past wakes the
// accepting goroutine, and connections stay in the kernel's queue. A
// connection accepted just as the last waiting Accept went away is kept
// for the next Accept of any wrapper of the socket, including one of the
// next configuration, and after StopAccepting too. Only when the socket itself closes,
// its last wrapper closed, are such connections closed, with a warning,
// as the kernel resets the connections still queued on a socket it
// closes.
package listensock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Network names the listener network of handed-over sockets, as in a
// caddy-l4 server's `"listen": ["tcp-handoff/127.0.0.1:9443"]`.
const Network = "tcp-handoff"

// Exported is a listening socket offered to another process.
type Exported struct {
	// Address is the socket's key, in the package's canonical form
	// ("127.0.0.1:9443", "[::]:9443" for a wildcard): pass it to Adopt.
	Address string
	// File is a duplicate of the socket's descriptor; the caller closes
	// it. It shares the open file, and so its O_NONBLOCK flag, with every
	// holder of the socket: its Fd method, which makes the file blocking,
	// would leave this process's accepts blocking a thread that no
	// deadline wakes. Pass it with internal/fdpass, which reads the
	// descriptor without Fd.
	File *os.File
}

var (
	// mu guards sockets, stopped, and every socket's and wrapper's state.
	mu sync.Mutex
	// sockets holds the process's sockets by address: those some wrapper
	// holds, and those adopted and not yet listened on.
	sockets = map[string]*socket{}
	// stopped is set by StopAccepting, cleared by ResumeAccepting: the
	// process hands its sockets over, and opens or takes no more.
	stopped bool
	// paused is set by StopAccepting and PauseAccepting, cleared by
	// ResumeAccepting: no accept(2) runs.
	paused bool
	// idle is signaled on mu when a socket's goroutine leaves accept(2).
	idle = sync.NewCond(&mu)
)

// aLongTimeAgo is a deadline in the past: it ends a blocked Accept.
var aLongTimeAgo = time.Unix(1, 0)

// A socket is one listening socket of the process and its accepting
// goroutine.
type socket struct {
	addr  string // the key in sockets
	bound netip.AddrPort
	ln    *net.TCPListener
	// raw is the process's second descriptor of the socket, opened at
	// the first shed, on which shedRaw accepts: Go's listener offers no
	// accept(2) of its own descriptor without making a connection of it.
	raw *os.File
	// rawWarned: opening raw failed, and said so once (it is tried again
	// at each shed; meanwhile the listener sheds after Go's accept).
	rawWarned bool
	// halted is set with a deadline in the past on ln and raw: shedRaw
	// accepts no more.
	halted atomic.Bool
	// accept is ln.AcceptTCP, as a net.Conn; a test injects errors.
	accept func() (net.Conn, error)
	logger *zap.Logger
	refs   int // open wrappers

	waiters []*waiter  // Accepts waiting, longest first
	pending []net.Conn // accepted while no Accept waited (never both non-empty)

	wake      *sync.Cond    // on mu: a waiter came, or quit
	quit      bool          // the accepting goroutine must return
	done      chan struct{} // closed with quit: ends a backoff
	running   bool          // the accepting goroutine started
	accepting bool          // it is in accept(2), without mu
	exited    chan struct{} // closed when it returns
}

// A waiter is one Accept call waiting for a connection.
type waiter struct {
	l  *listener
	ch chan result // buffered: sent once, under mu
}

type result struct {
	c   net.Conn
	err error
}

func newSocket(ln *net.TCPListener, addr string, logger *zap.Logger) *socket {
	s := &socket{addr: addr, ln: ln, logger: logger, done: make(chan struct{}), exited: make(chan struct{})}
	s.bound, _ = netip.ParseAddrPort(addr)
	s.accept = func() (net.Conn, error) { return s.ln.Accept() }
	s.wake = sync.NewCond(&mu)
	return s
}

// listen is the tcp-handoff network's ListenerFunc.
func listen(ctx context.Context, _, host, portRange string, portOffset uint, cfg net.ListenConfig) (any, error) {
	na, err := caddy.ParseNetworkAddress(caddy.JoinNetworkAddress("tcp", host, portRange))
	if err != nil {
		return nil, fmt.Errorf("%s/%s: %w", Network, net.JoinHostPort(host, portRange), err)
	}
	hostport := na.JoinHostPort(portOffset)
	where := Network + "/" + hostport
	addr, port, err := canonical(hostport)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	logger := contextLogger(ctx)
	if err := TakeOver(); err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}

	mu.Lock()
	defer mu.Unlock()
	if stopped {
		return nil, fmt.Errorf("%s: this process has handed its listening sockets to another process (StopAccepting) and opens no more; load this configuration in the new process", where)
	}
	s := sockets[addr]
	if port == 0 || s == nil {
		ln, err := bind(ctx, cfg, hostport)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if port == 0 {
			addr, _, _ = canonical(ln.Addr().String())
			if sockets[addr] != nil {
				ln.Close()
				return nil, fmt.Errorf("%s: bound %s, which this process holds already", where, addr)
			}
		}
		s = newSocket(ln, addr, logger)
		sockets[addr] = s
	}
	s.logger = logger // the newest configuration's
	s.refs++
	if !s.running {
		s.running = true
		go s.loop()
	}
	return &listener{s: s}, nil
}

// bind opens a listening socket with SO_REUSEPORT off, so that a second
// socket of the address, in this process or another, fails with
// EADDRINUSE.
func bind(ctx context.Context, cfg net.ListenConfig, hostport string) (*net.TCPListener, error) {
	control := cfg.Control
	cfg.Control = func(network, address string, c syscall.RawConn) error {
		if control != nil {
			if err := control(network, address, c); err != nil {
				return err
			}
		}
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 0)
		}); err != nil {
			return err
		}
		if serr != nil {
			return os.NewSyscallError("setsockopt SO_REUSEPORT", serr)
		}
		return nil
	}
	ln, err := cfg.Listen(ctx, "tcp", hostport)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			return nil, fmt.Errorf("%w (another socket holds the address: tcp-handoff never shares a port through SO_REUSEPORT; a process that replaces another adopts its socket instead)", err)
		}
		return nil, err
	}
	return ln.(*net.TCPListener), nil
}

// canonical returns the key of a host:port address (see the package
// documentation) and its port. A host that is not an IP address is an
// error.
func canonical(hostport string) (string, uint16, error) {
	host, p, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.ParseUint(p, 10, 16)
	if err != nil {
		return "", 0, fmt.Errorf("port %q: want a number from 0 to 65535", p)
	}
	ip := netip.IPv6Unspecified()
	if host != "" {
		if ip, err = netip.ParseAddr(host); err != nil {
			return "", 0, fmt.Errorf("host %q is not an IP address: a socket is handed over by its address, and a name could resolve to another one in the process that adopts it; listen on an IP address, or on every address (no host)", host)
		}
		ip = canonicalIP(ip)
	}
	return netip.AddrPortFrom(ip, uint16(port)).String(), uint16(port), nil
}

// canonicalIP is ip in the form of a socket's key: IPv4-mapped IPv6 as
// IPv4, and every wildcard as IPv6's.
func canonicalIP(ip netip.Addr) netip.Addr {
	if ip = ip.Unmap(); ip.IsUnspecified() {
		return netip.IPv6Unspecified()
	}
	return ip
}

// loop accepts connections on s while some Accept waits, and hands each
// to the longest-waiting one.
func (s *socket) loop() {
	defer close(s.exited)
	var b backoff
	mu.Lock()
	defer mu.Unlock()
	for {
		for (len(s.waiters) == 0 || paused) && !s.quit {
			s.wake.Wait()
		}
		if s.quit {
			return
		}
		// Whoever leaves no Accept waiting, or stops accepting, sets a
		// past deadline, under mu; this one is cleared only with an
		// Accept waiting and accepting on.
		s.setDeadline(time.Time{})
		accept, logger := s.accept, s.logger
		shedding := false
		if h, _ := shedFor(s.bound); h != nil {
			if s.raw == nil {
				if f, err := s.ln.File(); err == nil {
					s.raw = f
				} else if !s.rawWarned {
					s.rawWarned = true
					logger.Warn("cannot shed connections below Go's accept: the listener sheds them after it", zap.String("address", s.addr), zap.Error(err))
				}
			}
			shedding = s.raw != nil
		}
		s.accepting = true
		mu.Unlock()
		var (
			c   net.Conn
			err error
		)
		if shedding {
			err = shedRaw(s.raw, s.bound, &s.halted)
		}
		if err == nil {
			c, err = accept()
			if err == nil && shedConn(s.bound, c) {
				c, err = nil, errShed
			}
		}
		mu.Lock()
		s.accepting = false
		idle.Broadcast()
		switch {
		case err == nil:
			b = backoff{}
			s.deliver(result{c: c})
		case errors.Is(err, os.ErrDeadlineExceeded):
			// Woken: no Accept waits any more, or quit.
		case err == errShed:
			// Shed in a handler's name: accept the next.
		default:
			if delay, ok := b.next(logger, s.ln.Addr(), err); ok {
				mu.Unlock()
				t := time.NewTimer(delay)
				select {
				case <-t.C:
				case <-s.done:
					t.Stop()
				}
				mu.Lock()
				continue
			}
			// Any other error is the caller's, as from a plain listener.
			if len(s.waiters) > 0 {
				s.deliver(result{err: err})
			} else {
				logger.Warn("accept failed", zap.Stringer("address", s.ln.Addr()), zap.Error(err))
			}
		}
	}
}

// deliver hands r to the longest-waiting Accept; a connection that no
// Accept waits for is kept for the next. Called with mu held.
func (s *socket) deliver(r result) {
	if len(s.waiters) > 0 {
		w := s.waiters[0]
		s.waiters = s.waiters[1:]
		w.ch <- r
		return
	}
	if r.c != nil {
		s.pending = append(s.pending, r.c)
	}
}

// stop makes s's goroutine return. Called with mu held.
func (s *socket) stop() {
	if s.quit {
		return
	}
	s.quit = true
	close(s.done)
	s.setDeadline(aLongTimeAgo)
	s.wake.Broadcast()
}

// A listener is one configuration's wrapper of a socket.
type listener struct {
	s      *socket
	closed bool // under mu
}

func (l *listener) Addr() net.Addr { return l.s.ln.Addr() }

func (l *listener) errClosed(op string) error {
	return &net.OpError{Op: op, Net: "tcp", Addr: l.s.ln.Addr(), Err: net.ErrClosed}
}

// Accept returns the next connection of the socket. After Close, or once
// the process stopped accepting and no connection accepted before is left,
// it returns net.ErrClosed.
func (l *listener) Accept() (net.Conn, error) {
	mu.Lock()
	s := l.s
	if l.closed {
		mu.Unlock()
		return nil, l.errClosed("accept")
	}
	if len(s.pending) > 0 {
		c := s.pending[0]
		s.pending = s.pending[1:]
		mu.Unlock()
		return c, nil
	}
	if s.quit {
		mu.Unlock()
		return nil, l.errClosed("accept")
	}
	w := &waiter{l: l, ch: make(chan result, 1)}
	s.waiters = append(s.waiters, w)
	s.wake.Signal()
	mu.Unlock()
	r := <-w.ch
	return r.c, r.err
}

// Close ends l's Accepts, and closes the socket if l was its last
// wrapper.
func (l *listener) Close() error {
	mu.Lock()
	if l.closed {
		mu.Unlock()
		return l.errClosed("close")
	}
	l.closed = true
	s := l.s
	s.waiters = slices.DeleteFunc(s.waiters, func(w *waiter) bool {
		if w.l != l {
			return false
		}
		w.ch <- result{err: l.errClosed("accept")}
		return true
	})
	if len(s.waiters) == 0 {
		s.setDeadline(aLongTimeAgo)
	}
	if s.refs--; s.refs > 0 {
		mu.Unlock()
		return nil
	}
	delete(sockets, s.addr)
	s.stop()
	mu.Unlock()
	return s.close()
}

// close closes s, which no wrapper holds any more, once its goroutine
// returned. Closing this process's descriptor leaves the socket open in
// another process that holds one (close(2), never shutdown(2), which would
// end the socket for every holder).
func (s *socket) close() error {
	<-s.exited
	mu.Lock()
	pending := s.pending
	s.pending = nil
	logger := s.logger
	mu.Unlock()
	if len(pending) > 0 {
		logger.Warn("closing connections accepted after the last Accept of the socket ended",
			zap.String("address", s.addr), zap.Int("connections", len(pending)))
		for _, c := range pending {
			c.Close()
		}
	}
	if s.raw != nil {
		s.raw.Close()
	}
	return s.ln.Close()
}

// setDeadline sets t as the deadline of s's accepts: ln's and raw's. A
// deadline in the past also halts shedRaw between two accepts. Called
// with mu held.
func (s *socket) setDeadline(t time.Time) {
	s.halted.Store(!t.IsZero())
	s.ln.SetDeadline(t)
	if s.raw != nil {
		s.raw.SetReadDeadline(t)
	}
}

// Export returns a duplicate of every tcp-handoff listening socket this
// process holds: those open in at least one loaded configuration, and
// those adopted and not listened on yet (else the process that adopts
// them from this one could not bind their addresses).
func Export() ([]Exported, error) {
	mu.Lock()
	defer mu.Unlock()
	addrs := make([]string, 0, len(sockets))
	for a := range sockets {
		addrs = append(addrs, a)
	}
	slices.Sort(addrs)
	var out []Exported
	for _, a := range addrs {
		f, err := sockets[a].ln.File()
		if err != nil {
			for _, e := range out {
				e.File.Close()
			}
			return nil, fmt.Errorf("listensock: export %s: %w", a, err)
		}
		out = append(out, Exported{Address: a, File: f})
	}
	return out, nil
}

// Adopt registers a listening socket received from the old process under
// address, before this process's configuration listens: the next
// tcp-handoff listen of that address uses it (a duplicate; the caller
// closes f) instead of binding. It refuses f unless it is a listening TCP
// socket bound to address. An adopted socket that no configuration
// listens on stays registered, and exported, until the process exits.
// Adopt of an address this process holds already is an error.
func Adopt(address string, f *os.File) error {
	key, port, err := canonical(address)
	if err != nil {
		return fmt.Errorf("listensock: adopt %s: %w", address, err)
	}
	if port == 0 {
		return fmt.Errorf("listensock: adopt %s: port 0 names no socket; give the address Export returned", address)
	}
	if err := checkListening(f, key); err != nil {
		return fmt.Errorf("listensock: adopt %s: %w", address, err)
	}
	fl, err := net.FileListener(f)
	if err != nil {
		return fmt.Errorf("listensock: adopt %s: %w", address, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if stopped {
		fl.Close()
		return fmt.Errorf("listensock: adopt %s: this process has stopped accepting (StopAccepting) and takes no sockets", address)
	}
	if sockets[key] != nil {
		fl.Close()
		return fmt.Errorf("listensock: adopt %s: this process holds a socket of %s already (bound or adopted before); adopt each address once, before the configuration loads", address, key)
	}
	sockets[key] = newSocket(fl.(*net.TCPListener), key, caddy.Log().Named("accept"))
	return nil
}

// checkListening returns an error unless f is a listening TCP socket whose
// local address has the key addr.
func checkListening(f *os.File, addr string) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var domain, typ, proto, listening int
	var local unix.Sockaddr
	var serr error
	err = rc.Control(func(fd uintptr) {
		get := func(opt int) int {
			v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, opt)
			if serr == nil && err != nil {
				serr = err
			}
			return v
		}
		if domain = get(unix.SO_DOMAIN); serr != nil {
			return
		}
		typ, proto, listening = get(unix.SO_TYPE), get(unix.SO_PROTOCOL), get(unix.SO_ACCEPTCONN)
		if serr == nil {
			local, serr = unix.Getsockname(int(fd))
		}
	})
	if err != nil {
		return err
	}
	switch {
	case errors.Is(serr, unix.ENOTSOCK):
		return fmt.Errorf("%s is not a socket", f.Name())
	case serr != nil:
		return fmt.Errorf("%s: %w", f.Name(), serr)
	case domain != unix.AF_INET && domain != unix.AF_INET6:
		return fmt.Errorf("%s is not an IP socket (address family %d)", f.Name(), domain)
	case typ != unix.SOCK_STREAM || !tcpProtocol(proto):
		what := fmt.Sprintf("socket type %d, protocol %d", typ, proto)
		if typ == unix.SOCK_DGRAM {
			what = "a UDP socket"
		}
		return fmt.Errorf("%s is %s, not TCP", f.Name(), what)
	case listening == 0:
		return fmt.Errorf("%s is a TCP socket that does not listen (a connection, or never passed to listen(2))", f.Name())
	}
	got, ok := sockaddrAddrPort(local)
	if !ok {
		return fmt.Errorf("%s has local address %T, not an IP one", f.Name(), local)
	}
	key, _, _ := canonical(got.String())
	if key != addr {
		return fmt.Errorf("%s is bound to %s, not to %s: pass each socket under the address Export gave it", f.Name(), key, addr)
	}
	return nil
}

// tcpProtocol reports whether proto, a socket's SO_PROTOCOL, is TCP's. Go
// listens with MPTCP where the kernel has it (net.ListenConfig's default
// since Go 1.24): SO_PROTOCOL then says IPPROTO_MPTCP, of the listener and
// of a connection whose client spoke MPTCP. A TCP socket all the same.
func tcpProtocol(proto int) bool {
	return proto == unix.IPPROTO_TCP || proto == unix.IPPROTO_MPTCP
}

// sockaddrAddrPort returns an IP socket address as a netip.AddrPort, an
// IPv6 one with its zone; false for another family.
func sockaddrAddrPort(sa unix.Sockaddr) (netip.AddrPort, bool) {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port)), true
	case *unix.SockaddrInet6:
		ip := netip.AddrFrom16(sa.Addr)
		if sa.ZoneId != 0 {
			if ifi, err := net.InterfaceByIndex(int(sa.ZoneId)); err == nil {
				ip = ip.WithZone(ifi.Name)
			} else {
				ip = ip.WithZone(strconv.Itoa(int(sa.ZoneId)))
			}
		}
		return netip.AddrPortFrom(ip, uint16(sa.Port)), true
	}
	return netip.AddrPort{}, false
}

// A process that takes over from a running one (an upgrade) adopts its
// sockets before it binds any: BeforeFirstListen names what does that,
// and it runs at the first listen of a tcp-handoff address, or at
// TakeOver, whichever comes first. A configuration that is provisioned and
// never started (caddy validate) listens on nothing and takes nothing.
var (
	takeoverMu sync.Mutex
	takeover   func() error
)

// BeforeFirstListen sets f to run once, before this process's first
// tcp-handoff listen (TakeOver). A listen whose f failed fails with its
// error.
func BeforeFirstListen(f func() error) {
	takeoverMu.Lock()
	defer takeoverMu.Unlock()
	takeover = f
}

// TakeOver runs what BeforeFirstListen set, unless it ran already, and
// returns its error; later calls return nil. Listens wait for it.
func TakeOver() error {
	takeoverMu.Lock()
	defer takeoverMu.Unlock()
	f := takeover
	takeover = nil
	if f == nil {
		return nil
	}
	return f()
}

// StopAccepting makes every tcp-handoff listener of this process stop
// accepting: it returns once no accept(2) of this process is in progress,
// and from then on the kernel's queue is the other process's. Waiting and
// later Accepts wait (a connection accepted before is still returned);
// the sockets stay open. ResumeAccepting undoes it (the handoff failed);
// closing the listeners (the process exits) ends their Accepts. Listens
// and Adopt fail meanwhile: the process is handing over. Idempotent.
func StopAccepting() {
	mu.Lock()
	defer mu.Unlock()
	stopped = true
	if stoppedAddrs == nil {
		for _, s := range sockets {
			a := s.ln.Addr().(*net.TCPAddr).AddrPort()
			stoppedAddrs = append(stoppedAddrs, netip.AddrPortFrom(a.Addr().Unmap(), a.Port()))
		}
	}
	pause()
}

// PauseAccepting is StopAccepting for the process that takes the sockets
// over: its configuration listens on them, and its Accepts wait until
// ResumeAccepting, once it holds the state its connections need.
func PauseAccepting() {
	mu.Lock()
	defer mu.Unlock()
	pause()
}

// pause stops every accept(2) and waits until none runs. Called with mu
// held.
func pause() {
	paused = true
	for _, s := range sockets {
		s.setDeadline(aLongTimeAgo)
	}
	for anyAccepting() {
		idle.Wait()
	}
}

// anyAccepting reports whether a socket's goroutine is in accept(2).
// Called with mu held.
func anyAccepting() bool {
	for _, s := range sockets {
		if s.accepting {
			return true
		}
	}
	return false
}

// ResumeAccepting undoes StopAccepting and PauseAccepting: the Accepts
// waiting get connections again. Idempotent.
func ResumeAccepting() {
	mu.Lock()
	defer mu.Unlock()
	stopped, paused = false, false
	stoppedAddrs = nil
	for _, s := range sockets {
		s.wake.Broadcast()
	}
}

// stoppedAddrs are the local addresses of the sockets StopAccepting stopped,
// until ResumeAccepting: Held counts the connections accepted from them.
var stoppedAddrs []netip.AddrPort

// Held returns how many connections this process holds that it accepted
// from the sockets StopAccepting stopped: in caddy-l4's matching, in a
// TLS handshake, before or in their tunnel. It reads the kernel's view,
// every TCP socket of the process (/proc/self/fd) whose local address is
// one of theirs and that does not listen, so a connection counts from its
// accept until its last descriptor in this process closes, whichever
// handler holds it. It returns 0 when no socket was stopped.
func Held() (int, error) {
	mu.Lock()
	addrs := slices.Clone(stoppedAddrs)
	mu.Unlock()
	if len(addrs) == 0 {
		return 0, nil
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, fmt.Errorf("listensock: the connections held: %w", err)
	}
	n := 0
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		// A descriptor closed (or reused) since the directory was read
		// answers for what it is now: a count is exact for the sockets
		// that stay open while it is taken.
		sa, err := unix.Getsockname(fd)
		if err != nil || !slices.ContainsFunc(addrs, func(a netip.AddrPort) bool { return bound(a, sa) }) {
			continue
		}
		if p, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL); err != nil || !tcpProtocol(p) {
			continue
		}
		if l, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || l != 0 {
			continue
		}
		n++
	}
	return n, nil
}

// bound reports whether a socket with local address sa was accepted from
// a listening socket bound to ln (a wildcard host takes every address).
func bound(ln netip.AddrPort, sa unix.Sockaddr) bool {
	local, ok := sockaddrAddrPort(sa)
	return ok && local.Port() == ln.Port() && (ln.Addr().IsUnspecified() || local.Addr().Unmap() == ln.Addr())
}
