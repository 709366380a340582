package listensock

import (
	"errors"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func acceptErr(errno syscall.Errno) error {
	return &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", errno)}
}

// Accept rides out EMFILE/ENFILE with a logged, counted backoff and hands
// out the next connection; any other error ends it, and Close ends a wait.
func TestRetryListener(t *testing.T) {
	base, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer base.Close()
	conn, peer := net.Pipe()
	defer conn.Close()
	defer peer.Close()
	core, logs := observer.New(zapcore.WarnLevel)
	sl := &scriptedListener{Listener: base, conn: conn, closed: make(chan struct{}),
		errs: []error{acceptErr(syscall.EMFILE), acceptErr(syscall.ENFILE), acceptErr(syscall.EMFILE)}}
	ln := &retryListener{Listener: sl, logger: zap.New(core), closed: make(chan struct{})}
	before := acceptRetries.Load()
	if c, err := ln.Accept(); c != conn || err != nil {
		t.Fatalf("Accept = %v, %v; want the connection after the shortage", c, err)
	}
	if got := acceptRetries.Load() - before; got != 3 {
		t.Errorf("%d retries counted, want 3", got)
	}
	if n := logs.FilterMessage("accept failed for lack of resources; retrying").Len(); n != 3 {
		t.Errorf("%d WARN lines, want 3", n)
	}

	// Another error is the caller's business.
	sl.errs = []error{acceptErr(syscall.EINVAL)}
	if _, err := ln.Accept(); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("Accept = %v, want EINVAL passed through", err)
	}

	// Close during a backoff wait ends Accept.
	sl.errs = []error{acceptErr(syscall.EMFILE)}
	done := make(chan error, 1)
	go func() { _, err := ln.Accept(); done <- err }()
	for acceptRetries.Load()-before < 4 {
		time.Sleep(time.Millisecond)
	}
	ln.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
	}
}

// scriptedListener returns the queued errors from Accept, then its
// connection, then blocks until closed.
type scriptedListener struct {
	net.Listener // for Addr; never used to accept
	errs         []error
	conn         net.Conn
	closed       chan struct{}
}

func (l *scriptedListener) Accept() (net.Conn, error) {
	if len(l.errs) > 0 {
		err := l.errs[0]
		l.errs = l.errs[1:]
		return nil, err
	}
	if c := l.conn; c != nil {
		l.conn = nil
		return c, nil
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *scriptedListener) Close() error {
	close(l.closed)
	return nil
}
