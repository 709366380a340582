package ktls

import (
	"crypto/tls"
	"errors"
	"io"
	"testing"
)

// FuzzControlRecord feeds arbitrary non-data records (alert, handshake,
// ChangeCipherSpec, unknown types) to handleControl, the code that acts on
// what a peer sends besides application data, up to three times in a row
// (a KeyUpdate storm against a burst of 2). It must never panic; it may
// only accept TLS 1.3 handshake records; every refusal is close_notify
// (io.EOF), the peer's own alert, or a protocolError carrying the alert to
// answer with. The connection reads with a userspace opener and has sent
// close_notify, so a KeyUpdate never reaches kernel sockets (there are none).
func FuzzControlRecord(f *testing.F) {
	f.Add(uint8(recordAlert), []byte{1, 0}, false, true)
	f.Add(uint8(recordAlert), []byte{2, 40}, false, true)
	f.Add(uint8(recordAlert), []byte{2}, false, false)
	f.Add(uint8(recordHandshake), []byte{msgKeyUpdate, 0, 0, 1, 0}, false, true)
	f.Add(uint8(recordHandshake), []byte{msgKeyUpdate, 0, 0, 1, 1}, false, true)
	f.Add(uint8(recordHandshake), []byte{msgKeyUpdate, 0, 0, 1, 2}, false, true)
	f.Add(uint8(recordHandshake), []byte{msgKeyUpdate, 0, 0, 1, 0, msgKeyUpdate, 0, 0, 1, 0}, false, true)
	f.Add(uint8(recordHandshake), []byte{msgNewSessionTicket, 0, 0, 2, 9, 9}, true, true)
	f.Add(uint8(recordHandshake), []byte{msgNewSessionTicket, 0, 0, 2, 9, 9}, false, true)
	f.Add(uint8(recordHandshake), []byte{msgKeyUpdate, 0, 0}, false, true)
	f.Add(uint8(recordHandshake), []byte{0, 0, 0, 0}, false, false) // TLS 1.2 HelloRequest: renegotiation
	f.Add(uint8(recordChangeCipherSpec), []byte{1}, false, true)
	f.Add(uint8(99), []byte{}, false, true)
	secret := make([]byte, 32)
	key, iv, err := trafficKeys(tls.TLS_AES_128_GCM_SHA256, secret)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, recordType uint8, payload []byte, isClient, tls13 bool) {
		if recordType == recordApplicationData {
			return // data, never a control record
		}
		version := uint16(tls.VersionTLS12)
		if tls13 {
			version = tls.VersionTLS13
		}
		c := &Conn{
			isClient: isClient,
			off:      Offload{Version: version, CipherSuite: tls.TLS_AES_128_GCM_SHA256},
			rxSecret: secret,
			txSecret: secret,
			limiter:  newTokenBucket(Rate{PerSecond: 1, Burst: 2}),
			wroteEOF: true, // updateTX sends nothing
		}
		if tls13 { // TLS 1.2 never gets to a KeyUpdate
			o, err := newRecordOpener(version, tls.TLS_AES_128_GCM_SHA256, key, iv, 0)
			if err != nil {
				t.Fatal(err)
			}
			c.opener = o
		}
		for range 3 {
			err := c.handleControl(recordType, payload)
			var pe *protocolError
			var alert AlertError
			switch {
			case err == nil && (recordType != recordHandshake || !tls13):
				t.Fatalf("record type %d (TLS 1.3: %v) accepted: %x", recordType, tls13, payload)
			case err == nil:
				continue
			case errors.Is(err, io.EOF):
				if recordType != recordAlert || len(payload) != 2 || payload[1] != 0 {
					t.Fatalf("EOF from record type %d %x: only close_notify ends the stream", recordType, payload)
				}
			case errors.As(err, &pe):
				if pe.alert == 0 {
					t.Fatalf("protocolError without an alert: %v", err)
				}
			case errors.As(err, &alert):
				if recordType != recordAlert || len(payload) != 2 || uint8(alert) != payload[1] {
					t.Fatalf("alert error %v from record type %d %x", err, recordType, payload)
				}
			default:
				t.Fatalf("error %v (%T) is neither close_notify, the peer's alert nor a protocolError", err, err)
			}
			return
		}
	})
}
