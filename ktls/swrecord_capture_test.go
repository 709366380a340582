package ktls

// Test helpers shared by the key schedule and record opener tests: a real
// crypto/tls connection over loopback TCP whose wire bytes and key log are
// captured, and an independent record sealer.

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/chacha20poly1305"

	"github.com/ktlsingress/caddy-ktls/internal/testpki"
)

// testKeyLog collects NSS key log lines (label → secret). For TLS 1.2 the
// label is CLIENT_RANDOM and the secret the master secret.
type testKeyLog struct {
	mu      sync.Mutex
	secrets map[string][]byte
}

func (k *testKeyLog) Write(b []byte) (int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			return 0, errors.New("malformed key log line " + line)
		}
		secret, err := hex.DecodeString(f[2])
		if err != nil {
			return 0, err
		}
		if k.secrets == nil {
			k.secrets = map[string][]byte{}
		}
		k.secrets[f[0]] = secret
	}
	return len(b), nil
}

func (k *testKeyLog) secret(t testing.TB, label string) []byte {
	t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	s, ok := k.secrets[label]
	if !ok {
		t.Fatalf("key log has no %s (have %d labels)", label, len(k.secrets))
	}
	return s
}

// recordingConn keeps a copy of every byte read from and written to the
// wrapped connection.
type recordingConn struct {
	net.Conn
	mu      sync.Mutex
	in, out bytes.Buffer
}

func (c *recordingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	c.in.Write(p[:n])
	c.mu.Unlock()
	return n, err
}

func (c *recordingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.mu.Lock()
	c.out.Write(p[:n])
	c.mu.Unlock()
	return n, err
}

// tlsCapture is one finished client→server crypto/tls session as seen on
// the server's socket.
type tlsCapture struct {
	state          tls.ConnectionState // server side
	keyLog         *testKeyLog
	clientToServer []byte // raw wire bytes the server read
	serverToClient []byte // raw wire bytes the server wrote
	sent           []byte // application bytes the client wrote
}

// loopbackPair returns both ends of a fresh loopback TCP connection.
func loopbackPair(t testing.TB) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type result struct {
		c   net.Conn
		err error
	}
	accepted := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		accepted <- result{c, err}
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	r := <-accepted
	if r.err != nil {
		client.Close()
		t.Fatal(r.err)
	}
	t.Cleanup(func() { client.Close(); r.c.Close() })
	// A broken exchange fails with a timeout instead of hanging the binary.
	deadline := time.Now().Add(5 * time.Minute)
	client.SetDeadline(deadline)
	r.c.SetDeadline(deadline)
	return client, r.c
}

// tlsConfigs returns a matching server and client configuration. The
// server logs its keys into kl.
func tlsConfigs(t testing.TB, kl io.Writer) (server, client *tls.Config) {
	t.Helper()
	ca := testpki.NewCA(t, "swrecord test CA")
	leaf := ca.Server(t)
	server = &tls.Config{Certificates: []tls.Certificate{leaf.TLS}, KeyLogWriter: kl}
	client = &tls.Config{RootCAs: ca.Pool, ServerName: "localhost"}
	return server, client
}

