package ktls

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/fdpass"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// handoffChildEnv makes the test binary the process that adopts
// TestKernelHandoff's connection (TestMain): it receives the socket and
// the state on descriptor 3 and finishes both streams.
const handoffChildEnv = "KTLS_HANDOFF_CHILD"

// Message kinds between TestKernelHandoff and its child.
const (
	kindHandoff = 1 // parent → child: handoffJob and the socket
	kindAdopted = 2 // child → parent: adoptedReport
	kindDone    = 3 // child → parent: doneReport
	kindReady   = 4 // child → parent: probed, waiting for the socket
)

// handoffJob is the connection's state and the rest of its streams: the
// child reads stream SeedUp from byte K to N (until close_notify), and
// writes stream SeedDown from byte K to N, then close_notify. With
// KeyUpdates (TLS 1.3 on a kernel that rekeys) it renews its own key after
// half of its part, and writes the other half only once it has applied the
// one KeyUpdate the peer sends (after the adoption, in the middle of the
// peer's part).
type handoffJob struct {
	State            HandoffState
	SeedUp, SeedDown uint64
	N, K             int
	KeyUpdates       bool
}

// adoptedReport: the kernel's record sequence numbers right after Adopt.
type adoptedReport struct {
	TXSeq, RXSeq uint64
	TX, RX       Mode
}

// doneReport: what the child read and did.
type doneReport struct {
	UpSum                      [32]byte // SHA-256 of what it read
	UpBytes                    int64
	CloseNotified              bool
	TXSeq, RXSeq               uint64 // after its close_notify and the peer's
	KeyUpdates, KeyUpdatesSent uint64 // applied, sent (its Stats)
	Err                        string
}

// handoffChild is the adopting process of TestKernelHandoff.
func handoffChild() error {
	f := os.NewFile(3, "parent")
	uc, err := fdpass.FileConn(f)
	f.Close()
	if err != nil {
		return err
	}
	defer uc.Close()
	report := func(r doneReport, err error) error {
		if err != nil {
			r.Err = err.Error()
		}
		b, merr := json.Marshal(r)
		if merr != nil {
			return merr
		}
		return errors.Join(err, fdpass.Send(uc, kindDone, b))
	}
	// Probe's throwaway sockets install keys: done before the parent
	// takes the kernel's counters, they are not counted as the move's.
	Probe()
	if err := fdpass.Send(uc, kindReady, []byte("{}")); err != nil {
		return err
	}
	m, err := fdpass.Receive(uc, fdpass.Limits{Files: 1})
	if err != nil {
		return report(doneReport{}, err)
	}
	var job handoffJob
	if err := json.Unmarshal(m.Payload, &job); err != nil || m.Kind != kindHandoff || len(m.Files) != 1 {
		m.Close()
		return report(doneReport{}, fmt.Errorf("message kind %d, %d files: %v", m.Kind, len(m.Files), err))
	}
	clear(m.Payload)
	applied := make(chan struct{}, 1)
	before := Stats()
	c, err := Adopt(m.Files[0], job.State, Options{Observer: func(e Event) {
		if e.Kind == EventKeyUpdate {
			select {
			case applied <- struct{}{}:
			default:
			}
		}
	}})
	m.Close()
	job.State.Zero()
	if err != nil {
		return report(doneReport{}, err)
	}
	defer c.Close()
	var ar adoptedReport
	ar.TX, ar.RX = c.Offload().TX, c.Offload().RX
	if ar.TXSeq, err = c.kernelSeq(optTLSTX); err == nil {
		ar.RXSeq, err = c.kernelSeq(optTLSRX)
	}
	if err != nil {
		return report(doneReport{}, err)
	}
	b, _ := json.Marshal(ar)
	if err := fdpass.Send(uc, kindAdopted, b); err != nil {
		return err
	}

	var r doneReport
	var readErr, writeErr error
	var wg sync.WaitGroup
	readDone := make(chan struct{})
	wg.Go(func() {
		defer close(readDone)
		h := sha256.New()
		r.UpBytes, readErr = io.CopyBuffer(h, struct{ io.Reader }{c}, make([]byte, 32<<10))
		r.UpSum = [32]byte(h.Sum(nil))
		r.CloseNotified = c.CloseNotified()
	})
	wg.Go(func() {
		rest := job.N - job.K
		head := io.LimitReader(offsetStream(job.SeedDown, job.K, job.N), int64(rest/2))
		if _, writeErr = io.CopyBuffer(struct{ io.Writer }{c}, head, make([]byte, 32<<10)); writeErr != nil {
			return
		}
		if job.KeyUpdates {
			if writeErr = c.updateTX(false); writeErr != nil {
				return
			}
			// A reader that ended without it lets the report show the
			// missing KeyUpdate.
			select {
			case <-applied:
			case <-readDone:
			}
		}
		tail := offsetStream(job.SeedDown, job.K+rest/2, job.N)
		if _, writeErr = io.CopyBuffer(struct{ io.Writer }{c}, tail, make([]byte, 32<<10)); writeErr != nil {
			return
		}
		writeErr = c.CloseWrite()
	})
	wg.Wait()
	if err := errors.Join(readErr, writeErr); err != nil {
		return report(r, err)
	}
	if r.TXSeq, err = c.kernelSeq(optTLSTX); err == nil {
		r.RXSeq, err = c.kernelSeq(optTLSRX)
	}
	after := Stats()
	r.KeyUpdates, r.KeyUpdatesSent = after.KeyUpdates-before.KeyUpdates, after.KeyUpdatesSent-before.KeyUpdatesSent
	return report(r, err)
}

