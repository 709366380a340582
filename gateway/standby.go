package gateway

import (
	"context"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// DefaultStandbyMaxIdle is Config.StandbyMaxIdle's default: half the
// forwarders' default standby_timeout.
const DefaultStandbyMaxIdle = 30 * time.Second

// standbyRefillWait bounds how long Carry defers its forwarder's standby
// refill for the tunnel's first byte back: a sandbox that speaks only
// when spoken to may stay silent longer than any round trip.
var standbyRefillWait = time.Second

// How a standby connection ended, as Config.OnStandby is told.
const (
	// StandbyUsed: a tunnel's preamble went on it.
	StandbyUsed = "used"
	// StandbyExpired: kept StandbyMaxIdle unused, then closed.
	StandbyExpired = "expired"
	// StandbyLost: the forwarder had ended it when a tunnel wanted it.
	StandbyLost = "lost"
	// StandbyFailed: opening one failed (the refill stops until the
	// next Dial to that forwarder).
	StandbyFailed = "failed"
)

// StandbyOutcomes lists the outcomes, for metrics to pre-register.
func StandbyOutcomes() []string {
	return []string{StandbyUsed, StandbyExpired, StandbyLost, StandbyFailed}
}

// standbys keeps Config.Standby connections per forwarder whose mutual TLS
// is done and whose preamble is not written: Dial takes one where it can,
// and each Dial refills its forwarder's in the background once its
// preamble is written (Carry: once the tunnel's first byte came back). A forwarder
// waits for such a connection's first preamble byte under its
// standby_timeout (forward.Config.StandbyTimeout); each is closed unused
// after StandbyMaxIdle, below that.
type standbys struct {
	d      *Dialer
	ctx    context.Context
	cancel context.CancelFunc

	// ready and filling hold entries only for forwarders with standby
	// connections ready or being opened: a gateway that dialed many
	// forwarders once keeps nothing for them.
	mu      sync.Mutex
	ready   map[string][]*standbyConn // by forwarder, oldest first
	filling map[string]bool
	wg      sync.WaitGroup
}

type standbyConn struct {
	conn   *ktls.Conn
	expire *time.Timer
}

func newStandbys(d *Dialer) *standbys {
	ctx, cancel := context.WithCancel(context.Background())
	return &standbys{d: d, ctx: ctx, cancel: cancel, ready: map[string][]*standbyConn{}, filling: map[string]bool{}}
}

func (s *standbys) on(outcome string) {
	if f := s.d.cfg.OnStandby; f != nil {
		f(outcome)
	}
}

// take returns a live standby connection to forwarder, or nil.
func (s *standbys) take(forwarder string) *ktls.Conn {
	if s.d.cfg.Standby == 0 {
		return nil
	}
	for {
		s.mu.Lock()
		q := s.ready[forwarder]
		if len(q) == 0 {
			s.mu.Unlock()
			return nil
		}
		c := q[0]
		s.setReady(forwarder, q[1:])
		s.mu.Unlock()
		if !c.expire.Stop() {
			continue // expiring: its timer closes it
		}
		if established(c.conn) {
			s.on(StandbyUsed)
			return c.conn
		}
		c.conn.Close()
		s.on(StandbyLost)
	}
}

// established reports whether c's socket is still in TCP's ESTABLISHED
// state: a forwarder that ended the connection sent its FIN or reset. (A
// peek cannot tell: the forwarder's session tickets wait unread on every
// standby connection.)
func established(c *ktls.Conn) bool {
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	ok := false
	rc.Control(func(fd uintptr) {
		info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
		ok = err == nil && info.State == unix.BPF_TCP_ESTABLISHED
	})
	return ok
}

// refill opens standby connections to forwarder, in the background, until
// Config.Standby are ready, unless it is doing so already.
func (s *standbys) refill(forwarder string) {
	if s.d.cfg.Standby == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.filling[forwarder] || s.ctx.Err() != nil {
		return
	}
	s.filling[forwarder] = true
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for s.add(forwarder) {
		}
	}()
}

// add opens one standby connection to forwarder and reports whether
// another is wanted.
func (s *standbys) add(forwarder string) bool {
	s.mu.Lock()
	if len(s.ready[forwarder]) >= s.d.cfg.Standby || s.ctx.Err() != nil {
		delete(s.filling, forwarder)
		s.mu.Unlock()
		return false
	}
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(s.ctx, s.d.cfg.DialTimeout)
	conn, _, err := s.d.connect(ctx, forwarder)
	cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil || s.ctx.Err() != nil {
		delete(s.filling, forwarder)
		if err == nil {
			conn.Close()
		} else if s.ctx.Err() == nil {
			s.on(StandbyFailed)
		}
		return false
	}
	c := &standbyConn{conn: conn}
	c.expire = time.AfterFunc(s.d.cfg.StandbyMaxIdle, func() { s.expire(forwarder, c) })
	s.ready[forwarder] = append(s.ready[forwarder], c)
	return true
}

// keep offers conn, a connection to forwarder whose mutual TLS is done and
// whose preamble was not written (its user left: Carry), to the ready
// ones: it is kept while fewer than Config.Standby are, its idle time
// counted from now (a forwarder that ended it first is seen at take), else
// closed in order.
func (s *standbys) keep(forwarder string, conn *ktls.Conn) {
	s.mu.Lock()
	if s.d.cfg.Standby == 0 || len(s.ready[forwarder]) >= s.d.cfg.Standby || s.ctx.Err() != nil {
		s.mu.Unlock()
		conn.Close()
		return
	}
	c := &standbyConn{conn: conn}
	c.expire = time.AfterFunc(s.d.cfg.StandbyMaxIdle, func() { s.expire(forwarder, c) })
	s.ready[forwarder] = append(s.ready[forwarder], c)
	s.mu.Unlock()
}

// setReady sets forwarder's ready connections to q, dropping its entry
// when q is empty. s.mu is held.
func (s *standbys) setReady(forwarder string, q []*standbyConn) {
	if len(q) == 0 {
		delete(s.ready, forwarder)
		return
	}
	s.ready[forwarder] = q
}

// expire closes c, a standby connection kept StandbyMaxIdle unused.
func (s *standbys) expire(forwarder string, c *standbyConn) {
	s.mu.Lock()
	q := s.ready[forwarder]
	if i := slices.Index(q, c); i >= 0 {
		s.setReady(forwarder, slices.Delete(q, i, i+1))
	}
	s.mu.Unlock()
	c.conn.Close()
	s.on(StandbyExpired)
}

// close closes every standby connection and waits for the refills.
func (s *standbys) close() {
	s.cancel()
	s.wg.Wait()
	s.mu.Lock()
	ready := s.ready
	s.ready = map[string][]*standbyConn{}
	s.mu.Unlock()
	for _, q := range ready {
		for _, c := range q {
			if c.expire.Stop() {
				c.conn.Close()
			}
		}
	}
}

// Close closes the Dialer's standby connections (Config.Standby); tunnels
// it opened are not touched. A Dial after Close keeps none.
func (d *Dialer) Close() error {
	d.standby.close()
	return nil
}
