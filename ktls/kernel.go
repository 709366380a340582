package ktls

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Constants from include/uapi/linux/tls.h that golang.org/x/sys/unix does
// not export.
const (
	optTLSTX           = 1 // TLS_TX
	optTLSRX           = 2 // TLS_RX
	optTXZeroCopyRO    = 3 // TLS_TX_ZEROCOPY_RO (Linux >= 5.19)
	optRXExpectNoPad   = 4 // TLS_RX_EXPECT_NO_PAD (Linux >= 6.0, TLS 1.3 RX only)
	cmsgSetRecordType  = 1 // TLS_SET_RECORD_TYPE (sendmsg)
	cmsgGetRecordType  = 2 // TLS_GET_RECORD_TYPE (recvmsg)
	kernelAESGCM128    = 51
	kernelAESGCM256    = 52
	kernelChaCha20P130 = 54
)

// TLS record content types (RFC 8446 section 5.1).
const (
	recordChangeCipherSpec = 20
	recordAlert            = 21
	recordHandshake        = 22
	recordApplicationData  = 23
)

// cryptoInfo builds struct tls12_crypto_info_aes_gcm_{128,256} or
// tls12_crypto_info_chacha20_poly1305: version and cipher_type, then the
// iv, key, salt and rec_seq fields. The header fields are host-endian
// __u16; rec_seq is big endian like on the wire. The kernel's nonce is
// salt || iv field.
//
// Where the nonce is implicit (TLS 1.3, and ChaCha20-Poly1305 in either
// version: RFC 7905, no explicit nonce in TLS 1.2 either) the kernel XORs
// the sequence number into the 12-byte nonce, so iv carries the whole
// static IV: the salt field takes its first saltLen bytes (4 for AES-GCM),
// the iv field the rest (the ChaCha20 struct has no salt).
// For TLS 1.2 AES-GCM, iv is the 4-byte implicit salt and the kernel uses
// the 8-byte "iv" field as the explicit nonce, incrementing it per record:
// it must start at rec_seq, which is what crypto/tls sends as explicit nonce.
func cryptoInfo(version, suite uint16, key, iv []byte, seq uint64) ([]byte, error) {
	cs, err := suiteFor(version, suite)
	if err != nil {
		return nil, fmt.Errorf("ktls: no kernel cipher for version %#04x suite %#04x", version, suite)
	}
	if len(key) != cs.keyLen {
		return nil, fmt.Errorf("ktls: key is %d bytes, want %d", len(key), cs.keyLen)
	}
	if len(iv) != cs.ivLen {
		return nil, fmt.Errorf("ktls: %s iv is %d bytes, want %d", tls.CipherSuiteName(suite), len(iv), cs.ivLen)
	}
	var seqBytes [8]byte
	binary.BigEndian.PutUint64(seqBytes[:], seq)
	salt, ivField := iv[:cs.saltLen], iv[cs.saltLen:]
	if cs.explicitNonce() {
		salt, ivField = iv, seqBytes[:]
	}
	b := make([]byte, 0, 4+len(ivField)+len(key)+len(salt)+len(seqBytes))
	b = binary.NativeEndian.AppendUint16(b, version)
	b = binary.NativeEndian.AppendUint16(b, cs.kernelCipher)
	b = append(b, ivField...)
	b = append(b, key...)
	b = append(b, salt...)
	b = append(b, seqBytes[:]...)
	return b, nil
}

// setsockoptBytes passes a struct by pointer and length, as the kernel wants
// for TLS_TX/TLS_RX.
func setsockoptBytes(fd, level, opt int, b []byte) error {
	return unix.SetsockoptString(fd, level, opt, string(b))
}

// getsockoptBytes reads a struct into b and returns its length
// (TLS_TX/TLS_RX: the crypto_info with the current record sequence number;
// SO_MEMINFO).
func getsockoptBytes(fd, level, opt int, b []byte) (int, error) {
	n := uint32(len(b))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&b[0])), uintptr(unsafe.Pointer(&n)), 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// controlFD runs f on the socket's descriptor.