// offsetStream is bytes from to to of the stream payload(seed, to).
func offsetStream(seed uint64, from, to int) io.Reader {
	r := payload(seed, to)
	io.CopyN(io.Discard, r, int64(from))
	return r
}

func offsetSum(seed uint64, from, to int) [32]byte {
	s, _, _ := sum256(offsetStream(seed, from, to))
	return s
}

// startHandoffChild re-executes the test binary as handoffChild and
// returns this end of the socket pair between them. Cleanup closes it and
// fails t if the child did not exit 0.
func startHandoffChild(t *testing.T) *net.UnixConn {
	t.Helper()
	a, b, err := fdpass.Pair()
	if err != nil {
		t.Fatal(err)
	}
	bf, err := b.File()
	b.Close()
	if err != nil {
		a.Close()
		t.Fatal(err)
	}
	defer bf.Close()
	cmd := exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), handoffChildEnv+"=1")
	cmd.ExtraFiles = []*os.File{bf}
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Start(); err != nil {
		a.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Closing a ends a child still waiting for a message.
		a.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("adopting process: %v\n%s", err, stderr.String())
		}
	})
	return a
}

// receiveJSON receives a message of kind into v.
func receiveJSON(t *testing.T, c *net.UnixConn, kind uint16, v any) {
	t.Helper()
	m, err := fdpass.Receive(c, fdpass.Limits{Files: 0})
	if err != nil {
		t.Fatalf("from the adopting process: %v", err)
	}
	defer m.Close()
	if m.Kind != kind {
		t.Fatalf("from the adopting process: message kind %d, want %d: %s", m.Kind, kind, m.Payload)
	}
	if err := json.Unmarshal(m.Payload, v); err != nil {
		t.Fatal(err)
	}
}

