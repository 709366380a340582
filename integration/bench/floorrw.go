package main

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// From include/uapi/linux/tls.h; golang.org/x/sys/unix has SOL_TLS and
// TCP_ULP only.
const (
	tlsTX              = 1
	tlsRX              = 2
	tlsSetRecordType   = 1 // cmsg on sendmsg: the record's content type
	tlsGetRecordType   = 2 // cmsg on recvmsg: the record's content type
	tls13Version       = 0x0304
	tlsCipherAESGCM128 = 51

	recordAlert     = 21
	recordHandshake = 22
	recordData      = 23
)

// rwBufSize is each direction's buffer: the size the bench's gateway and
// upstream read with, so the relay is not the side that needs more calls.
const rwBufSize = 256 << 10

// runFloorRW is the floor-rw-ktls and floor-rw-plain subcommands (flags as
// runFloor's): floors that share no code with this project. floor-ktls is
// built from its packages ktls and splice, so a cost (or a bug) common to
// them and the product stays invisible next to it. These two use only the
// standard library and golang.org/x/sys/unix: the key install is written
// from RFC 8446 and the kernel's uapi (include/uapi/linux/tls.h,
// Documentation/networking/tls.rst), and the relay is the simplest correct
// one: two goroutines, each copying one direction through a userspace buffer
// with read(2) (recvmsg(2) on a kTLS socket) and write(2), on Go's
// non-blocking sockets and netpoller like any Go relay. On floor-rw-ktls the
// kernel opens records on read and seals them on write; floor-rw-plain is
// the same relay over plain TCP.
func runFloorRW(name string, args []string) error {
	a := parseFloorArgs(name, args)
	var cfg *tls.Config
	if name == "floor-rw-ktls" {
		cert, err := tls.LoadX509KeyPair(a.certFile, a.keyFile)
		if err != nil {
			return err
		}
		cfg = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}
		// Each connection handshakes with a clone of cfg (its own key log).
		// A clone of a Config that never handshook would make ticket keys
		// of its own, and no ticket would resume on another connection:
		// the keys are set here, once.
		var ticketKey [32]byte
		rand.Read(ticketKey[:])
		cfg.SetSessionTicketKeys([][32]byte{ticketKey})
	}
	return serveFloor(name, a.listen, func(c net.Conn) error { return floorRWTunnel(c.(*net.TCPConn), cfg, a.upstream) })
}

// rwEnd is one socket of a tunnel; ktls: it has kernel keys both ways.
type rwEnd struct {
	c    *net.TCPConn
	rc   syscall.RawConn
	ktls bool
}

func newRWEnd(c *net.TCPConn, ktls bool) (rwEnd, error) {
	rc, err := c.SyscallConn()
	return rwEnd{c, rc, ktls}, err
}

func floorRWTunnel(c *net.TCPConn, cfg *tls.Config, upstream string) error {
	gw, err := newRWEnd(c, cfg != nil)
	if err == nil && gw.ktls {
		err = handshakeKTLS(gw, cfg)
	}
	if err != nil {
		c.Close()
		return err
	}
	u, err := net.Dial("tcp", upstream)
	if err != nil {
		c.Close()
		return err
	}
	up, err := newRWEnd(u.(*net.TCPConn), false)
	if err != nil {
		c.Close()
		u.Close()
		return err
	}
	var wg sync.WaitGroup
	var errs [2]error
	for i, d := range [2]struct{ dst, src rwEnd }{{up, gw}, {gw, up}} {
		wg.Go(func() {
			if errs[i] = relayRW(d.dst, d.src); errs[i] != nil {
				// Unblock the other direction: the tunnel is broken.
				c.Close()
				u.Close()
			}
		})
	}
	wg.Wait()
	c.Close()
	u.Close()
	return errors.Join(errs[:]...)
}

