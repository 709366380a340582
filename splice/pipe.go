package splice

import (
	"fmt"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// DefaultPipeSize is the pipe capacity the default pool asks the kernel for.
// One splice(2) moves at most one pipe's worth, so a large pipe means fewer
// system calls per megabyte. Unprivileged processes are capped by
// /proc/sys/fs/pipe-max-size (1 MiB by default).
const DefaultPipeSize = 1 << 20

// DefaultMaxIdlePipes is how many empty pipes the default pool keeps open for
// reuse. Each costs two file descriptors and, once used, up to a pipe size of
// kernel memory for its page array.
const DefaultMaxIdlePipes = 64

var defaultPipes = NewPipePool(DefaultPipeSize, DefaultMaxIdlePipes)

// DefaultPipePool returns the process-wide pool used when Options.Pipes is nil.
func DefaultPipePool() *PipePool { return defaultPipes }

// pipe is a kernel pipe used as splice(2)'s intermediate buffer: bytes go
// socket → pipe → socket without being copied to userspace.
type pipe struct {
	rfd, wfd int
	size     int // capacity the kernel actually granted (F_GETPIPE_SZ)
	buffered int // bytes spliced in and not yet spliced out
	// handed: the pipe came with a paused relay (Resume), not from a
	// pool; wfd is -1.
	handed bool
}

func (p *pipe) close() {
	unix.Close(p.rfd)
	if p.wfd >= 0 {
		unix.Close(p.wfd)
	}
}

// PipePool hands out pipes for transfer bursts. A tunnel takes a pipe when
// its source becomes readable and gives it back once the source would block
// and the pipe is drained, so an idle tunnel holds no pipe. The pool keeps
// at most maxIdle empty pipes; more are closed when returned. It never limits
// how many pipes are in use at once: one per active direction.
//
// A PipePool is safe for concurrent use.
type PipePool struct {
	size    int
	maxIdle int

	mu     sync.Mutex
	idle   []*pipe
	closed bool

	inUse     atomic.Int64
	created   atomic.Uint64
	destroyed atomic.Uint64
}

// NewPipePool returns a pool whose pipes ask for size bytes of capacity
// (F_SETPIPE_SZ; when the kernel refuses, e.g. EPERM above pipe-max-size or
// over the per-user pipe budget, the pipe silently keeps the kernel's default)
// and which keeps at most maxIdle empty pipes open. size <= 0 means
// DefaultPipeSize; maxIdle < 0 means 0.
func NewPipePool(size, maxIdle int) *PipePool {
	if size <= 0 {
		size = DefaultPipeSize
	}
	return &PipePool{size: size, maxIdle: max(maxIdle, 0)}
}

// PoolStats is a snapshot of a PipePool.
type PoolStats struct {
	InUse     int64  // pipes held by tunnels right now (bursts in progress)
	Idle      int    // empty pipes kept open for reuse
	Created   uint64 // pipes opened since the pool was made
	Destroyed uint64 // pipes closed since the pool was made
}

// Stats returns the pool's current counts.
func (pp *PipePool) Stats() PoolStats {
	pp.mu.Lock()
	idle := len(pp.idle)
	pp.mu.Unlock()
	return PoolStats{
		InUse:     pp.inUse.Load(),
		Idle:      idle,
		Created:   pp.created.Load(),
		Destroyed: pp.destroyed.Load(),
	}
}

// Close closes the idle pipes; pipes still in use are closed when they come
// back. Tunnels may keep using a closed pool: it then opens a pipe per burst.
func (pp *PipePool) Close() error {
	pp.mu.Lock()
	idle := pp.idle
	pp.idle = nil
	pp.closed = true
	pp.mu.Unlock()
	for _, p := range idle {
		pp.destroy(p)
	}
	return nil
}

func (pp *PipePool) get() (*pipe, error) {
	pp.mu.Lock()
	if n := len(pp.idle); n > 0 {
		p := pp.idle[n-1]
		pp.idle[n-1] = nil
		pp.idle = pp.idle[:n-1]
		pp.mu.Unlock()
		pp.inUse.Add(1)
		return p, nil
	}
	pp.mu.Unlock()
	p, err := pp.open()
	if err != nil {
		return nil, err
	}
	pp.inUse.Add(1)
	return p, nil
}

// put takes a pipe back. A pipe that still holds bytes (its burst ended with
// an error before the sink took them) is closed, never reused, so stale bytes
// cannot leak into another tunnel. The pipe counts as in use until it is
// idle or closed, so that a snapshot with nothing in use has every returned
// pipe's close counted.
func (pp *PipePool) put(p *pipe) {
	defer pp.inUse.Add(-1)
	if p.buffered != 0 {
		pp.destroy(p)
		return
	}
	pp.mu.Lock()
	if pp.closed || len(pp.idle) >= pp.maxIdle {
		pp.mu.Unlock()
		pp.destroy(p)
		return
	}
	pp.idle = append(pp.idle, p)
	pp.mu.Unlock()
}

// detach takes p out of the pool for good, to be handed over with its
// bytes (Pause): its write end is closed, its read end is the caller's, and
// the pool counts it closed.
func (pp *PipePool) detach(p *pipe) (rfd int) {
	defer pp.inUse.Add(-1)
	unix.Close(p.wfd)
	pp.destroyed.Add(1)
	return p.rfd
}

func (pp *PipePool) open() (*pipe, error) {
	var fds [2]int
	// O_NONBLOCK on both ends: with SPLICE_F_NONBLOCK a full or empty pipe
	// answers EAGAIN instead of parking the thread; blocking on the socket
	// side is left to Go's netpoller.
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, fmt.Errorf("splice: pipe2: %w", err)
	}
	p := &pipe{rfd: fds[0], wfd: fds[1]}
	// Errors are expected (EPERM above /proc/sys/fs/pipe-max-size or over
	// pipe-user-pages-soft) and harmless: the pipe keeps its default size,
	// which the kernel may itself have shrunk to one page for a user over the
	// soft limit. F_GETPIPE_SZ below tells the truth either way.
	_, _ = unix.FcntlInt(uintptr(p.wfd), unix.F_SETPIPE_SZ, pp.size)
	size, err := unix.FcntlInt(uintptr(p.wfd), unix.F_GETPIPE_SZ, 0)
	if err != nil {
		p.close()
		return nil, fmt.Errorf("splice: F_GETPIPE_SZ: %w", err)
	}
	p.size = size
	pp.created.Add(1)
	return p, nil
}

func (pp *PipePool) destroy(p *pipe) {
	p.close()
	pp.destroyed.Add(1)
}
