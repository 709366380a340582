package ktls

// Client session tickets under kernel RX. A TLS 1.3 server sends its
// NewSessionTicket after the handshake, under its application key, so an
// offloaded client meets it as a control record (or, with DisableRX, in
// the userspace opener) after crypto/tls has handed the socket over. Only
// crypto/tls holds the resumption secret a ticket needs, so the message is
// sealed again, as the record crypto/tls would have read (the server's
// first traffic key, at the sequence number of the records crypto/tls has
// opened under it), and fed to the tls.Conn through its record conn; the
// tls.Conn stores the session in its ClientSessionCache and the next dial
// can resume it. Nothing of the tenant's stream passes through crypto/tls.

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
)

// errTicketFed ends the tls.Conn's read once the fed record is consumed. It
// is temporary (net.Error), so crypto/tls does not make it sticky.
var errTicketFed net.Error = ticketFed{}

type ticketFed struct{}

func (ticketFed) Error() string   { return "ktls: session ticket fed" }
func (ticketFed) Timeout() bool   { return true }
func (ticketFed) Temporary() bool { return true }

// keepTicket passes one NewSessionTicket message (with its 4-byte header)
// to crypto/tls. Caller holds readMu. A ticket it cannot pass (the server
// has updated its key since, or crypto/tls rejects it) is dropped: resuming
// is an optimization, and the stream goes on.
func (c *Conn) keepTicket(msg []byte) {
	if !c.resume || c.ticketsLost {
		return
	}
	secret := c.keys.get("SERVER_TRAFFIC_SECRET_0")
	if !bytes.Equal(secret, c.rxSecret) {
		// crypto/tls opens records only under the first key.
		return
	}
	record, err := sealRecord13(c.off.CipherSuite, secret, c.ticketsFed, recordHandshake, msg)
	if err != nil {
		c.ticketsLost = true
		return
	}
	c.ticketsFed++
	c.record.feed(record)
	var one [1]byte
	_, err = c.tlsConn.Load().Read(one[:])
	c.record.feed(nil)
	if err != errTicketFed {
		// crypto/tls failed on the record: its input is now out of step.
		c.ticketsLost = true
		stats.ticketsDropped.Add(1)
		return
	}
	stats.ticketsKept.Add(1)
}

// sealRecord13 seals payload as a TLS 1.3 record of inner type typ under
// the traffic secret's key at sequence number seq (RFC 8446 section 5.2).
func sealRecord13(suite uint16, secret []byte, seq uint64, typ uint8, payload []byte) ([]byte, error) {
	cs, err := suiteFor(tls.VersionTLS13, suite)
	if err != nil {
		return nil, err
	}
	key, iv, err := trafficKeys(suite, secret)
	if err != nil {
		return nil, err
	}
	aead, err := cs.aead(key)
	if err != nil {
		return nil, err
	}
	if len(payload)+1 > maxPlaintext {
		return nil, fmt.Errorf("ktls: %d bytes do not fit one record", len(payload))
	}
	nonce := make([]byte, len(iv))
	copy(nonce, iv)
	var seqb [8]byte
	binary.BigEndian.PutUint64(seqb[:], seq)
	for i, b := range seqb {
		nonce[len(nonce)-8+i] ^= b
	}
	n := len(payload) + 1 + aead.Overhead()
	if n > maxCiphertextTLS13 {
		return nil, errors.New("ktls: record too long")
	}
	record := make([]byte, recordHeaderLen, recordHeaderLen+n)
	record[0], record[1], record[2] = recordApplicationData, 3, 3
	binary.BigEndian.PutUint16(record[3:], uint16(n))
	inner := append(append([]byte(nil), payload...), typ)
	return aead.Seal(record, nonce, inner, record[:recordHeaderLen]), nil
}