// relayRW copies src to dst until src ends, then half-closes dst.
func relayRW(dst, src rwEnd) error {
	buf := make([]byte, rwBufSize)
	oob := make([]byte, unix.CmsgSpace(1))
	for {
		var n int
		var err error
		if src.ktls {
			n, err = recvData(src.rc, buf, oob)
		} else {
			n, err = src.c.Read(buf) // read(2); (0, io.EOF) at the peer's FIN
		}
		if n > 0 {
			if _, werr := dst.c.Write(buf[:n]); werr != nil { // write(2) until all of it went
				return werr
			}
		}
		if err == io.EOF {
			return closeWriteRW(dst)
		}
		if err != nil {
			return err
		}
	}
}

// recvData reads application data from a kTLS socket. read(2) cannot be
// used on one: at a record that is not application data (the peer's
// close_notify) it fails with EIO and leaves the record queued. recvmsg(2)
// with room for a control message returns that record with its content type
// in a TLS_GET_RECORD_TYPE cmsg instead; the kernel never returns records of
// two types in one call. io.EOF: close_notify, or a FIN.
func recvData(rc syscall.RawConn, b, oob []byte) (int, error) {
	var n, oobn int
	var err error
	if rerr := rc.Read(func(fd uintptr) bool {
		n, oobn, _, _, err = unix.Recvmsg(int(fd), b, oob, 0)
		return err != unix.EAGAIN
	}); rerr != nil {
		return 0, rerr
	}
	if err != nil {
		return 0, os.NewSyscallError("recvmsg", err)
	}
	if oobn == 0 {
		if n == 0 {
			return 0, io.EOF // FIN: no record, no cmsg
		}
		return 0, fmt.Errorf("recvmsg: %d bytes without a record type", n)
	}
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return 0, err
	}
	typ := -1
	for _, m := range cmsgs {
		if m.Header.Level == unix.SOL_TLS && m.Header.Type == tlsGetRecordType && len(m.Data) >= 1 {
			typ = int(m.Data[0])
		}
	}
	switch {
	case typ == recordData:
		return n, nil
	case typ == recordAlert && n == 2 && b[1] == 0: // close_notify
		return 0, io.EOF
	case typ == recordAlert && n == 2:
		return 0, fmt.Errorf("TLS alert %d from the peer", b[1])
	case typ == recordHandshake:
		// KeyUpdate or NewSessionTicket: the gateway sends neither, and the
		// floor does not handle them.
		return 0, fmt.Errorf("handshake message (type %d) after the handshake", b[0])
	}
	return 0, fmt.Errorf("record of type %d, %d bytes", typ, n)
}

// closeWriteRW ends dst's direction: on a kTLS socket a close_notify first,
// sealed by the kernel (a record of type alert is sent with sendmsg(2) and a
// TLS_SET_RECORD_TYPE cmsg), then the FIN.
func closeWriteRW(dst rwEnd) error {
	if dst.ktls {
		oob := make([]byte, unix.CmsgSpace(1))
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		h.Level, h.Type = unix.SOL_TLS, tlsSetRecordType
		h.SetLen(unix.CmsgLen(1))
		oob[unix.CmsgLen(0)] = recordAlert
		var err error
		if werr := dst.rc.Write(func(fd uintptr) bool {
			_, err = unix.SendmsgN(int(fd), []byte{1, 0}, oob, nil, 0) // warning, close_notify
			return err != unix.EAGAIN
		}); werr != nil {
			return werr
		}
		if err != nil {
			return os.NewSyscallError("sendmsg close_notify", err)
		}
	}
	return dst.c.CloseWrite()
}

