package ktls

// Userspace record opener: decrypts TLS records in Go with the keys captured
// from the handshake. It serves connections where the operator keeps receive
// out of the kernel (Options.DisableRX: the kernel seals outgoing records,
// Go opens incoming ones) and the KeyUpdate handling on that path.

import (
	"crypto/cipher"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
)

// Record size limits (RFC 8446 section 5.2 and 5.4, RFC 5246 section 6.2.3).
const (
	maxPlaintext          = 1 << 14      // TLSPlaintext.fragment
	maxCiphertextTLS13    = 1<<14 + 256  // TLSCiphertext.encrypted_record
	maxCiphertextTLS12    = 1<<14 + 2048 // TLSCiphertext.fragment
	tls12ExplicitNonceLen = 8            // AES-GCM nonce_explicit (RFC 5288)
)

// TLS alert descriptions a record-layer failure maps to (RFC 8446
// section 6.2).
const (
	alertUnexpectedMessage = 10
	alertBadRecordMAC      = 20
	alertRecordOverflow    = 22
	alertDecodeError       = 50
	alertInternalError     = 80
)

// alertLevelFatal is the level byte of every alert but close_notify.
const alertLevelFatal = 2

// recordError is a record-layer failure. Alert is the alert the connection
// must be closed with; errors.Is matches any recordError with the same alert
// against the sentinels below.
type recordError struct {
	Alert  uint8
	Detail string
}

// Sentinels for errors.Is; each matches every recordError carrying its alert.
var (
	errUnexpectedMessage = &recordError{Alert: alertUnexpectedMessage}
	errBadRecordMAC      = &recordError{Alert: alertBadRecordMAC}
	errRecordOverflow    = &recordError{Alert: alertRecordOverflow}
	errDecodeError       = &recordError{Alert: alertDecodeError}
)

func (e *recordError) Error() string {
	var name string
	switch e.Alert {
	case alertUnexpectedMessage:
		name = "unexpected_message"
	case alertBadRecordMAC:
		name = "bad_record_mac"
	case alertRecordOverflow:
		name = "record_overflow"
	case alertDecodeError:
		name = "decode_error"
	case alertInternalError:
		name = "internal_error"
	default:
		name = "alert " + strconv.Itoa(int(e.Alert))
	}
	if e.Detail == "" {
		return "ktls: record: " + name
	}
	return "ktls: record: " + name + ": " + e.Detail
}

// Is makes errors.Is(err, errBadRecordMAC) true for any bad_record_mac error.
func (e *recordError) Is(target error) bool {
	t, ok := target.(*recordError)
	return ok && t.Alert == e.Alert
}

func recordErrorf(alert uint8, format string, args ...any) error {
	return &recordError{Alert: alert, Detail: fmt.Sprintf(format, args...)}
}

// recordOpener decrypts the records of one direction of one connection. It
// is not safe for concurrent use: records must be opened in order, because
// the sequence number is part of the nonce.
type recordOpener struct {
	version uint16
	suite   *cipherSuite
	aead    cipher.AEAD
	// iv is the static IV: 12 bytes for TLS 1.3 and ChaCha20-Poly1305, the
	// 4-byte implicit salt for TLS 1.2 AES-GCM (the rest of that nonce is
	// carried explicitly in each record).
	iv  []byte
	seq uint64
	// Scratch space for the per-record nonce and additional data, so that
	// Open does not allocate (a slice of the header parameter would escape
	// through the cipher.AEAD interface call).
	nonce [12]byte
	ad    [13]byte
}

// newRecordOpener returns an opener for records protected with key and iv
// (as returned by trafficKeys for TLS 1.3 or tls12Keys for TLS 1.2), the
// first of which has sequence number seq.
func newRecordOpener(version, suite uint16, key, iv []byte, seq uint64) (*recordOpener, error) {
	cs, err := suiteFor(version, suite)
	if err != nil {
		return nil, fmt.Errorf("ktls: record opener: %w", err)
	}
	o := &recordOpener{version: version, suite: cs}
	if err := o.setKey(key, iv); err != nil {
		return nil, err
	}
	o.seq = seq
	return o, nil
}

func (o *recordOpener) setKey(key, iv []byte) error {
	cs := o.suite
	if len(key) != cs.keyLen {
		return fmt.Errorf("ktls: record opener: %s key is %d bytes, want %d", tls.CipherSuiteName(cs.id), len(key), cs.keyLen)
	}
	if len(iv) != cs.ivLen {
		return fmt.Errorf("ktls: record opener: %s iv is %d bytes, want %d", tls.CipherSuiteName(cs.id), len(iv), cs.ivLen)
	}
	aead, err := cs.aead(key)
	if err != nil {
		return fmt.Errorf("ktls: record opener: %w", err)
	}
	o.aead = aead
	o.iv = append(o.iv[:0], iv...)
	o.seq = 0
	return nil
}

// Rekey installs the key and IV of the next TLS 1.3 traffic secret after a
// KeyUpdate and restarts the sequence number at 0 (RFC 8446 section 4.6.3).
func (o *recordOpener) Rekey(key, iv []byte) error {
	if o.version != tls.VersionTLS13 {
		return errors.New("ktls: record opener: KeyUpdate exists only in TLS 1.3")
	}
	return o.setKey(key, iv)
}