func controlFD(rc syscall.RawConn, f func(fd int) error) error {
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = f(int(fd)) }); err != nil {
		return err
	}
	return ferr
}

// recordTypeCmsg builds the control message that sets the record type of a
// sendmsg(2) on a kTLS socket.
func recordTypeCmsg(recordType byte) []byte {
	oob := make([]byte, unix.CmsgSpace(1))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.Level = unix.SOL_TLS
	h.Type = cmsgSetRecordType
	h.SetLen(unix.CmsgLen(1))
	oob[unix.CmsgLen(0)] = recordType
	return oob
}

// parseRecordType returns the TLS_GET_RECORD_TYPE byte of a recvmsg(2), or
// -1 when the kernel attached none.
func parseRecordType(oob []byte) int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1
	}
	for _, m := range msgs {
		if m.Header.Level == unix.SOL_TLS && m.Header.Type == cmsgGetRecordType && len(m.Data) > 0 {
			return int(m.Data[0])
		}
	}
	return -1
}

// kernelInfo is a direction's crypto_info as getsockopt returns it.
type kernelInfo struct {
	version, cipher uint16
	key             []byte
	seq             uint64
	raw             []byte
}

func (k *kernelInfo) wipe() { clear(k.raw) }

// is reports whether the kernel's direction runs cs's version and cipher.
func (k *kernelInfo) is(cs *cipherSuite) bool {
	return k.version == cs.version && k.cipher == cs.kernelCipher
}

func (k *kernelInfo) mismatch(cs *cipherSuite) error {
	return fmt.Errorf("the kernel has version %#04x cipher %d, not %s %s (cipher %d)",
		k.version, k.cipher, tls.VersionName(cs.version), tls.CipherSuiteName(cs.id), cs.kernelCipher)
}

// readCryptoInfo reads direction opt's crypto_info (the layout cryptoInfo
// writes). The kernel wants the exact size of the cipher's struct, so the
// 4-byte header is read first; when its version or cipher is not cs's,
// only the header is returned (is reports false).
func readCryptoInfo(rc syscall.RawConn, opt int, cs *cipherSuite) (kernelInfo, error) {
	var hdr [4]byte
	err := controlFD(rc, func(fd int) error {
		n, err := getsockoptBytes(fd, unix.SOL_TLS, opt, hdr[:])
		if err == nil && n != len(hdr) {
			err = fmt.Errorf("getsockopt returned %d bytes, want %d", n, len(hdr))
		}
		return err
	})
	if errors.Is(err, unix.EBUSY) {
		return kernelInfo{}, errors.New("no key installed (getsockopt: EBUSY)")
	}
	if err != nil {
		return kernelInfo{}, fmt.Errorf("reading the crypto_info: %w", err)
	}
	k := kernelInfo{version: binary.NativeEndian.Uint16(hdr[0:]), cipher: binary.NativeEndian.Uint16(hdr[2:])}
	if !k.is(cs) {
		return k, nil
	}
	ivLen := aeadNonceLen - cs.saltLen
	buf := make([]byte, 4+ivLen+cs.keyLen+cs.saltLen+8)
	err = controlFD(rc, func(fd int) error {
		n, err := getsockoptBytes(fd, unix.SOL_TLS, opt, buf)
		if err == nil && n != len(buf) {
			err = fmt.Errorf("getsockopt returned %d bytes, want %d", n, len(buf))
		}
		return err
	})
	if err != nil {
		clear(buf)
		return kernelInfo{}, fmt.Errorf("reading the crypto_info: %w", err)
	}
	// The header, the IV field, the key, the salt, the record sequence.
	k.raw = buf
	k.key = buf[4+ivLen : 4+ivLen+cs.keyLen]
	k.seq = binary.BigEndian.Uint64(buf[len(buf)-8:])
	return k, nil
}