// handshakeKTLS runs crypto/tls's TLS 1.3 server handshake on c and installs
// the application traffic keys in c's kernel, TX and RX.
func handshakeKTLS(c rwEnd, cfg *tls.Config) error {
	tx, rx, err := handshakeKeys(c.c, cfg)
	if err != nil {
		return err
	}
	if cerr := c.rc.Control(func(fd uintptr) {
		// The ULP first (the socket must be established), then each
		// direction's key. RX: records that arrived after the client's
		// Finished wait in the socket's queue (recordBoundConn read none of
		// them) and are opened by the kernel from the first.
		if err = unix.SetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_ULP, "tls"); err != nil {
			err = os.NewSyscallError("setsockopt TCP_ULP tls", err)
			return
		}
		if err = unix.SetsockoptString(int(fd), unix.SOL_TLS, tlsTX, string(tx)); err != nil {
			err = os.NewSyscallError("setsockopt TLS_TX", err)
			return
		}
		if err = unix.SetsockoptString(int(fd), unix.SOL_TLS, tlsRX, string(rx)); err != nil {
			err = os.NewSyscallError("setsockopt TLS_RX", err)
		}
	}); cerr != nil {
		return cerr
	}
	return err
}

// handshakeKeys runs the handshake and returns the kernel's TX and RX
// crypto info. The *tls.Conn is dropped after: its record layer must never
// write again (the sequence numbers are the kernel's now).
func handshakeKeys(c net.Conn, cfg *tls.Config) (tx, rx []byte, err error) {
	secrets := keyLog{}
	cfg = cfg.Clone()
	cfg.KeyLogWriter = secrets
	rc := &recordBoundConn{Conn: c}
	tc := tls.Server(rc, cfg)
	if err := tc.Handshake(); err != nil {
		return nil, nil, err
	}
	if cs := tc.ConnectionState(); cs.Version != tls.VersionTLS13 || cs.CipherSuite != tls.TLS_AES_128_GCM_SHA256 {
		// Go cannot restrict TLS 1.3 suites by configuration; the
		// gateway's offer and checkSuite pin this one.
		return nil, nil, fmt.Errorf("negotiated %s with %s, the floor installs TLS 1.3 with TLS_AES_128_GCM_SHA256 only",
			tls.VersionName(cs.Version), tls.CipherSuiteName(cs.CipherSuite))
	}
	txKey, txIV, err1 := trafficKeys(secrets["SERVER_TRAFFIC_SECRET_0"])
	rxKey, rxIV, err2 := trafficKeys(secrets["CLIENT_TRAFFIC_SECRET_0"])
	if err := errors.Join(err1, err2); err != nil {
		return nil, nil, err
	}
	// Go's TLS 1.3 server seals its NewSessionTickets under the application
	// key inside Handshake: the kernel's TX sequence number starts at their
	// count. The client sends nothing under its application key before its
	// Finished is read, so RX starts at 0.
	txSeq, err := sealedUnder(rc.out, txKey, txIV)
	if err != nil {
		return nil, nil, err
	}
	return cryptoInfoAESGCM128(txKey, txIV, txSeq), cryptoInfoAESGCM128(rxKey, rxIV, 0), nil
}

// keyLog keeps the secrets crypto/tls logs in NSS key log format, one line
// per Write: "<label> <client random hex> <secret hex>". One per connection.
type keyLog map[string][]byte

func (k keyLog) Write(b []byte) (int, error) {
	for line := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			return 0, fmt.Errorf("key log line %q", line)
		}
		secret, err := hex.DecodeString(f[2])
		if err != nil {
			return 0, err
		}
		k[f[0]] = secret
	}
	return len(b), nil
}

// trafficKeys derives the write key and IV of TLS_AES_128_GCM_SHA256 from
// a TLS 1.3 traffic secret (RFC 8446 7.3).
func trafficKeys(secret []byte) (key, iv []byte, err error) {
	if len(secret) != sha256.Size {
		return nil, nil, fmt.Errorf("traffic secret of %d bytes, want %d (missing from the key log?)", len(secret), sha256.Size)
	}
	key, err1 := hkdfExpandLabel(secret, "key", 16)
	iv, err2 := hkdfExpandLabel(secret, "iv", 12)
	return key, iv, errors.Join(err1, err2)
}

