package ktls

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// maxRecordLen bounds a TLS ciphertext record: 2^14 plaintext plus 256
// bytes of expansion (RFC 8446 section 5.2; RFC 5246 allows 2048, which no
// AEAD suite uses).
const maxRecordLen = 1<<14 + 256

// AlertError is a fatal alert the peer sent.
type AlertError uint8

// AlertAccessDenied is the TLS alert description access_denied (RFC 8446
// section 6.2), the one definition of it: Refuse sends it, which is how a
// sandbox forwarder refuses a tunnel before anything reached the sandbox,
// and a gateway recognises the refusal by it (gateway.Refused).
const AlertAccessDenied = 49

func (e AlertError) Error() string {
	if name, ok := alertNames[uint8(e)]; ok {
		return "ktls: peer sent alert " + name
	}
	return fmt.Sprintf("ktls: peer sent alert %d", uint8(e))
}

var alertNames = map[uint8]string{
	0: "close_notify", 10: "unexpected_message", 20: "bad_record_mac", 22: "record_overflow",
	40: "handshake_failure", 42: "bad_certificate", 43: "unsupported_certificate", 44: "certificate_revoked",
	45: "certificate_expired", 46: "certificate_unknown", 47: "illegal_parameter", 48: "unknown_ca",
	AlertAccessDenied: "access_denied", 50: "decode_error", 51: "decrypt_error", 70: "protocol_version",
	71: "insufficient_security", 80: "internal_error", 86: "inappropriate_fallback", 90: "user_canceled",
	109: "missing_extension", 110: "unsupported_extension", 112: "unrecognized_name",
	116: "certificate_required", 120: "no_application_protocol",
}

// Errors a Read returns when the connection had to be closed.
var (
	// ErrKeyUpdateRateLimited: the peer sent KeyUpdates faster than Options.KeyUpdateLimit.
	ErrKeyUpdateRateLimited = errors.New("ktls: peer exceeded the KeyUpdate rate limit")
	// ErrRekeyUnsupported: the peer sent a KeyUpdate that needs a second key
	// in the kernel (RX, or TX when the peer requests our update), and this
	// kernel cannot install one (Linux < 6.14).
	ErrRekeyUnsupported = errors.New("ktls: peer sent KeyUpdate, but this kernel cannot rekey kTLS (needs Linux >= 6.14)")
)

// IsBadRecord reports whether err ended a connection because a received
// record failed authentication: EBADMSG from kernel RX (read(2), recvmsg(2)
// or splice(2)), bad_record_mac from the Go opener (Options.DisableRX), or
// crypto/tls's bad_record_mac on the userspace fallback. The splice relay,
// not the Conn, meets the record on the kernel path, so the caller that sees
// a tunnel's end error classifies it.
func IsBadRecord(err error) bool {
	var op *net.OpError
	return errors.Is(err, syscall.EBADMSG) || errors.Is(err, errBadRecordMAC) ||
		// crypto/tls's alert type is unexported; its text is AlertError's.
		errors.As(err, &op) && op.Op == "local error" && op.Err != nil && op.Err.Error() == tls.AlertError(alertBadRecordMAC).Error()
}

// protocolError is a fatal error together with the alert that reports it.
type protocolError struct {
	alert uint8
	err   error
}

func (e *protocolError) Error() string { return e.err.Error() }
func (e *protocolError) Unwrap() error { return e.err }

// Read reads application data. On the kernel path a control record at the
// head of the queue makes read(2) fail; it is then received with recvmsg(2)
// and handled here: close_notify → io.EOF, KeyUpdate → rekey, NewSessionTicket
// (client) → its session cache (ticket.go), another alert → an AlertError
// naming it. After a KeyUpdate or a ticket Read returns (0, nil) rather
// than wait for data: that comes through the kernel again (splice.Source).
func (c *Conn) Read(p []byte) (int, error) {
	if err := c.Handshake(); err != nil {
		return 0, err
	}
	if !c.kernelRX() && c.opener == nil {
		c.readSince.Store(true)
		n, err := c.tlsConn.Load().Read(p)
		if err == io.EOF && !c.record.eof.Load() {
			c.notified.Store(true)
		}
		return n, err
	}
	c.readMu.Lock()
	defer c.readMu.Unlock()
	for {
		if len(c.pending) > 0 {
			n := copy(p, c.pending)
			c.pending = c.pending[n:]
			return n, nil
		}
		if c.readErr != nil {
			return 0, c.readErr
		}
		if len(p) == 0 {
			return 0, nil
		}
		if c.opener != nil {
			if err := c.readUserspaceRecord(); err != nil {
				if isTimeout(err) {
					return 0, err
				}
				c.fail(err)
			}
			continue
		}
		n, err := c.kernelRead(p)
		if n > 0 {
			if werr := c.openedLocked(int64(n)); werr != nil {
				c.fail(werr)
				return 0, werr
			}
		}
		if err == nil || n > 0 {
			return n, err
		}
		if err == io.EOF {
			c.peerEnded()
		}
		if !isControlRecordErrno(err) {
			return 0, err
		}
		if err := c.readKernelRecord(); err != nil {
			if isTimeout(err) {
				return 0, err
			}
			c.fail(err)
			continue
		}
		if len(c.pending) == 0 {
			// A control record handled (a KeyUpdate, a session ticket):
			// the bytes behind it stay in the kernel, where a relay
			// splices them (splice.Source).
			return 0, nil
		}
	}
}