// TestKernelHandoff: a connection offloaded both ways moves to another
// process in the middle of its streams and finishes there. The client
// streams N bytes up and reads N bytes down; the server reads and writes
// the first K (mid-record: the kernel keeps the rest of a record it
// decrypted), hands the connection off, closes its Conn, and a re-executed
// test binary adopts the socket and does the rest. Every byte is SHA-256
// checked, the peer sees one unbroken session: no record lost, repeated
// or failing authentication (TlsDecryptError), no key installed by the
// move (TlsTxSw, TlsRxSw, TlsCurrTxSw, TlsCurrRxSw unchanged), the
// adopter's record sequence numbers those the old owner read from the
// kernel, and at the end each side's count of the records it opened the
// other's count of the records it sealed. On TLS 1.3 with kernel rekey
// (Linux >= 6.14), after the move: the client asks for a KeyUpdate, which
// the adopter applies and answers, and the adopter renews its own key;
// the counts of KeyUpdates sent and applied on both sides and the
// kernel's rekey counters are exact.
func TestKernelHandoff(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	for _, tc := range []struct {
		name    string
		version uint16
		suite   uint16
	}{
		{"tls13", tls.VersionTLS13, 0},
		{"tls13-chacha20", tls.VersionTLS13, tls.TLS_CHACHA20_POLY1305_SHA256},
		{"tls12", tls.VersionTLS12, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t, kerneltest.OpenFDs)
			if tc.suite != 0 {
				onlyTLS13Suite(t, tc.suite)
			}
			scfg, ccfg := p.configs(connCase{version: tc.version})
			server, client := kernelPeers(t, scfg, ccfg, Options{})
			keyUpdates := tc.version == tls.VersionTLS13 && Probe().Rekey
			n := bulkSize(t, defaultBulkMiB)
			k := n/2 + 1000 // inside a record: the client writes full ones
			const seedUp, seedDown = 31, 32
			child := startHandoffChild(t)

			// The client, for the whole test: reads down; streams up, and
			// halfway through the adopter's part, once the adopter has
			// reported in, asks for a KeyUpdate (so that the adopter, not
			// the old owner, answers it; and before the client's
			// close_notify, after which it would send none).
			var clientRead, clientWrite error
			var downSum [32]byte
			var downBytes int64
			var clientWG sync.WaitGroup
			adoptedCh := make(chan struct{})
			adoptedNow := sync.OnceFunc(func() { close(adoptedCh) })
			clientWG.Go(func() {
				downSum, downBytes, clientRead = sum256(struct{ io.Reader }{client})
			})
			clientWG.Go(func() {
				up := payload(seedUp, n)
				mid := int64(k + (n-k)/2)
				if _, clientWrite = io.CopyBuffer(struct{ io.Writer }{client}, io.LimitReader(up, mid), make([]byte, 32<<10)); clientWrite != nil {
					return
				}
				<-adoptedCh
				if keyUpdates {
					if clientWrite = client.updateTX(true); clientWrite != nil {
						return
					}
				}
				if _, clientWrite = io.CopyBuffer(struct{ io.Writer }{client}, up, make([]byte, 32<<10)); clientWrite == nil {
					clientWrite = client.CloseWrite()
				}
			})
			defer func() {
				// A failed run: the client's end unblocks its goroutines.
				adoptedNow()
				client.Close()
				clientWG.Wait()
			}()
			// Bounds a run that goes wrong; no assertion depends on it.
			client.SetDeadline(time.Now().Add(5 * time.Minute))

			// The first owner: K bytes each way.
			upHead := make([]byte, k)
			if _, err := io.ReadFull(server, upHead); err != nil {
				t.Fatal(err)
			}
			if sha256.Sum256(upHead) != offsetSum(seedUp, 0, k) {
				t.Fatal("the first owner read other bytes than the client sent")
			}
			if _, err := io.Copy(struct{ io.Writer }{server}, io.LimitReader(payload(seedDown, n), int64(k))); err != nil {
				t.Fatal(err)
			}

			receiveJSON(t, child, kindReady, &struct{}{})
			s0, err := kerneltest.ReadStat()
			if err != nil {
				t.Fatal(err)
			}
			before, fds := Stats(), kerneltest.OpenFDs(t)
			st, sock, err := server.Handoff()
			if err != nil {
				t.Fatal(err)
			}
			if got := Stats().HandedOff - before.HandedOff; got != 1 {
				t.Errorf("HandedOff moved by %d, want 1", got)
			}
			// The socket goes as the Conn holds it: no descriptor made.
			if after := kerneltest.OpenFDs(t); after != fds {
				t.Errorf("%d descriptors open before Handoff, %d after", fds, after)
			}
			if st.TX.Seq == 0 || st.RX.Seq == 0 || st.TX.Seq > st.TX.Bound {
				t.Errorf("handed off with record sequence numbers TX %d (bound %d), RX %d: want both records sealed and opened, within the bound", st.TX.Seq, st.TX.Bound, st.RX.Seq)
			}
			if _, err := server.Write([]byte("x")); !errors.Is(err, ErrHandedOff) {
				t.Errorf("Write after Handoff: %v, want ErrHandedOff", err)
			}
			enc, err := st.Encode()
			if err != nil {
				t.Fatal(err)
			}
			job, _ := json.Marshal(handoffJob{State: st, SeedUp: seedUp, SeedDown: seedDown, N: n, K: k, KeyUpdates: keyUpdates})
			// The socket goes as the Conn holds it, not duplicated; the old
			// Conn's Close then must leave it to its new owner.
			err = fdpass.Send(child, kindHandoff, job, sock)
			if cerr := server.Close(); cerr != nil {
				t.Fatal(cerr)
			}
			clear(enc)
			clear(job)
			txSeq, rxSeq := st.TX.Seq, st.RX.Seq
			st.Zero()
			if err != nil {
				t.Fatal(err)
			}

			var adopted adoptedReport
			receiveJSON(t, child, kindAdopted, &adopted)
			if adopted.TXSeq != txSeq || adopted.RXSeq != rxSeq {
				t.Errorf("after adoption the kernel counts TX %d RX %d records, at the handoff %d and %d", adopted.TXSeq, adopted.RXSeq, txSeq, rxSeq)
			}
			if adopted.TX != ModeSW || adopted.RX != ModeSW {
				t.Errorf("adopted with TX %v RX %v, want sw/sw", adopted.TX, adopted.RX)
			}
			s1, err := kerneltest.ReadStat()
			if err != nil {
				t.Fatal(err)
			}
			for _, counter := range []string{"TlsTxSw", "TlsRxSw", "TlsCurrTxSw", "TlsCurrRxSw", "TlsDecryptError"} {
				wantStat(t, s1.Sub(s0), counter, 0)
			}
			adoptedNow()

			var done doneReport
			receiveJSON(t, child, kindDone, &done)
			clientWG.Wait()
			if done.Err != "" {
				t.Fatalf("adopting process: %s", done.Err)
			}
			if clientRead != nil || clientWrite != nil {
				t.Fatalf("client: read %v, write %v", clientRead, clientWrite)
			}
			if done.UpBytes != int64(n-k) || done.UpSum != offsetSum(seedUp, k, n) || !done.CloseNotified {
				t.Errorf("the adopter read %d bytes (equal %v, close_notify %v), want the client's last %d and its close_notify",
					done.UpBytes, done.UpSum == offsetSum(seedUp, k, n), done.CloseNotified, n-k)
			}
			if downBytes != int64(n) || downSum != offsetSum(seedDown, 0, n) {
				t.Errorf("the client read %d bytes (equal %v), want %d across the handoff", downBytes, downSum == offsetSum(seedDown, 0, n), n)
			}
			clientTX, err := client.kernelSeq(optTLSTX)
			if err != nil {
				t.Fatal(err)
			}
			clientRX, err := client.kernelSeq(optTLSRX)
			if err != nil {
				t.Fatal(err)
			}
			if clientRX != done.TXSeq || clientTX != done.RXSeq {
				t.Errorf("records: the adopter sealed %d and opened %d under its current keys, the client opened %d and sealed %d",
					done.TXSeq, done.RXSeq, clientRX, clientTX)
			}
			s2, err := kerneltest.ReadStat()
			if err != nil {
				t.Fatal(err)
			}
			d := s2.Sub(s0)
			wantStat(t, d, "TlsDecryptError", 0)
			wantStat(t, d, "TlsTxSw", 0)
			wantStat(t, d, "TlsRxSw", 0)
			if _, ok := s2["TlsEncryptError"]; ok {
				wantStat(t, d, "TlsEncryptError", 0)
			}
			// In this process only the client applies or sends KeyUpdates.
			clientApplied, clientSent := Stats().KeyUpdates-before.KeyUpdates, Stats().KeyUpdatesSent-before.KeyUpdatesSent
			if !keyUpdates {
				if done.KeyUpdates+done.KeyUpdatesSent+clientApplied+clientSent != 0 {
					t.Errorf("KeyUpdates where none was asked for: adopter applied %d sent %d, client applied %d sent %d",
						done.KeyUpdates, done.KeyUpdatesSent, clientApplied, clientSent)
				}
				if done.TXSeq <= txSeq || done.RXSeq <= rxSeq {
					t.Errorf("the adopter's keys protected %d and %d records at the end, %d and %d at the handoff: the count did not go on", done.TXSeq, done.RXSeq, txSeq, rxSeq)
				}
				return
			}
			// The client asked (1 sent); the adopter applied it (1) and
			// answered (1 sent), and renewed its own key (1 sent); the
			// client applied both (2).
			if done.KeyUpdates != 1 || done.KeyUpdatesSent != 2 || clientApplied != 2 || clientSent != 1 {
				t.Errorf("KeyUpdates: adopter applied %d sent %d, client applied %d sent %d; want 1, 2, 2, 1",
					done.KeyUpdates, done.KeyUpdatesSent, clientApplied, clientSent)
			}
			wantStat(t, d, "TlsRxRekeyOk", 3)
			wantStat(t, d, "TlsTxRekeyOk", 3)
			wantStat(t, d, "TlsRxRekeyError", 0)
			wantStat(t, d, "TlsTxRekeyError", 0)
		})
	}
}

