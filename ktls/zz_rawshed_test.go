package ktls

import (
	"net"
	"os"
	"os/exec"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/cputest"
)

func BenchmarkRawShed(b *testing.B) {
	p := newTestPKI(b)
	caFile := p.ca.WriteFile(b, b.TempDir(), "ca")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	client := exec.Command(os.Args[0])
	client.Env = append(os.Environ(), benchClientEnv+"="+ln.Addr().String(), benchCAEnv+"="+caFile)
	client.Stderr = os.Stderr
	if err := client.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { client.Process.Kill(); client.Wait() }()
	f, err := ln.(*net.TCPListener).File()
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	rc, _ := f.SyscallConn()
	cpuBefore := cputest.Used(b)
	for b.Loop() {
		var aerr error
		err := rc.Read(func(fd uintptr) bool {
			nfd, _, err := unix.Accept4(int(fd), unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
			if err == unix.EAGAIN {
				return false
			}
			if err != nil {
				aerr = err
				return true
			}
			unix.Write(nfd, shedRecord)
			unix.Close(nfd)
			return true
		})
		if err != nil || aerr != nil {
			b.Fatal(err, aerr)
		}
	}
	b.ReportMetric(float64(cputest.Used(b)-cpuBefore)/float64(b.N), "cpu-ns/op")
}
