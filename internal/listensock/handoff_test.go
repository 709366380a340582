package listensock

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/fdpass"
)

// childEnv makes the test binary the new process of TestHandoffToChild
// (TestMain): it adopts the sockets that arrive on descriptor 3 and
// serves them.
const childEnv = "LISTENSOCK_TEST_CHILD"

// Message kinds between the test and its child.
const (
	kindSockets = 1 // parent: the addresses (JSON), with the descriptors
	kindReady   = 2 // child: it listens
	kindFinish  = 3 // parent: stop serving and report
	kindReport  = 4 // child: childReport
)

type childReport struct {
	Served int
	Err    string
}

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		if err := child(); err != nil {
			fmt.Fprintln(os.Stderr, "listensock child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// child adopts the sockets it is sent, listens on them as its
// configuration would, and serves them until told to finish.
func child() error {
	f := os.NewFile(3, "parent")
	conn, err := fdpass.FileConn(f)
	f.Close()
	if err != nil {
		return err
	}
	defer conn.Close()
	msg, err := fdpass.Receive(conn, fdpass.Limits{})
	if err != nil {
		return err
	}
	var addrs []string
	if err := json.Unmarshal(msg.Payload, &addrs); err != nil || len(addrs) != len(msg.Files) {
		msg.Close()
		return fmt.Errorf("bad sockets message: %v", err)
	}
	for i, a := range addrs {
		if err := Adopt(a, msg.Files[i]); err != nil {
			msg.Close()
			return err
		}
	}
	msg.Close()
	if len(addrs) != 1 {
		return fmt.Errorf("%d sockets, want 1", len(addrs))
	}
	ln, err := listenAddr(addrs[0])
	if err != nil {
		return err
	}
	var served int
	var serveErr error
	done := make(chan struct{})
	go func() { served, serveErr = serve(ln, 'C'); close(done) }()
	if err := fdpass.Send(conn, kindReady, nil); err != nil {
		return err
	}
	if m, err := fdpass.Receive(conn, fdpass.Limits{}); err != nil || m.Kind != kindFinish {
		return fmt.Errorf("waiting for finish: %v", err)
	}
	ln.Close()
	<-done
	rep := childReport{Served: served}
	if !errors.Is(serveErr, net.ErrClosed) {
		rep.Err = fmt.Sprint(serveErr)
	}
	b, _ := json.Marshal(rep)
	return fdpass.Send(conn, kindReport, b)
}

// The old process (this one) exports its socket to a new one (a child),
// which adopts it and accepts from the same queue; the old one then stops
// accepting and closes its listener. A client that dials throughout sees
// every connection answered, each by exactly one of the two processes.
func TestHandoffToChild(t *testing.T) {
	checkLeaks(t)
	ln := listenT(t, "127.0.0.1:0")
	defer ln.Close()
	addr := ln.Addr().String()
	var parentServed int
	var parentErr error
	parentDone := make(chan struct{})
	go func() { parentServed, parentErr = serve(ln, 'P'); close(parentDone) }()

	// The client dials throughout, from 4 goroutines.
	var (
		stop     atomic.Bool
		nextID   atomic.Uint64
		byP, byC atomic.Int64
		// stopID is the last ID given when StopAccepting returned (none
		// before); lateP counts the parent's answers to later dials.
		stopID     atomic.Uint64
		lateP      atomic.Int64
		clientMu   sync.Mutex
		clientErrs []error
		clients    sync.WaitGroup
	)
	// No dial is late before StopAccepting: set before any client runs,
	// so that an answer that comes first is not counted as one.
	stopID.Store(math.MaxUint64)
	for range 4 {
		clients.Go(func() {
			for !stop.Load() {
				id := nextID.Add(1)
				tag, err := dialOnce(addr, id)
				switch {
				case err != nil:
					clientMu.Lock()
					clientErrs = append(clientErrs, err)
					clientMu.Unlock()
				case tag == 'P':
					byP.Add(1)
					if id > stopID.Load() {
						lateP.Add(1)
					}
				case tag == 'C':
					byC.Add(1)
				}
			}
		})
	}
	defer func() { stop.Store(true); clients.Wait() }()
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting until %s (parent served %d, child %d)", what, byP.Load(), byC.Load())
			}
		}
	}
	waitFor("the parent served 50", func() bool { return byP.Load() >= 50 })

	// Start the new process and hand it the socket.
	pa, pb, err := fdpass.Pair()
	if err != nil {
		t.Fatal(err)
	}
	defer pa.Close()
	bf, err := pb.File()
	pb.Close()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.ExtraFiles = []*os.File{bf}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	bf.Close()
	defer func() {
		pa.Close() // a child still waiting for a message ends
		cmd.Wait()
	}()
	exported, err := Export()
	if err != nil {
		t.Fatal(err)
	}
	if len(exported) != 1 || exported[0].Address != addr {
		t.Fatalf("Export = %v, want one socket of %s", exported, addr)
	}
	payload, _ := json.Marshal([]string{exported[0].Address})
	err = fdpass.Send(pa, kindSockets, payload, exported[0].File)
	exported[0].File.Close()
	if err != nil {
		t.Fatal(err)
	}
	if m, err := fdpass.Receive(pa, fdpass.Limits{}); err != nil || m.Kind != kindReady {
		t.Fatalf("child's ready: %v", err)
	}

	// Both accept from the one queue.
	pBefore := byP.Load()
	waitFor("the child served 20", func() bool { return byC.Load() >= 20 })
	waitFor("the parent served 20 more", func() bool { return byP.Load() >= pBefore+20 })

	StopAccepting()
	// Every connection dialed from now on is the child's: no accept(2) of
	// the parent runs once StopAccepting returned.
	stopID.Store(nextID.Load())
	afterStop := byC.Load()
	waitFor("the child served 100 after StopAccepting", func() bool { return byC.Load() >= afterStop+100 })
	if n := lateP.Load(); n > 0 {
		t.Errorf("the parent answered %d connections dialed after StopAccepting returned", n)
	}
	// The old process's configuration unloads: its descriptor closes, its
	// waiting Accept ends, the child's keeps the socket.
	ln.Close()
	select {
	case <-parentDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the parent's accept loop runs on 10s after its listener closed")
	}
	if !errors.Is(parentErr, net.ErrClosed) {
		t.Errorf("the parent's accept loop ended with %v, want net.ErrClosed", parentErr)
	}
	afterClose := byC.Load()
	waitFor("the child served 100 after the parent closed", func() bool { return byC.Load() >= afterClose+100 })
	stop.Store(true)
	clients.Wait()

	if err := fdpass.Send(pa, kindFinish, nil); err != nil {
		t.Fatal(err)
	}
	m, err := fdpass.Receive(pa, fdpass.Limits{})
	if err != nil || m.Kind != kindReport {
		t.Fatalf("child's report: %v", err)
	}
	var rep childReport
	if err := json.Unmarshal(m.Payload, &rep); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("child: %v", err)
	}
	if rep.Err != "" {
		t.Errorf("the child's accept loop ended with %s, want net.ErrClosed", rep.Err)
	}
	clientMu.Lock()
	defer clientMu.Unlock()
	if len(clientErrs) > 0 {
		t.Errorf("%d connections failed, first: %v", len(clientErrs), clientErrs[0])
	}
	total := byP.Load() + byC.Load()
	t.Logf("%d connections: parent %d, child %d", total, byP.Load(), byC.Load())
	if int64(parentServed) != byP.Load() || int64(rep.Served) != byC.Load() {
		t.Errorf("the parent accepted %d and the child %d; the client was answered by them %d and %d times",
			parentServed, rep.Served, byP.Load(), byC.Load())
	}
	if int64(parentServed+rep.Served) != int64(nextID.Load())-int64(len(clientErrs)) || len(clientErrs) != 0 {
		t.Errorf("%d dials, %d accepted in all", nextID.Load(), parentServed+rep.Served)
	}
}

// What BeforeFirstListen sets runs once, before the first listen binds: a
// failure fails that listen, which binds nothing; later listens run
// nothing.
func TestBeforeFirstListen(t *testing.T) {
	checkLeaks(t)
	t.Cleanup(func() { BeforeFirstListen(nil) })
	ran := 0
	BeforeFirstListen(func() error { ran++; return errors.New("the running process refused") })
	if _, err := listenAddr("127.0.0.1:0"); err == nil || !strings.Contains(err.Error(), "the running process refused") {
		t.Fatalf("a listen whose takeover failed: %v, want its error", err)
	}
	mu.Lock()
	n := len(sockets)
	mu.Unlock()
	if n != 0 {
		t.Fatalf("%d sockets bound after a failed takeover, want none", n)
	}
	BeforeFirstListen(func() error { ran++; return nil })
	ln := listenT(t, "127.0.0.1:0")
	defer ln.Close()
	ln2 := listenT(t, "127.0.0.1:0")
	defer ln2.Close()
	if err := TakeOver(); err != nil || ran != 2 {
		t.Fatalf("the takeover ran %d times, TakeOver %v; want once per BeforeFirstListen", ran, err)
	}
}