// captureGoTLS runs a crypto/tls client that sends payloadLen random bytes
// in writes of varying size and then close_notify, to a crypto/tls server
// that reads them all; it returns what crossed the wire and the key log.
func captureGoTLS(t testing.TB, version uint16, suites []uint16, payloadLen int) *tlsCapture {
	t.Helper()
	kl := &testKeyLog{}
	serverCfg, clientCfg := tlsConfigs(t, kl)
	serverCfg.MinVersion, serverCfg.MaxVersion = version, version
	clientCfg.CipherSuites = suites // honoured for TLS 1.2 only

	rawClient, rawServer := loopbackPair(t)
	rec := &recordingConn{Conn: rawServer}
	payload := make([]byte, payloadLen)
	rng := rand.New(rand.NewPCG(uint64(payloadLen), uint64(version)))
	for i := range payload {
		payload[i] = byte(rng.Uint32())
	}

	type served struct {
		state tls.ConnectionState
		got   []byte
		err   error
	}
	done := make(chan served, 1)
	go func() {
		srv := tls.Server(rec, serverCfg)
		got, err := io.ReadAll(srv) // ends with io.EOF on close_notify
		done <- served{srv.ConnectionState(), got, err}
	}()

	cl := tls.Client(rawClient, clientCfg)
	for off := 0; off < len(payload); {
		// 1 byte up to beyond one full record, so records of all sizes occur.
		n := min(len(payload)-off, 1+rng.IntN(20000))
		if _, err := cl.Write(payload[off : off+n]); err != nil {
			t.Fatalf("client write: %v", err)
		}
		off += n
	}
	if err := cl.CloseWrite(); err != nil {
		t.Fatalf("client close_notify: %v", err)
	}
	s := <-done
	if s.err != nil {
		t.Fatalf("server read: %v", s.err)
	}
	if !bytes.Equal(s.got, payload) {
		t.Fatalf("crypto/tls itself delivered %d bytes, want the %d sent", len(s.got), len(payload))
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return &tlsCapture{
		state:          s.state,
		keyLog:         kl,
		clientToServer: bytes.Clone(rec.in.Bytes()),
		serverToClient: bytes.Clone(rec.out.Bytes()),
		sent:           payload,
	}
}

// wireRecord is one record cut from a byte stream.
type wireRecord struct {
	header [5]byte
	body   []byte
}

// splitRecords cuts a captured stream into records; the bodies are copies.
func splitRecords(t testing.TB, stream []byte) []wireRecord {
	t.Helper()
	var recs []wireRecord
	for len(stream) > 0 {
		if len(stream) < 5 {
			t.Fatalf("stream ends in a record header: %x", stream)
		}
		var r wireRecord
		copy(r.header[:], stream)
		n := int(binary.BigEndian.Uint16(r.header[3:5]))
		if len(stream) < 5+n {
			t.Fatalf("stream ends inside a %d-byte record", n)
		}
		r.body = bytes.Clone(stream[5 : 5+n])
		recs = append(recs, r)
		stream = stream[5+n:]
	}
	return recs
}

// testSealer protects records independently of recordOpener, with
// crypto/aes, crypto/cipher and chacha20poly1305 directly.
type testSealer struct {
	version uint16
	aead    cipher.AEAD
	iv      []byte
	seq     uint64
}

func newTestSealer(t testing.TB, version, suite uint16, key, iv []byte) *testSealer {
	t.Helper()
	// The AEAD comes from the suite's name, not from the cipherSuites table
	// the opener uses.
	var aead cipher.AEAD
	var err error
	if strings.Contains(tls.CipherSuiteName(suite), "_CHACHA20_POLY1305_") {
		aead, err = chacha20poly1305.New(key)
	} else {
		var block cipher.Block
		if block, err = aes.NewCipher(key); err == nil {
			aead, err = cipher.NewGCM(block)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return &testSealer{version: version, aead: aead, iv: bytes.Clone(iv)}
}

func (s *testSealer) seqNonce() []byte {
	nonce := bytes.Clone(s.iv)
	for i := range 8 {
		nonce[len(nonce)-1-i] ^= byte(s.seq >> (8 * i))
	}
	return nonce
}

// seal returns a whole record of content type typ. For TLS 1.3, padding
// zero bytes are added to the inner plaintext; TLS 1.2 ignores padding.
func (s *testSealer) seal(typ uint8, plaintext []byte, padding int) []byte {
	defer func() { s.seq++ }()
	if s.version == tls.VersionTLS13 {
		inner := append(append(bytes.Clone(plaintext), typ), make([]byte, padding)...)
		rec := []byte{recordApplicationData, 3, 3, 0, 0}
		binary.BigEndian.PutUint16(rec[3:], uint16(len(inner)+s.aead.Overhead()))
		return s.aead.Seal(rec, s.seqNonce(), inner, rec[:5])
	}
	ad := binary.BigEndian.AppendUint64(nil, s.seq)
	ad = append(ad, typ, 3, 3)
	ad = binary.BigEndian.AppendUint16(ad, uint16(len(plaintext)))
	rec := []byte{typ, 3, 3, 0, 0}
	var nonce []byte
	if len(s.iv) == 12 {
		nonce = s.seqNonce()
	} else {
		explicit := binary.BigEndian.AppendUint64(nil, s.seq)
		nonce = append(bytes.Clone(s.iv), explicit...)
		rec = append(rec, explicit...)
	}
	rec = s.aead.Seal(rec, nonce, plaintext, ad)
	binary.BigEndian.PutUint16(rec[3:5], uint16(len(rec)-5))
	return rec
}

// sealInner is seal for TLS 1.3 with a caller-built inner plaintext (to
// make malformed ones).
func (s *testSealer) sealInner(inner []byte) []byte {
	defer func() { s.seq++ }()
	rec := []byte{recordApplicationData, 3, 3, 0, 0}
	binary.BigEndian.PutUint16(rec[3:], uint16(len(inner)+s.aead.Overhead()))
	return s.aead.Seal(rec, s.seqNonce(), inner, rec[:5])
}

// openAll opens records with o and returns the application data, the
// content types seen and the plaintext of the last alert.
func openAll(t testing.TB, o *recordOpener, recs []wireRecord) (appData []byte, types []uint8, alert []byte) {
	t.Helper()
	for i, r := range recs {
		typ, pt, err := o.Open(r.header, r.body)
		if err != nil {
			t.Fatalf("record %d (%d bytes): %v", i, len(r.body), err)
		}
		types = append(types, typ)
		switch typ {
		case recordApplicationData:
			appData = append(appData, pt...)
		case recordAlert:
			alert = bytes.Clone(pt)
		}
	}
	return appData, types, alert
}

func sha(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