// kernelRead is read(2) from the kernel socket through c.rx, with the
// results net.TCPConn's Read gives. Caller holds readMu.
func (c *Conn) kernelRead(p []byte) (int, error) {
	if c.readFn == nil {
		c.readFn = func(fd uintptr) bool {
			for {
				c.readN, c.readErrno = unix.Read(int(fd), c.readBuf)
				if c.readErrno != unix.EINTR {
					return c.readErrno != unix.EAGAIN
				}
			}
		}
	}
	c.readBuf = p
	err := c.rx.Read(c.readFn)
	n, errno := max(c.readN, 0), c.readErrno
	c.readBuf, c.readN, c.readErrno = nil, 0, nil
	switch {
	case err != nil:
	case errno != nil:
		err = os.NewSyscallError("read", errno)
	case n == 0 && len(p) > 0:
		return 0, io.EOF
	default:
		return n, nil
	}
	return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.sock.LocalAddr(), Addr: c.sock.RemoteAddr(), Err: err}
}

// CloseNotified reports whether the peer ended its stream with close_notify.
// Read returns io.EOF for that and, as crypto/tls does, for a transport
// end at a record boundary (the peer's FIN alone, or a reset the kernel
// reports as an end): a peer that always sends close_notify first was
// truncated when Read ended and this is false (splice.CloseNotifier).
func (c *Conn) CloseNotified() bool { return c.notified.Load() }

// isControlRecordErrno reports the errnos with which read(2) and splice(2)
// refuse a non-data record at the head of a kTLS receive queue: EIO from
// read without a cmsg buffer, EINVAL from splice, EKEYEXPIRED after a
// KeyUpdate until the new key is installed.
func isControlRecordErrno(err error) bool {
	return errors.Is(err, syscall.EIO) || errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.EKEYEXPIRED)
}

func isTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}

// fail makes err sticky for reads. A fatal error also tells the peer with
// an alert and closes the socket, so the connection never half-works.
func (c *Conn) fail(err error) {
	c.readErr = err
	if errors.Is(err, io.EOF) {
		c.peerEnded()
		return
	}
	alert := uint8(alertInternalError)
	var pe *protocolError
	var re *recordError
	if errors.As(err, &pe) {
		alert = pe.alert
	} else if errors.As(err, &re) {
		alert = re.Alert
	}
	var peerAlert AlertError
	c.writeMu.Lock()
	if !c.wroteEOF && !errors.As(err, &peerAlert) {
		c.sock.SetWriteDeadline(time.Now().Add(time.Second))
		c.sendControlLocked(recordAlert, []byte{alertLevelFatal, alert})
	}
	c.wroteEOF = true
	c.writeMu.Unlock()
	c.sock.Close()
}

