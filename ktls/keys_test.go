package ktls

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"strings"
	"testing"
)

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// RFC 8448 section 3 ("Simple 1-RTT Handshake"), TLS_AES_128_GCM_SHA256:
// the application traffic secrets and the write keys derived from them
// ("{server} derive write traffic keys for application data" and the
// client's counterpart).
const (
	rfc8448ServerAppSecret = "a1 1a f9 f0 55 31 f8 56 ad 47 11 6b 45 a9 50 32 82 04 b4 f4 4b fb 6b 3a 4b 4f 1f 3f cb 63 16 43"
	rfc8448ServerAppKey    = "9f 02 28 3b 6c 9c 07 ef c2 6b b9 f2 ac 92 e3 56"
	rfc8448ServerAppIV     = "cf 78 2b 88 dd 83 54 9a ad f1 e9 84"
	rfc8448ClientAppSecret = "9e 40 64 6c e7 9a 7f 9d c0 5a f8 88 9b ce 65 52 87 5a fa 0b 06 df 00 87 f7 92 eb b7 c1 75 04 a5"
	rfc8448ClientAppKey    = "17 42 2d da 59 6e d5 d9 ac d8 90 e3 c6 3f 50 51"
	rfc8448ClientAppIV     = "5b 78 92 3d ee 08 57 90 33 e5 23 d9"
)

func TestTrafficKeysRFC8448(t *testing.T) {
	for _, v := range []struct{ name, secret, key, iv string }{
		{"server", rfc8448ServerAppSecret, rfc8448ServerAppKey, rfc8448ServerAppIV},
		{"client", rfc8448ClientAppSecret, rfc8448ClientAppKey, rfc8448ClientAppIV},
	} {
		key, iv, err := trafficKeys(tls.TLS_AES_128_GCM_SHA256, unhex(t, v.secret))
		if err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		if want := unhex(t, v.key); !bytes.Equal(key, want) {
			t.Errorf("%s key = %x, want %x", v.name, key, want)
		}
		if want := unhex(t, v.iv); !bytes.Equal(iv, want) {
			t.Errorf("%s iv = %x, want %x", v.name, iv, want)
		}
	}
}

func TestTrafficKeysLengthsPerSuite(t *testing.T) {
	for _, c := range []struct {
		suite           uint16
		secretLen, klen int
	}{
		{tls.TLS_AES_128_GCM_SHA256, 32, 16},
		{tls.TLS_AES_256_GCM_SHA384, 48, 32},
		{tls.TLS_CHACHA20_POLY1305_SHA256, 32, 32},
	} {
		secret := bytes.Repeat([]byte{7}, c.secretLen)
		key, iv, err := trafficKeys(c.suite, secret)
		if err != nil {
			t.Fatalf("%s: %v", tls.CipherSuiteName(c.suite), err)
		}
		if len(key) != c.klen || len(iv) != 12 {
			t.Errorf("%s: key %d bytes, iv %d bytes; want %d and 12", tls.CipherSuiteName(c.suite), len(key), len(iv), c.klen)
		}
		next, err := nextTrafficSecret(c.suite, secret)
		if err != nil || len(next) != c.secretLen || bytes.Equal(next, secret) {
			t.Errorf("%s: next secret %x, %v; want %d new bytes", tls.CipherSuiteName(c.suite), next, err, c.secretLen)
		}
	}
}

func TestKeyScheduleRejectsBadInput(t *testing.T) {
	secret32 := make([]byte, 32)
	for name, err := range map[string]error{
		"tls13 unknown suite":       errOf3(trafficKeys(tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, secret32)),
		"tls13 short secret":        errOf3(trafficKeys(tls.TLS_AES_128_GCM_SHA256, secret32[:31])),
		"tls13 sha384 secret len":   errOf3(trafficKeys(tls.TLS_AES_256_GCM_SHA384, secret32)),
		"keyupdate unknown suite":   errOf2(nextTrafficSecret(0x1305, secret32)),
		"keyupdate short secret":    errOf2(nextTrafficSecret(tls.TLS_CHACHA20_POLY1305_SHA256, nil)),
		"tls12 tls13 suite":         errOf2(tls12Keys(tls.TLS_AES_128_GCM_SHA256, make([]byte, 48), secret32, secret32)),
		"tls12 cbc suite":           errOf2(tls12Keys(tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA, make([]byte, 48), secret32, secret32)),
		"tls12 short master":        errOf2(tls12Keys(tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, secret32, secret32, secret32)),
		"tls12 short server random": errOf2(tls12Keys(tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, make([]byte, 48), secret32, secret32[:16])),
	} {
		if err == nil {
			t.Errorf("%s: no error", name)
		} else if !strings.HasPrefix(err.Error(), "ktls: ") {
			t.Errorf("%s: error %q does not name the package", name, err)
		}
	}
}

