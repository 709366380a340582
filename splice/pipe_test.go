package splice

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

func TestPipePoolBoundsIdle(t *testing.T) {
	checkLeaks(t)
	pool := NewPipePool(DefaultPipeSize, 2)
	var pipes []*pipe
	for range 3 {
		p, err := pool.get()
		if err != nil {
			t.Fatal(err)
		}
		pipes = append(pipes, p)
	}
	for _, p := range pipes {
		flags, err := unix.FcntlInt(uintptr(p.rfd), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Errorf("pipe fd flags %#x, %v: want FD_CLOEXEC", flags, err)
		}
		// Root may exceed pipe-max-size; others may be refused and keep
		// the kernel's default, which is at least one page.
		if want := DefaultPipeSize; (unix.Geteuid() == 0 && p.size != want) || p.size < 4096 {
			t.Errorf("pipe size %d, want %d (root) or at least a page", p.size, want)
		}
	}
	if st := pool.Stats(); st.InUse != 3 || st.Idle != 0 || st.Created != 3 {
		t.Errorf("with 3 taken: %+v", st)
	}
	pipes[0].buffered = 10 // a burst that failed with bytes in the pipe
	for _, p := range pipes {
		pool.put(p)
	}
	// The dirty pipe is closed; of the two clean ones both fit maxIdle.
	if st := pool.Stats(); st.InUse != 0 || st.Idle != 2 || st.Destroyed != 1 {
		t.Errorf("after returning them: %+v, want 2 idle and the dirty one destroyed", st)
	}
	p, err := pool.get()
	if err != nil {
		t.Fatal(err)
	}
	if st := pool.Stats(); st.Created != 3 || st.Idle != 1 {
		t.Errorf("get after put did not reuse an idle pipe: %+v", st)
	}
	pool.Close()
	pool.put(p) // back to a closed pool: closed, not kept
	if st := pool.Stats(); st.Idle != 0 || st.Created != st.Destroyed {
		t.Errorf("after Close: %+v, want every pipe closed", st)
	}
}

// A pipe size the kernel refuses leaves pipes at the kernel's default
// capacity, and the relay still splices every byte through them. Root may
// exceed /proc/sys/fs/pipe-max-size, so the pool asks for a size that even
// root is refused: above 2^31 bytes, F_SETPIPE_SZ fails with EINVAL.
func TestPipePoolSizeRefused(t *testing.T) {
	checkLeaks(t)
	const refused = 1<<31 + 4096
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	def, getErr := unix.FcntlInt(uintptr(fds[1]), unix.F_GETPIPE_SZ, 0)
	_, setErr := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, refused)
	unix.Close(fds[0])
	unix.Close(fds[1])
	if getErr != nil {
		t.Fatal(getErr)
	}
	if !errors.Is(setErr, unix.EINVAL) {
		t.Fatalf("F_SETPIPE_SZ %d on a fresh pipe: %v, want EINVAL: this kernel cannot make the test fall back", refused, setErr)
	}
	pool := newSizedTestPool(t, refused, 4)
	p, err := pool.get()
	if err != nil {
		t.Fatal(err)
	}
	if p.size != def {
		t.Errorf("pipe size %d, want the kernel's default %d", p.size, def)
	}
	pool.put(p)
	size := echoBig(t, pool, false, 3)
	t.Logf("%d MiB each way through %d-byte pipes; pool %+v", size/MiB, def, pool.Stats())
}