// cryptoInfoAESGCM128 is struct tls12_crypto_info_aes_gcm_128 (the name
// says 1.2; version says 1.3): version and cipher_type in host order, then
// iv (the write IV's last 8 bytes), key, salt (its first 4) and rec_seq,
// the next record's sequence number, big-endian.
func cryptoInfoAESGCM128(key, iv []byte, seq uint64) []byte {
	b := make([]byte, 40)
	binary.NativeEndian.PutUint16(b[0:], tls13Version)
	binary.NativeEndian.PutUint16(b[2:], tlsCipherAESGCM128)
	copy(b[4:12], iv[4:])
	copy(b[12:28], key)
	copy(b[28:32], iv[:4])
	binary.BigEndian.PutUint64(b[32:40], seq)
	return b
}

// sealedUnder counts the records at the end of out (all the server wrote
// during the handshake) sealed with key and iv: the first record that opens
// under them at sequence number 0 starts that epoch, and every record after
// it must open in turn (RFC 8446 5.3: nonce = iv XOR the big-endian
// sequence number; 5.2: the additional data is the record header).
func sealedUnder(out, key, iv []byte) (uint64, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return 0, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return 0, err
	}
	var records [][]byte
	for len(out) >= 5 {
		n := 5 + int(binary.BigEndian.Uint16(out[3:]))
		if n > len(out) {
			return 0, fmt.Errorf("handshake output ends inside a record")
		}
		records, out = append(records, out[:n]), out[n:]
	}
	opens := func(r []byte, seq uint64) bool {
		nonce := make([]byte, len(iv))
		copy(nonce, iv)
		for i := range 8 {
			nonce[len(nonce)-1-i] ^= byte(seq >> (8 * i))
		}
		_, err := aead.Open(nil, nonce, r[5:], r[:5])
		return err == nil
	}
	for first, r := range records {
		if !opens(r, 0) {
			continue
		}
		for i, r := range records[first:] {
			if !opens(r, uint64(i)) {
				return 0, fmt.Errorf("handshake record %d does not open under the application key at sequence number %d", first+i, i)
			}
		}
		return uint64(len(records) - first), nil
	}
	return 0, nil
}

// hkdfExpandLabel is RFC 8446 7.1's HKDF-Expand-Label with SHA-256 and an
// empty context: HkdfLabel = length (u16) || "tls13 "+label (u8-prefixed)
// || context (u8-prefixed, empty).
func hkdfExpandLabel(secret []byte, label string, length int) ([]byte, error) {
	info := []byte{byte(length >> 8), byte(length), byte(len("tls13 ") + len(label))}
	info = append(info, "tls13 "+label...)
	info = append(info, 0)
	return hkdf.Expand(sha256.New, secret, string(info), length)
}

// recordBoundConn is the connection crypto/tls handshakes over: its Read
// never returns a byte past the current TLS record, and out keeps all it
// wrote. crypto/tls reads ahead into its own buffer; application data that
// came in the same segment as the client's Finished would be stranded there,
// out of the kernel's reach, once the keys are installed. A record header is
// read alone (at most its 5 bytes), then at most the rest of the record.
type recordBoundConn struct {
	net.Conn
	out  []byte
	hdr  [5]byte
	nhdr int // bytes of the next record's header read
	body int // bytes of the current record's body not read yet
}

func (c *recordBoundConn) Read(b []byte) (int, error) {
	if c.body == 0 {
		b = b[:min(len(b), len(c.hdr)-c.nhdr)]
		n, err := c.Conn.Read(b)
		c.nhdr += copy(c.hdr[c.nhdr:], b[:n])
		if c.nhdr == len(c.hdr) {
			c.body, c.nhdr = int(binary.BigEndian.Uint16(c.hdr[3:])), 0
		}
		return n, err
	}
	n, err := c.Conn.Read(b[:min(len(b), c.body)])
	c.body -= n
	return n, err
}

func (c *recordBoundConn) Write(b []byte) (int, error) {
	c.out = append(c.out, b...)
	return c.Conn.Write(b)
}