// readKernelRecord receives one record with recvmsg(2), which, unlike
// read(2), may return a non-data record because it has room for the
// TLS_GET_RECORD_TYPE cmsg. Data lands in pending.
func (c *Conn) readKernelRecord() error {
	if c.ctrlBuf == nil {
		c.ctrlBuf = make([]byte, maxRecordLen)
	}
	oob := make([]byte, unix.CmsgSpace(1))
	var n, oobn int
	var serr error
	err := c.rx.Read(func(fd uintptr) bool {
		n, oobn, _, _, serr = unix.Recvmsg(int(fd), c.ctrlBuf, oob, 0)
		return serr != unix.EAGAIN
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		if errors.Is(err, syscall.EKEYEXPIRED) {
			return &protocolError{alertInternalError, fmt.Errorf("ktls: receive key expired: %w", err)}
		}
		return fmt.Errorf("ktls: recvmsg: %w", err)
	}
	recordType := parseRecordType(oob[:oobn])
	if n == 0 && recordType < 0 {
		return io.EOF
	}
	if recordType < 0 || recordType == recordApplicationData {
		c.pending = c.ctrlBuf[:n]
		return nil
	}
	return c.handleControl(uint8(recordType), c.ctrlBuf[:n])
}

// readUserspaceRecord reads one record from the socket and opens it with
// the captured RX key (Options.DisableRX). Partial records survive a read
// deadline: the bytes so far stay in ctrlBuf.
func (c *Conn) readUserspaceRecord() error {
	if c.ctrlBuf == nil {
		c.ctrlBuf = make([]byte, 0, recordHeaderLen+maxRecordLen)
	}
	need := recordHeaderLen
	if len(c.ctrlBuf) >= recordHeaderLen {
		need += int(binary.BigEndian.Uint16(c.ctrlBuf[3:5]))
	}
	for len(c.ctrlBuf) < need {
		n, err := c.sock.Read(c.ctrlBuf[len(c.ctrlBuf):need])
		c.ctrlBuf = c.ctrlBuf[:len(c.ctrlBuf)+n]
		if err != nil {
			if errors.Is(err, io.EOF) && len(c.ctrlBuf) > 0 {
				return &protocolError{alertDecodeError, io.ErrUnexpectedEOF}
			}
			return err
		}
		if len(c.ctrlBuf) == recordHeaderLen {
			length := int(binary.BigEndian.Uint16(c.ctrlBuf[3:5]))
			if length > maxRecordLen {
				return &protocolError{alertRecordOverflow, fmt.Errorf("ktls: record of %d bytes exceeds the limit", length)}
			}
			need += length
		}
	}
	header := [recordHeaderLen]byte(c.ctrlBuf[:recordHeaderLen])
	body := c.ctrlBuf[recordHeaderLen:need]
	c.ctrlBuf = c.ctrlBuf[:0]
	recordType, plaintext, err := c.opener.Open(header, body)
	if err != nil {
		return err // a recordError, which names its alert
	}
	if recordType == recordApplicationData {
		// plaintext aliases ctrlBuf, which is not reused until pending
		// is drained.
		c.pending = plaintext
		// Every record counts, the empty ones too: the opener knows them.
		return c.openedLocked(int64(len(plaintext)) + 1)
	}
	return c.handleControl(recordType, plaintext)
}

// handleControl acts on one non-data record.
func (c *Conn) handleControl(recordType uint8, payload []byte) error {
	switch recordType {
	case recordAlert:
		countControl("alert")
		if len(payload) != 2 {
			return &protocolError{alertDecodeError, fmt.Errorf("ktls: alert record of %d bytes", len(payload))}
		}
		if payload[1] == 0 {
			c.notified.Store(true)
			return io.EOF // close_notify: the write side stays usable until Close
		}
		err := AlertError(payload[1])
		c.report(Event{Kind: EventAlert, Offload: c.off, Err: err})
		return err
	case recordHandshake:
		countControl("handshake")
		if c.off.Version != tls.VersionTLS13 {
			return &protocolError{alertUnexpectedMessage, errors.New("ktls: TLS 1.2 renegotiation is not supported")}
		}
		return c.handlePostHandshake(payload)
	case recordChangeCipherSpec:
		countControl("change_cipher_spec")
	default:
		countControl("unknown")
	}
	return &protocolError{alertUnexpectedMessage, fmt.Errorf("ktls: unexpected record type %d after the handshake", recordType)}
}

// Post-handshake message types (RFC 8446 section 4).
const (
	msgNewSessionTicket = 4
	msgKeyUpdate        = 24
)

// handlePostHandshake handles the TLS 1.3 handshake messages in one record.
func (c *Conn) handlePostHandshake(msgs []byte) error {
	for len(msgs) > 0 {
		if len(msgs) < 4 {
			return &protocolError{alertDecodeError, errors.New("ktls: handshake message split across records is not supported")}
		}
		msgType, length := msgs[0], int(msgs[1])<<16|int(msgs[2])<<8|int(msgs[3])
		if len(msgs) < 4+length {
			return &protocolError{alertDecodeError, errors.New("ktls: handshake message split across records is not supported")}
		}
		msg, body := msgs[:4+length], msgs[4:4+length]
		msgs = msgs[4+length:]
		switch {
		case msgType == msgNewSessionTicket && c.isClient:
			c.keepTicket(msg)
		case msgType == msgKeyUpdate:
			// RFC 8446 section 5.1: a KeyUpdate must end its record,
			// because the next record is under the new key.
			if length != 1 || len(msgs) != 0 || body[0] > 1 {
				return &protocolError{alertDecodeError, errors.New("ktls: malformed KeyUpdate")}
			}
			if err := c.keyUpdate(body[0] == 1); err != nil {
				return err
			}
		default:
			return &protocolError{alertUnexpectedMessage, fmt.Errorf("ktls: unexpected post-handshake message type %d", msgType)}
		}
	}
	return nil
}

// keyUpdate moves RX to the next traffic secret and, when the peer asks,
// answers with our own KeyUpdate and moves TX.
func (c *Conn) keyUpdate(updateRequested bool) error {
	if !c.limiter.allow(time.Now()) {
		stats.rateLimited.Add(1)
		c.report(Event{Kind: EventRateLimited, Offload: c.off, Err: ErrKeyUpdateRateLimited})
		return &protocolError{alertUnexpectedMessage, ErrKeyUpdateRateLimited}
	}
	// A second kernel key needs Linux >= 6.14. With RX in userspace the
	// opener rekeys on any kernel: only our answer to a requested update
	// needs a second TLS_TX.
	if !Probe().Rekey && (c.opener == nil || updateRequested) {
		c.report(Event{Kind: EventRekeyUnsupported, Offload: c.off, Err: ErrRekeyUnsupported})
		return &protocolError{alertInternalError, ErrRekeyUnsupported}
	}
	suite := c.off.CipherSuite
	next, err := nextTrafficSecret(suite, c.rxSecret)
	if err != nil {
		return err
	}
	key, iv, err := trafficKeys(suite, next)
	if err != nil {
		return err
	}
	if c.opener != nil {
		err = c.opener.Rekey(key, iv)
	} else {
		err = c.installKey(optTLSRX, directionState{key: key, iv: iv})
	}
	if err != nil {
		return &protocolError{alertInternalError, fmt.Errorf("ktls: install next RX key: %w", err)}
	}
	c.rxSecret = next
	c.rxBound, c.rxAsked = 0, false
	if updateRequested {
		c.txWant.Or(wantAnswer)
		c.trySendWanted()
	}
	stats.keyUpdates.Add(1)
	c.report(Event{Kind: EventKeyUpdate, Offload: c.off})
	return nil
}

// updateTX sends a KeyUpdate under the current TX key, asking the peer to
// update too when request is set, then installs the next key. Writers,
// splices into the socket among them (BeginSeal), wait on writeMu
// meanwhile, so no data record goes out between the two.
func (c *Conn) updateTX(request bool) error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	return c.updateTXLocked(request, -1)
}