// Open authenticates and decrypts one record. header is the record's 5-byte
// header, body the rest of the record (exactly header's length field).
//
// Decryption happens in place: plaintext aliases body, and body's contents
// may be overwritten whether or not Open succeeds. For TLS 1.3 contentType is the
// inner content type, with the zero padding stripped. The sequence number
// advances only on success, so after an error the connection must be closed
// with the alert the error carries.
func (o *recordOpener) Open(header [5]byte, body []byte) (contentType uint8, plaintext []byte, err error) {
	if n := int(binary.BigEndian.Uint16(header[3:5])); n != len(body) {
		return 0, nil, recordErrorf(alertDecodeError, "header says %d bytes, body has %d", n, len(body))
	}
	if o.seq == ^uint64(0) {
		// The next record would reuse a nonce; TLS 1.3 must rekey long before
		// (RFC 8446 section 5.5), TLS 1.2 must renegotiate, which we do not.
		return 0, nil, recordErrorf(alertInternalError, "sequence number exhausted")
	}
	if o.version == tls.VersionTLS13 {
		contentType, plaintext, err = o.open13(header, body)
	} else {
		contentType, plaintext, err = o.open12(header, body)
	}
	if err != nil {
		return 0, nil, err
	}
	o.seq++
	return contentType, plaintext, nil
}

// sequenceNonce writes iv XOR the big-endian sequence number into o.nonce
// (RFC 8446 section 5.3, RFC 7905 section 2).
func (o *recordOpener) sequenceNonce() []byte {
	copy(o.nonce[:], o.iv)
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], o.seq)
	for i, b := range seq {
		o.nonce[4+i] ^= b
	}
	return o.nonce[:]
}

func (o *recordOpener) open13(header [5]byte, body []byte) (uint8, []byte, error) {
	// Every protected TLS 1.3 record is disguised as application_data; the
	// real type is inside (RFC 8446 section 5.2).
	if header[0] != recordApplicationData {
		return 0, nil, recordErrorf(alertUnexpectedMessage, "protected TLS 1.3 record has outer type %d, want %d", header[0], recordApplicationData)
	}
	if len(body) > maxCiphertextTLS13 {
		return 0, nil, recordErrorf(alertRecordOverflow, "ciphertext of %d bytes exceeds %d", len(body), maxCiphertextTLS13)
	}
	if len(body) < o.aead.Overhead()+1 {
		return 0, nil, recordErrorf(alertBadRecordMAC, "ciphertext of %d bytes is shorter than tag and content type", len(body))
	}
	// The additional data is the record header itself (RFC 8446 section 5.2).
	ad := o.ad[:recordHeaderLen]
	copy(ad, header[:])
	inner, err := o.aead.Open(body[:0], o.sequenceNonce(), body, ad)
	if err != nil {
		return 0, nil, recordErrorf(alertBadRecordMAC, "authentication failed (sequence %d)", o.seq)
	}
	if len(inner) > maxPlaintext+1 {
		return 0, nil, recordErrorf(alertRecordOverflow, "inner plaintext of %d bytes exceeds %d", len(inner), maxPlaintext+1)
	}
	// TLSInnerPlaintext = content || ContentType type || zeros[padding]:
	// the type is the last non-zero octet.
	i := len(inner) - 1
	for i >= 0 && inner[i] == 0 {
		i--
	}
	if i < 0 {
		return 0, nil, recordErrorf(alertUnexpectedMessage, "inner plaintext has no non-zero content type")
	}
	switch typ := inner[i]; typ {
	case recordAlert, recordHandshake, recordApplicationData:
		return typ, inner[:i], nil
	default:
		return 0, nil, recordErrorf(alertUnexpectedMessage, "protected record has inner content type %d", typ)
	}
}

func (o *recordOpener) open12(header [5]byte, body []byte) (uint8, []byte, error) {
	typ := header[0]
	switch typ {
	case recordAlert, recordHandshake, recordApplicationData:
	default:
		return 0, nil, recordErrorf(alertUnexpectedMessage, "protected TLS 1.2 record has type %d", typ)
	}
	if len(body) > maxCiphertextTLS12 {
		return 0, nil, recordErrorf(alertRecordOverflow, "ciphertext of %d bytes exceeds %d", len(body), maxCiphertextTLS12)
	}
	var nonce, ciphertext []byte
	if len(o.iv) == len(o.nonce) {
		// ChaCha20-Poly1305: implicit nonce, like TLS 1.3.
		nonce, ciphertext = o.sequenceNonce(), body
	} else {
		// AES-GCM: nonce = salt || nonce_explicit, the latter sent in front of
		// the ciphertext (RFC 5288 section 3).
		if len(body) < tls12ExplicitNonceLen {
			return 0, nil, recordErrorf(alertBadRecordMAC, "record of %d bytes has no explicit nonce", len(body))
		}
		copy(o.nonce[:4], o.iv)
		copy(o.nonce[4:], body[:tls12ExplicitNonceLen])
		nonce, ciphertext = o.nonce[:], body[tls12ExplicitNonceLen:]
	}
	if len(ciphertext) < o.aead.Overhead() {
		return 0, nil, recordErrorf(alertBadRecordMAC, "ciphertext of %d bytes is shorter than the tag", len(ciphertext))
	}
	n := len(ciphertext) - o.aead.Overhead()
	if n > maxPlaintext {
		return 0, nil, recordErrorf(alertRecordOverflow, "plaintext of %d bytes exceeds %d", n, maxPlaintext)
	}
	// additional_data = seq_num || type || version || length (RFC 5246 section 6.2.3.3).
	binary.BigEndian.PutUint64(o.ad[0:8], o.seq)
	o.ad[8] = typ
	o.ad[9], o.ad[10] = header[1], header[2]
	binary.BigEndian.PutUint16(o.ad[11:13], uint16(n))
	plaintext, err := o.aead.Open(ciphertext[:0], nonce, ciphertext, o.ad[:])
	if err != nil {
		return 0, nil, recordErrorf(alertBadRecordMAC, "authentication failed (sequence %d)", o.seq)
	}
	return typ, plaintext, nil
}