// exchangeConns moves n bytes each way between two Conns at once, then
// close_notify each way; both streams are SHA-256 checked.
func exchangeConns(t *testing.T, a, b *Conn, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	sums := make([][32]byte, 2)
	counts := make([]int64, 2)
	for i, pair := range [][2]*Conn{{a, b}, {b, a}} {
		w, r := pair[0], pair[1]
		wg.Go(func() {
			if _, errs[2*i] = io.Copy(struct{ io.Writer }{w}, payload(uint64(40+i), n)); errs[2*i] == nil {
				errs[2*i] = w.CloseWrite()
			}
		})
		wg.Go(func() { sums[i], counts[i], errs[2*i+1] = sum256(struct{ io.Reader }{r}) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if want, _, _ := sum256(payload(uint64(40+i), n)); counts[i] != int64(n) || sums[i] != want {
			t.Fatalf("direction %d: %d bytes, equal %v; want %d", i, counts[i], sums[i] == want, n)
		}
	}
}

// handoffSameProcess hands server off and returns the state and a
// descriptor of the socket of its own, as a receiving process gets one,
// with the old Conn closed.
func handoffSameProcess(t *testing.T, server *Conn) (HandoffState, *os.File) {
	t.Helper()
	st, sock, err := server.Handoff()
	if err != nil {
		t.Fatal(err)
	}
	f, err := sock.(*net.TCPConn).File()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := server.Close(); err != nil {
		t.Fatal(err)
	}
	return st, f
}

// TestKernelAdopt: Adopt checks the socket against the state and refuses,
// leaving it untouched and no descriptor behind, a state whose record
// sequence number, key, cipher or version is not the kernel's; the right
// state then continues the session (the path back for a handoff whose
// transfer failed). The closed ends travel: close_notify sent, and the
// peer's close_notify received. The socket's own options (Nagle,
// keepalive, TCP_USER_TIMEOUT) stay as they were.
func TestKernelAdopt(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	n := smallBytes

	t.Run("checks", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		server, client := kernelPeers(t, scfg, ccfg, Options{})
		if _, err := client.Write([]byte("before")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(server, make([]byte, 6)); err != nil {
			t.Fatal(err)
		}
		// The path back: the old Conn still open, its socket as Handoff
		// returned it.
		st, sock, err := server.Handoff()
		if err != nil {
			t.Fatal(err)
		}
		before := kerneltest.OpenFDs(t)
		for _, bad := range []struct {
			name string
			edit func(s *HandoffState)
			says string
		}{
			{"seq", func(s *HandoffState) { s.RX.Seq++ }, "RX: record sequence number 1 in the kernel, 2 in the state"},
			{"secret", func(s *HandoffState) { s.TX.Secret[0] ^= 1 }, "TX: the kernel's key is not the one"},
			{"rx secret", func(s *HandoffState) { s.RX.Secret[31] ^= 1 }, "RX: the kernel's key is not the one"},
			{"cipher", func(s *HandoffState) {
				s.CipherSuite = tls.TLS_AES_256_GCM_SHA384
				s.TX.Secret, s.RX.Secret = make([]byte, 48), make([]byte, 48)
			}, "TX: the kernel has version 0x0304 cipher 51, not TLS 1.3 TLS_AES_256_GCM_SHA384 (cipher 52)"},
			{"version", func(s *HandoffState) {
				s.Version, s.CipherSuite = tls.VersionTLS12, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
				s.TX.Secret, s.RX.Secret = nil, nil
			}, "not TLS 1.2"},
		} {
			b := st
			b.TX.Secret, b.RX.Secret = bytes.Clone(st.TX.Secret), bytes.Clone(st.RX.Secret)
			bad.edit(&b)
			c, err := Adopt(sock, b, Options{})
			if c != nil || !errors.Is(err, ErrAdoptMismatch) || !strings.Contains(err.Error(), bad.says) {
				t.Fatalf("%s: Adopt = %v, %v; want ErrAdoptMismatch saying %q", bad.name, c, err, bad.says)
			}
			if after := kerneltest.OpenFDs(t); after != before {
				t.Fatalf("%s: %d descriptors before Adopt, %d after its refusal", bad.name, before, after)
			}
		}
		var adopted *Conn
		d := statDelta(t, func() {
			var err error
			if adopted, err = Adopt(sock, st, Options{}); err != nil {
				t.Fatal(err)
			}
		})
		defer adopted.Close()
		// The old Conn's descriptors go; the session goes on in adopted.
		if err := server.Close(); err != nil {
			t.Fatal(err)
		}
		wantStat(t, d, "TlsTxSw", 0)
		wantStat(t, d, "TlsRxSw", 0)
		if cs := adopted.ConnectionState(); cs.Version != tls.VersionTLS13 || cs.CipherSuite != tls.TLS_AES_128_GCM_SHA256 || !cs.HandshakeComplete || cs.ServerName != "localhost" {
			t.Errorf("adopted ConnectionState %+v", cs)
		}
		exchangeConns(t, adopted, client, n)
	})

	// The adopted Conn reports the modes the kernel reported to the one
	// that handed it off, carried in the state, and they are the kernel's
	// now: TLS_RX_EXPECT_NO_PAD in effect or not, both directions in
	// software.
	t.Run("modes", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		for _, noPad := range []bool{true, false} {
			server, client := kernelPeers(t, scfg, ccfg, Options{ExpectNoPad: noPad})
			before := server.Offload()
			if before.TX != ModeSW || before.RX != ModeSW || before.RXNoPad != noPad {
				t.Fatalf("ExpectNoPad %v: the handshake's offload is %+v", noPad, before)
			}
			st, sock, err := server.Handoff()
			if err != nil {
				t.Fatal(err)
			}
			if st.TX.Mode != ModeSW || st.RX.Mode != ModeSW || st.RXNoPad != noPad {
				t.Fatalf("ExpectNoPad %v: the state carries TX %v, RX %v, RXNoPad %v", noPad, st.TX.Mode, st.RX.Mode, st.RXNoPad)
			}
			adopted, err := Adopt(sock, st, Options{})
			if err != nil {
				t.Fatal(err)
			}
			server.Close()
			got := adopted.Offload()
			if got.TX != before.TX || got.RX != before.RX || got.RXNoPad != before.RXNoPad || got.Reason != ReasonNone {
				t.Errorf("ExpectNoPad %v: adopted offload %+v, handed off %+v", noPad, got, before)
			}
			info, err := readULPInfo(adopted.rawSock)
			if err != nil {
				t.Fatal(err)
			}
			if info.TX != got.TX || info.RX != got.RX || info.RXNoPad != got.RXNoPad {
				t.Errorf("ExpectNoPad %v: the kernel reports %+v, the adopted Conn %+v", noPad, info, got)
			}
			exchangeConns(t, adopted, client, smallBytes)
			adopted.Close()
			client.Close()
		}
	})

	// The socket's own settings come through the adoption as they were:
	// net.FileConn alone sets Go's defaults on it (Nagle off, keepalive on
	// at 15 s, 15 s, 9 probes).
	t.Run("socket-options", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		server, client := kernelPeers(t, scfg, ccfg, Options{})
		opts := []struct {
			name              string
			level, opt, value int
		}{
			{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY, 0},
			{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 7},
			{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 5},
			{"TCP_KEEPCNT", unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 3},
			{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
			{"TCP_USER_TIMEOUT", unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, 1500},
		}
		onSocket := func(c *Conn, fn func(fd int) error) {
			t.Helper()
			rc, err := c.SyscallConn()
			if err == nil {
				err = controlFD(rc, fn)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		onSocket(server, func(fd int) error {
			for _, o := range opts {
				if err := unix.SetsockoptInt(fd, o.level, o.opt, o.value); err != nil {
					return fmt.Errorf("%s: %w", o.name, err)
				}
			}
			return nil
		})
		st, f := handoffSameProcess(t, server)
		adopted, err := Adopt(f, st, Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer adopted.Close()
		onSocket(adopted, func(fd int) error {
			for _, o := range opts {
				if got, err := unix.GetsockoptInt(fd, o.level, o.opt); err != nil || got != o.value {
					t.Errorf("adopted socket: %s = %d (%v), want %d", o.name, got, err, o.value)
				}
			}
			return nil
		})
		exchangeConns(t, adopted, client, n)
	})

	t.Run("close-notify-sent", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		server, client := kernelPeers(t, scfg, ccfg, Options{})
		if err := server.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		st, f := handoffSameProcess(t, server)
		if !st.CloseNotifySent || st.PeerEnd != PeerEndNone {
			t.Fatalf("state: close_notify sent %v, peer end %q", st.CloseNotifySent, st.PeerEnd)
		}
		adopted, err := Adopt(f, st, Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer adopted.Close()
		if _, err := adopted.Write([]byte("x")); !errors.Is(err, errWriteAfterClose) {
			t.Fatalf("Write after close_notify, adopted: %v", err)
		}
		if got, err := io.ReadAll(struct{ io.Reader }{client}); err != nil || len(got) != 0 || !client.CloseNotified() {
			t.Fatalf("client read %d bytes, %v, close_notify %v: want the close_notify sent before the handoff", len(got), err, client.CloseNotified())
		}
		streamAndCheck(t, "client → adopted", struct{ io.Writer }{client}, client.CloseWrite, struct{ io.Reader }{adopted}, 50, n)
		if !adopted.CloseNotified() {
			t.Fatal("adopted Conn read no close_notify")
		}
	})

	t.Run("close-notify-received", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		server, client := kernelPeers(t, scfg, ccfg, Options{})
		if err := client.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if got, err := io.ReadAll(struct{ io.Reader }{server}); err != nil || len(got) != 0 {
			t.Fatalf("server read %d bytes, %v", len(got), err)
		}
		st, f := handoffSameProcess(t, server)
		if st.CloseNotifySent || st.PeerEnd != PeerEndCloseNotify {
			t.Fatalf("state: close_notify sent %v, peer end %q", st.CloseNotifySent, st.PeerEnd)
		}
		adopted, err := Adopt(f, st, Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer adopted.Close()
		if n, err := adopted.Read(make([]byte, 10)); n != 0 || err != io.EOF || !adopted.CloseNotified() {
			t.Fatalf("adopted Read = %d, %v, close_notify %v; want io.EOF after the peer's close_notify", n, err, adopted.CloseNotified())
		}
		streamAndCheck(t, "adopted → client", struct{ io.Writer }{adopted}, adopted.CloseWrite, struct{ io.Reader }{client}, 51, n)
	})
}

// TestKernelAdoptKeyWear: key wear goes on from the count the old owner
// handed over, under the connection's own record limit, which travels in
// the state (the adopter's option, 1, does not apply). That limit is set
// just above the count, so its first record (TX) or the first record it opens (RX) reaches the
// limit: on TLS 1.3 with kernel rekey it renews its key (TX) or asks the
// peer to (RX), and every byte arrives; elsewhere it fails with
// ErrKeyExhausted. A Conn that started counting from zero would do
// neither.
func TestKernelAdoptKeyWear(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	for _, version := range []uint16{tls.VersionTLS13, tls.VersionTLS12} {
		for _, dir := range []string{"tx", "rx"} {
			t.Run(tls.VersionName(version)+"/"+dir, func(t *testing.T) {
				checkNoFDLeak(t, kerneltest.OpenFDs)
				scfg, ccfg := p.configs(connCase{version: version})
				server, client := kernelPeers(t, scfg, ccfg, Options{})
				// Under the first keys: 200 records up, 40 down. The limit
				// applies to both directions: RX's, 201, stays further
				// than sealMargin from the TX key's count, so that only
				// the direction under test reaches it.
				for range 200 {
					if _, err := client.Write([]byte{'u'}); err != nil {
						t.Fatal(err)
					}
				}
				for range 40 {
					if _, err := server.Write(bytes.Repeat([]byte{'d'}, 100)); err != nil {
						t.Fatal(err)
					}
				}
				if _, err := io.ReadFull(server, make([]byte, 200)); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(client, make([]byte, 4000)); err != nil {
					t.Fatal(err)
				}
				st, f := handoffSameProcess(t, server)
				if st.TX.Seq < 40 || st.RX.Seq < 200 || st.TX.Seq+sealMargin >= st.RX.Seq {
					t.Fatalf("handed off at TX %d RX %d records, want at least 40 and 200, %d apart", st.TX.Seq, st.RX.Seq, sealMargin)
				}
				limit := st.RX.Seq + 1
				if dir == "tx" {
					limit = st.TX.Seq + sealMargin
				}
				st.RecordLimit = limit // the connection's own limit travels with it
				adopted, err := Adopt(f, st, Options{RecordLimit: 1})
				if err != nil {
					t.Fatal(err)
				}
				defer adopted.Close()
				before := Stats()
				rekeys := version == tls.VersionTLS13 && Probe().Rekey
				if dir == "tx" {
					_, err := adopted.Write([]byte("after"))
					sent := Stats().KeyUpdatesSent - before.KeyUpdatesSent
					if !rekeys {
						if !errors.Is(err, ErrKeyExhausted) || sent != 0 {
							t.Fatalf("first Write at the limit: %v, %d KeyUpdates; want ErrKeyExhausted", err, sent)
						}
						return
					}
					if err != nil || sent != 1 {
						t.Fatalf("first Write at the limit: %v, %d KeyUpdates sent; want the key renewed once", err, sent)
					}
					buf := make([]byte, 5)
					if _, err := io.ReadFull(client, buf); err != nil || string(buf) != "after" {
						t.Fatalf("client read %q, %v under the renewed key", buf, err)
					}
					if seq, _ := adopted.kernelSeq(optTLSTX); seq != 1 {
						t.Fatalf("the renewed key protected %d records, want 1", seq)
					}
					return
				}
				// RX: one record of one byte reaches the limit.
				if _, err := client.Write([]byte("!")); err != nil {
					t.Fatal(err)
				}
				buf := make([]byte, 1)
				_, err = adopted.Read(buf)
				if !rekeys {
					if !errors.Is(err, ErrKeyExhausted) {
						t.Fatalf("Read at the limit: %v; want ErrKeyExhausted", err)
					}
					return
				}
				if err != nil || buf[0] != '!' {
					t.Fatalf("Read at the limit: %q, %v", buf, err)
				}
				// The request went out (sent by the reader, or with the next
				// write); the client applies it with its next read and
				// answers with its next write, which the adopter applies.
				if _, err := adopted.Write([]byte("?")); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(client, buf); err != nil || buf[0] != '?' {
					t.Fatalf("client read %q, %v", buf, err)
				}
				if _, err := client.Write([]byte("+")); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(adopted, buf); err != nil || buf[0] != '+' {
					t.Fatalf("adopted read %q, %v after the client's KeyUpdate", buf, err)
				}
				if sent, applied := Stats().KeyUpdatesSent-before.KeyUpdatesSent, Stats().KeyUpdates-before.KeyUpdates; sent != 2 || applied != 2 {
					t.Fatalf("%d KeyUpdates sent, %d applied; want the adopter's request and the client's answer, each applied", sent, applied)
				}
			})
		}
	}
}

// TestKernelHandoffRefused: a connection Handoff refuses goes on as if
// nothing happened: RX in userspace (the kernel seals, Go opens), bytes
// decrypted into this process and not yet read, and a kernel record count
// above the key wear accounting's (the count set below the records sealed
// by hand). Each carries 256 KiB each way afterwards, SHA-256 checked, and
// close_notify both ways.
func TestKernelHandoffRefused(t *testing.T) {
	kerneltest.Require(t)
	p := newTestPKI(t)
	t.Run("rx-userspace", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
		pr, err := dialPair(t, scfg, ccfg, Options{DisableRX: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _, err = pr.server.Handoff()
		wantHandoffRefused(t, err, HandoffNotOffloaded, "RX userspace")
		exchange(t, pr, smallBytes)
	})
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	t.Run("buffered-plaintext", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		server, client := kernelPeers(t, scfg, ccfg, Options{})
		line := bytes.Repeat([]byte("0123456789"), 300)
		if _, err := client.Write(line); err != nil {
			t.Fatal(err)
		}
		// As Read does after read(2) met a control record: the next
		// record, data here, lands in this process.
		server.readMu.Lock()
		err := server.readKernelRecord()
		server.readMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		head := make([]byte, 10)
		if _, err := io.ReadFull(server, head); err != nil {
			t.Fatal(err)
		}
		_, _, err = server.Handoff()
		wantHandoffRefused(t, err, HandoffBufferedPlaintext, "2990 decrypted bytes")
		rest := make([]byte, len(line)-10)
		if _, err := io.ReadFull(server, rest); err != nil || !bytes.Equal(append(head, rest...), line) {
			t.Fatalf("after the refusal the buffered bytes read back as %d bytes, %v", len(rest), err)
		}
		exchangeConns(t, server, client, smallBytes)
	})
	t.Run("record-count", func(t *testing.T) {
		checkNoFDLeak(t, kerneltest.OpenFDs)
		server, client := kernelPeers(t, scfg, ccfg, Options{})
		for range 3 {
			if _, err := server.Write([]byte("record")); err != nil {
				t.Fatal(err)
			}
		}
		server.writeMu.Lock()
		bound := server.txBound
		server.txBound = 1
		server.writeMu.Unlock()
		_, _, err := server.Handoff()
		wantHandoffRefused(t, err, HandoffRecordCount, "counted at most 1")
		server.writeMu.Lock()
		server.txBound = bound
		server.writeMu.Unlock()
		if _, err := io.ReadFull(client, make([]byte, 18)); err != nil {
			t.Fatal(err)
		}
		exchangeConns(t, server, client, smallBytes)
	})
}

// BenchmarkKernelHandoff measures the pause of one connection's move:
// Handoff, encoding the state, passing it and the socket over a Unix
// socket (fdpass), decoding, Adopt, and closing the old Conn and the
// descriptors, in one process. The connection goes back and forth between
// two owners; at the end it still carries bytes both ways.
func BenchmarkKernelHandoff(b *testing.B) {
	if err := kerneltest.Available(); err != nil {
		b.Skip(err)
	}
	p := newTestPKI(b)
	scfg, ccfg := p.configs(connCase{version: tls.VersionTLS13})
	server, client := kernelPeers(b, scfg, ccfg, Options{})
	a, c, err := fdpass.Pair()
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	defer c.Close()
	conn := server
	// The pause's parts: the old owner's (Handoff, Encode, Send, closes)
	// and the new owner's (Receive, Decode, Adopt).
	var handoffTime, adoptTime time.Duration
	for b.Loop() {
		t0 := time.Now()
		st, sock, err := conn.Handoff()
		if err != nil {
			b.Fatal(err)
		}
		enc, err := st.Encode()
		if err == nil {
			err = fdpass.Send(a, kindHandoff, enc, sock)
		}
		st.Zero()
		clear(enc)
		conn.Close()
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		m, err := fdpass.Receive(c, fdpass.Limits{Files: 1})
		if err != nil {
			b.Fatal(err)
		}
		st, err = DecodeHandoffState(m.Payload)
		if err != nil {
			b.Fatal(err)
		}
		conn, err = Adopt(m.Files[0], st, Options{})
		m.Close()
		st.Zero()
		if err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		handoffTime += t1.Sub(t0)
		adoptTime += t2.Sub(t1)
	}
	b.StopTimer()
	b.ReportMetric(float64(handoffTime.Nanoseconds())/float64(b.N), "handoff-ns/op")
	b.ReportMetric(float64(adoptTime.Nanoseconds())/float64(b.N), "adopt-ns/op")
	defer conn.Close()
	if _, err := conn.Write([]byte("ping")); err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(client, buf); err != nil || string(buf) != "ping" {
		b.Fatalf("client read %q, %v after the handoffs", buf, err)
	}
	if _, err := client.Write([]byte("pong")); err != nil {
		b.Fatal(err)
	}
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "pong" {
		b.Fatalf("read %q, %v after the handoffs", buf, err)
	}
}