// updateTXLocked is updateTX with writeMu held. With fd >= 0 (the socket,
// inside its write callback) the KeyUpdate is sent without waiting for
// room: unix.EAGAIN, with nothing sent, when the socket has none.
func (c *Conn) updateTXLocked(request bool, fd int) error {
	if c.wroteEOF {
		return nil
	}
	msg := []byte{msgKeyUpdate, 0, 0, 1, 0}
	if request {
		msg[4] = 1
	}
	if fd >= 0 {
		if _, err := unix.SendmsgN(fd, msg, recordTypeCmsg(recordHandshake), nil, unix.MSG_DONTWAIT); err != nil {
			if err == unix.EAGAIN {
				return err
			}
			return fmt.Errorf("ktls: send KeyUpdate: %w", err)
		}
	} else if err := c.sendControlLocked(recordHandshake, msg); err != nil {
		return err
	}
	next, err := nextTrafficSecret(c.off.CipherSuite, c.txSecret)
	if err != nil {
		return err
	}
	key, iv, err := trafficKeys(c.off.CipherSuite, next)
	if err != nil {
		return err
	}
	if err := c.installKey(optTLSTX, directionState{key: key, iv: iv}); err != nil {
		return fmt.Errorf("ktls: install next TX key: %w", err)
	}
	c.txSecret = next
	c.txBound = 0
	stats.keyUpdatesSent.Add(1)
	return nil
}

func (c *Conn) installKey(opt int, d directionState) error {
	info, err := cryptoInfo(c.off.Version, c.off.CipherSuite, d.key, d.iv, d.seq)
	if err != nil {
		return err
	}
	return controlFD(c.rawSock, func(fd int) error { return setsockoptBytes(fd, unix.SOL_TLS, opt, info) })
}