// errOf2 and errOf3 return the error of a two- and three-result call.
func errOf2[A any](_ A, err error) error         { return err }
func errOf3[A, B any](_ A, _ B, err error) error { return err }

// The published TLS 1.2 PRF test vector (P_SHA256, IETF TLS WG list,
// "tls1.2-prf-test-vectors"): secret, label "test label", seed, 100 bytes.
func TestTLS12PRFVector(t *testing.T) {
	out := tls12PRF(sha256.New,
		unhex(t, "9b be 43 6b a9 40 f0 17 b1 76 52 84 9a 71 db 35"),
		"test label",
		unhex(t, "a0 ba 9f 93 6c da 31 18 27 a6 f7 96 ff d5 19 8c"),
		100)
	want := unhex(t, `e3 f2 29 ba 72 7b e1 7b 8d 12 26 20 55 7c d4 53 c2 aa b2 1d 07 c3 d4 95 32 9b 52 d4 e6 1e db 5a
		6b 30 17 91 e9 0d 35 c9 c9 a4 6b 4e 14 ba f9 af 0f a0 22 f7 07 7d ef 17 ab fd 37 97 c0 56 4b ab
		4f bc 91 66 6e 9d ef 9b 97 fc e3 4f 79 67 89 ba a4 80 82 d1 22 ee 42 c5 a7 2e 5a 51 10 ff f7 01
		87 34 7b 66`)
	if !bytes.Equal(out, want) {
		t.Fatalf("PRF = %x\nwant  %x", out, want)
	}
}

// TestTLS12KeysAgainstGoTLS proves the whole TLS 1.2 derivation: a real
// crypto/tls 1.2 session runs over loopback, the master secret comes from
// its key log and the randoms from the captured hellos, and the derived
// keys must open the client's protected records (Finished, all application
// data, close_notify) and the server's Finished.
func TestTLS12KeysAgainstGoTLS(t *testing.T) {
	for _, suite := range []uint16{
		tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
		tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
		tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
	} {
		t.Run(tls.CipherSuiteName(suite), func(t *testing.T) {
			c := captureGoTLS(t, tls.VersionTLS12, []uint16{suite}, 200<<10)
			if c.state.Version != tls.VersionTLS12 || c.state.CipherSuite != suite {
				t.Fatalf("negotiated %#04x/%s, want TLS 1.2 %s", c.state.Version, tls.CipherSuiteName(c.state.CipherSuite), tls.CipherSuiteName(suite))
			}
			clientRecs := splitRecords(t, c.clientToServer)
			serverRecs := splitRecords(t, c.serverToClient)
			// ClientHello and ServerHello bodies: handshake type (1), length
			// (3), version (2), random (32).
			clientRandom := clientRecs[0].body[6:38]
			serverRandom := serverRecs[0].body[6:38]
			kb, err := tls12Keys(suite, c.keyLog.secret(t, "CLIENT_RANDOM"), clientRandom, serverRandom)
			if err != nil {
				t.Fatal(err)
			}

			clientOpener, err := newRecordOpener(tls.VersionTLS12, suite, kb.ClientKey, kb.ClientIV, 0)
			if err != nil {
				t.Fatal(err)
			}
			appData, types, alert := openAll(t, clientOpener, afterChangeCipherSpec(t, clientRecs))
			if sha(appData) != sha(c.sent) || len(appData) != len(c.sent) {
				t.Fatalf("opened %d bytes sha256 %s, want %d bytes sha256 %s", len(appData), sha(appData), len(c.sent), sha(c.sent))
			}
			if types[0] != recordHandshake || types[len(types)-1] != recordAlert || !bytes.Equal(alert, []byte{1, 0}) {
				t.Fatalf("record types %v, last alert %x; want Finished first and close_notify (01 00) last", types, alert)
			}

			serverOpener, err := newRecordOpener(tls.VersionTLS12, suite, kb.ServerKey, kb.ServerIV, 0)
			if err != nil {
				t.Fatal(err)
			}
			sr := afterChangeCipherSpec(t, serverRecs)[0]
			typ, fin, err := serverOpener.Open(sr.header, sr.body)
			if err != nil || typ != recordHandshake || len(fin) != 16 || fin[0] != 20 {
				t.Fatalf("server Finished: type %d, %x, %v; want a 16-byte Finished (type 20)", typ, fin, err)
			}
		})
	}
}

// afterChangeCipherSpec returns the records after the first
// ChangeCipherSpec: the protected ones.
func afterChangeCipherSpec(t testing.TB, recs []wireRecord) []wireRecord {
	t.Helper()
	for i, r := range recs {
		if r.header[0] == recordChangeCipherSpec {
			return recs[i+1:]
		}
	}
	t.Fatal("no ChangeCipherSpec in stream")
	return nil
}

