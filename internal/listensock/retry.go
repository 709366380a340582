package listensock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/caddymetrics"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
)

// RetryNetwork names a listener network for caddy-l4 servers, as in
// `tcp-retry/192.0.2.10:9443`: plain TCP whose Accept rides out a shortage
// of file descriptors or kernel memory. caddy-l4's accept loop returns on
// the first Accept error that is not a timeout (docs/compatibility.md), so
// one EMFILE stops that listener until the next config load, logged only at
// DEBUG: the port still completes TCP handshakes in the kernel, but nobody
// accepts. net/http.Server sleeps and retries instead; this listener does
// the same underneath caddy-l4.
const RetryNetwork = "tcp-retry"

// maxAcceptDelay caps the backoff between failed accepts (net/http's value).
const maxAcceptDelay = time.Second

// acceptRetries counts failed accepts that were retried, for the metrics.
var acceptRetries atomic.Uint64

var descAcceptRetries = prometheus.NewDesc("caddy_ktls_accept_retries_total",
	"Accepts on tcp-retry and tcp-handoff listeners that failed for lack of file descriptors or memory and were retried.", nil, nil)

func init() {
	caddy.RegisterNetwork(RetryNetwork, listenRetry)
	caddy.RegisterNetwork(Network, listen)
	// A tcp-retry or tcp-handoff listener may serve any module's
	// connections.
	caddymetrics.Add(moduleid.Any, &caddymetrics.Gathered{
		Descs: []*prometheus.Desc{descAcceptRetries},
		Gather: func(ch chan<- prometheus.Metric) {
			ch <- prometheus.MustNewConstMetric(descAcceptRetries, prometheus.CounterValue, float64(acceptRetries.Load()))
		},
	})
}

// listenRetry opens the address as Caddy opens "tcp" ones (shared across
// config loads) and wraps it.
func listenRetry(ctx context.Context, _, host, portRange string, portOffset uint, cfg net.ListenConfig) (any, error) {
	na, err := caddy.ParseNetworkAddress(caddy.JoinNetworkAddress("tcp", host, portRange))
	if err != nil {
		return nil, err
	}
	// A descriptor of the socket of its own, on which the listener sheds
	// below Go's accept (shedRaw): Caddy's listener offers none.
	var raw *os.File
	control := cfg.Control
	cfg.Control = func(network, address string, c syscall.RawConn) error {
		if control != nil {
			if err := control(network, address, c); err != nil {
				return err
			}
		}
		return c.Control(func(fd uintptr) {
			if dup, err := unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0); err == nil {
				raw = os.NewFile(uintptr(dup), "tcp-retry")
			}
		})
	}
	got, err := na.Listen(ctx, portOffset, cfg)
	ln, ok := got.(net.Listener)
	if err == nil && !ok {
		err = fmt.Errorf("%s: %s gave a %T, not a stream listener", RetryNetwork, na, got)
	}
	if err != nil {
		if raw != nil {
			raw.Close()
		}
		return nil, err
	}
	return &retryListener{Listener: ln, bound: canonicalAddr(ln.Addr()), raw: raw, logger: contextLogger(ctx), closed: make(chan struct{})}, nil
}

// contextLogger returns the logger for accept errors of a listener opened
// with ctx.
func contextLogger(ctx context.Context) *zap.Logger {
	logger := caddy.Log()
	if cctx, ok := ctx.(caddy.Context); ok {
		logger = cctx.Logger()
	}
	return logger.Named("accept")
}

// retryListener retries Accept errors caused by a resource shortage, with
// an exponential backoff, and logs and counts each one. While it waits,
// new connections queue in the kernel's backlog.
type retryListener struct {
	net.Listener
	bound     netip.AddrPort // its address, for shedFor
	raw       *os.File       // the socket's descriptor for shedRaw; nil if none
	halted    atomic.Bool    // set at Close: shedRaw accepts no more
	logger    *zap.Logger
	closed    chan struct{}
	closeOnce sync.Once
}

func (l *retryListener) Accept() (net.Conn, error) {
	var b backoff
	for {
		var c net.Conn
		err := l.shed()
		if err == nil {
			c, err = l.Listener.Accept()
		}
		if err == nil {
			if shedConn(l.bound, c) {
				continue
			}
			return c, nil
		}
		delay, ok := b.next(l.logger, l.Addr(), err)
		if !ok {
			return c, err
		}
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-l.closed:
			t.Stop()
			return nil, net.ErrClosed
		}
	}
}

// shed sheds connections below Go's accept while every handler
// registered for the address would shed them (shedRaw), and returns nil
// once the next connection is one to accept: at once when no handler
// would shed.
func (l *retryListener) shed() error {
	if l.raw == nil {
		return nil
	}
	if h, _ := shedFor(l.bound); h == nil {
		return nil
	}
	err := shedRaw(l.raw, l.bound, &l.halted)
	if l.halted.Load() {
		// Closed (raw too, perhaps during the wait): Go's accept says so,
		// as without shedding.
		return nil
	}
	return err
}

// Close also ends a backoff wait in Accept.
func (l *retryListener) Close() error {
	l.closeOnce.Do(func() {
		close(l.closed)
		if l.raw != nil {
			l.halted.Store(true)
			l.raw.Close()
		}
	})
	return l.Listener.Close()
}

// backoff is the wait between accepts that failed for lack of resources:
// it doubles from 5ms up to maxAcceptDelay. The zero value is ready.
type backoff struct {
	delay time.Duration
}

// next reports whether err, an Accept error of the listener at addr, is a
// resource shortage to ride out; if so, it counts and logs it and returns
// how long to wait before accepting again.
func (b *backoff) next(logger *zap.Logger, addr net.Addr, err error) (time.Duration, bool) {
	if !resourceShortage(err) {
		return 0, false
	}
	b.delay = min(max(2*b.delay, 5*time.Millisecond), maxAcceptDelay)
	acceptRetries.Add(1)
	logger.Warn("accept failed for lack of resources; retrying",
		zap.Stringer("address", addr), zap.Duration("delay", b.delay), zap.Error(err))
	return b.delay, true
}

// resourceShortage reports whether an Accept error is a passing lack of
// descriptors or memory (accept(2) then leaves the connection queued).
func resourceShortage(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}