// TestNextTrafficSecretAgainstGoKeyUpdate checks the KeyUpdate derivation
// against crypto/tls in both directions. After a real TLS 1.3 handshake the
// test takes over the server's socket: it seals a KeyUpdate
// (update_requested) with the server key, moves to
// nextTrafficSecret(server secret) and sends data, which the Go client can
// only read if both sides derived the same next secret. The Go client
// answers with its own KeyUpdate and moves its write key; the test opener
// follows with nextTrafficSecret(client secret) and must open the client's
// next data. Two rounds check the chain.
func TestNextTrafficSecretAgainstGoKeyUpdate(t *testing.T) {
	kl := &testKeyLog{}
	serverCfg, clientCfg := tlsConfigs(t, kl)
	serverCfg.MinVersion = tls.VersionTLS13
	// No NewSessionTicket: the server's first application record has
	// sequence number 0.
	serverCfg.SessionTicketsDisabled = true
	rawClient, rawServer := loopbackPair(t)

	srv := tls.Server(rawServer, serverCfg)
	hsErr := make(chan error, 1)
	go func() { hsErr <- srv.Handshake() }()
	cl := tls.Client(rawClient, clientCfg)
	if err := cl.Handshake(); err != nil {
		t.Fatal(err)
	}
	// The client sends nothing more until the server finished reading its
	// Finished, so crypto/tls on the server side buffered no later record.
	if err := <-hsErr; err != nil {
		t.Fatal(err)
	}
	suite := srv.ConnectionState().CipherSuite
	clientSecret := kl.secret(t, "CLIENT_TRAFFIC_SECRET_0")
	serverSecret := kl.secret(t, "SERVER_TRAFFIC_SECRET_0")

	key, iv, err := trafficKeys(suite, clientSecret)
	if err != nil {
		t.Fatal(err)
	}
	opener, err := newRecordOpener(tls.VersionTLS13, suite, key, iv, 0)
	if err != nil {
		t.Fatal(err)
	}
	if key, iv, err = trafficKeys(suite, serverSecret); err != nil {
		t.Fatal(err)
	}
	sealer := newTestSealer(t, tls.VersionTLS13, suite, key, iv)

	expectFromClient := func(wantType uint8, want []byte) {
		t.Helper()
		var hdr [5]byte
		if _, err := io.ReadFull(rawServer, hdr[:]); err != nil {
			t.Fatal(err)
		}
		body := make([]byte, binary.BigEndian.Uint16(hdr[3:5]))
		if _, err := io.ReadFull(rawServer, body); err != nil {
			t.Fatal(err)
		}
		typ, pt, err := opener.Open(hdr, body)
		if err != nil {
			t.Fatal(err)
		}
		if typ != wantType || !bytes.Equal(pt, want) {
			t.Fatalf("client record: type %d %x, want type %d %x", typ, pt, wantType, want)
		}
	}
	clientWrites := func(msg string) {
		t.Helper()
		if _, err := cl.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
	}

	clientWrites("before any update")
	expectFromClient(recordApplicationData, []byte("before any update"))
	for round := 1; round <= 2; round++ {
		// KeyUpdate{request_update = update_requested(1)} (RFC 8446 section 4.6.3).
		update := sealer.seal(recordHandshake, []byte{24, 0, 0, 1, 1}, 0)
		if serverSecret, err = nextTrafficSecret(suite, serverSecret); err != nil {
			t.Fatal(err)
		}
		if key, iv, err = trafficKeys(suite, serverSecret); err != nil {
			t.Fatal(err)
		}
		sealer = newTestSealer(t, tls.VersionTLS13, suite, key, iv)
		msg := fmt.Sprintf("server data under key generation %d", round)
		if _, err := rawServer.Write(append(update, sealer.seal(recordApplicationData, []byte(msg), 0)...)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 100)
		n, err := cl.Read(buf)
		if err != nil || string(buf[:n]) != msg {
			t.Fatalf("round %d: Go client read %q, %v; want %q (server next secret differs from crypto/tls's)", round, buf[:n], err, msg)
		}

		// The client's answer: KeyUpdate{update_not_requested} under its old key.
		expectFromClient(recordHandshake, []byte{24, 0, 0, 1, 0})
		if clientSecret, err = nextTrafficSecret(suite, clientSecret); err != nil {
			t.Fatal(err)
		}
		if key, iv, err = trafficKeys(suite, clientSecret); err != nil {
			t.Fatal(err)
		}
		if err := opener.Rekey(key, iv); err != nil {
			t.Fatal(err)
		}
		msg = fmt.Sprintf("client data under key generation %d", round)
		clientWrites(msg)
		expectFromClient(recordApplicationData, []byte(msg))
	}
}
