package splice

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash"
	"net"
	"strings"
	"sync"
	"testing"

	"golang.org/x/crypto/chacha20poly1305"
)

// wireTrace records what a TLS 1.3 client reads off the wire and the
// server's first application traffic secret (from the client's key log), so
// that a record the client failed to open can be found and explained: which
// key generation and sequence number, if any, open it.
type wireTrace struct {
	net.Conn
	mu     sync.Mutex
	in     bytes.Buffer
	keyLog bytes.Buffer
	suite  uint16
}

func (w *wireTrace) Read(p []byte) (int, error) {
	n, err := w.Conn.Read(p)
	w.mu.Lock()
	if w.in.Len() < 64<<20 {
		w.in.Write(p[:n])
	}
	w.mu.Unlock()
	return n, err
}

// keyLogWriter is the client's tls.Config.KeyLogWriter.
func (w *wireTrace) keyLogWriter() *keyLog { return &keyLog{w} }

type keyLog struct{ w *wireTrace }

func (k *keyLog) Write(p []byte) (int, error) {
	k.w.mu.Lock()
	defer k.w.mu.Unlock()
	return k.w.keyLog.Write(p)
}

// explain logs where the server → client record stream stops opening, and
// the last records before that point (or before the end of what was read).
func (w *wireTrace) explain(t *testing.T) {
	suite := w.suite
	w.mu.Lock()
	defer w.mu.Unlock()
	var secret []byte
	for _, line := range strings.Split(w.keyLog.String(), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "SERVER_TRAFFIC_SECRET_0" {
			secret, _ = hex.DecodeString(f[2])
		}
	}
	if secret == nil {
		t.Logf("wire trace: no SERVER_TRAFFIC_SECRET_0 in the key log")
		return
	}
	h := sha256.New
	if suite == tls.TLS_AES_256_GCM_SHA384 {
		h = sha512.New384
	}
	b := w.in.Bytes()
	// Skip the handshake: records until the first one that opens under
	// the application secret.
	gen, seq := 0, uint64(0)
	var history []string
	opened := 0
	for off := 0; off+5 <= len(b); {
		n := int(binary.BigEndian.Uint16(b[off+3:]))
		if off+5+n > len(b) {
			t.Logf("wire trace: %d bytes read, stream ends inside a record at %d; the last records:\n  %s", len(b), off, strings.Join(history, "\n  "))
			return
		}
		hdr, body := b[off:off+5], b[off+5:off+5+n]
		rec := off
		off += 5 + n
		if hdr[0] != 23 {
			continue // plaintext handshake records
		}
		pt, ok := openRecord(suite, h, secret, seq, hdr, body)
		if !ok && opened == 0 {
			continue // handshake traffic
		}
		if ok {
			opened++
			typ, content := innerType(pt)
			history = append(history, fmt.Sprintf("@%d gen %d seq %d type %d len %d %x", rec, gen, seq, typ, len(content), content[:min(len(content), 6)]))
			if len(history) > 40 {
				history = history[1:]
			}
			if typ == 22 && len(content) >= 5 && content[0] == 24 {
				secret = nextSecret(h, secret)
				gen, seq = gen+1, 0
				continue
			}
			seq++
			continue
		}
		t.Logf("wire trace: record @%d (len %d) does not open under gen %d seq %d; the last records:\n  %s",
			rec, n, gen, seq, strings.Join(history, "\n  "))
		// Where does it open? (Forward only: a record under an earlier
		// key than the client's is not looked for.)
		s := secret
		for g := 0; g <= 3; g++ {
			for q := uint64(0); q < seq+64; q++ {
				if pt, ok := openRecord(suite, h, s, q, hdr, body); ok {
					typ, content := innerType(pt)
					t.Logf("wire trace: it opens under gen %d seq %d: type %d len %d", gen+g, q, typ, len(content))
					return
				}
			}
			s = nextSecret(h, s)
		}
		t.Logf("wire trace: it opens under none of gens %d..%d, seqs below %d", gen, gen+3, seq+64)
		return
	}
	t.Logf("wire trace: all %d application records opened (%d bytes); the last records:\n  %s", opened, len(b), strings.Join(history, "\n  "))
}

func innerType(pt []byte) (byte, []byte) {
	i := len(pt) - 1
	for i >= 0 && pt[i] == 0 {
		i--
	}
	if i < 0 {
		return 0, nil
	}
	return pt[i], pt[:i]
}

func expandLabel(h func() hash.Hash, secret []byte, label string, n int) []byte {
	full := "tls13 " + label
	info := []byte{byte(n >> 8), byte(n), byte(len(full))}
	info = append(info, full...)
	info = append(info, 0)
	out, err := hkdf.Expand(h, secret, string(info), n)
	if err != nil {
		panic(err)
	}
	return out
}

func nextSecret(h func() hash.Hash, s []byte) []byte {
	return expandLabel(h, s, "traffic upd", h().Size())
}

func openRecord(suite uint16, h func() hash.Hash, secret []byte, seq uint64, hdr, body []byte) ([]byte, bool) {
	keyLen := 16
	if suite != tls.TLS_AES_128_GCM_SHA256 {
		keyLen = 32
	}
	key, iv := expandLabel(h, secret, "key", keyLen), expandLabel(h, secret, "iv", 12)
	var aead cipher.AEAD
	if suite == tls.TLS_CHACHA20_POLY1305_SHA256 {
		aead, _ = chacha20poly1305.New(key)
	} else {
		blk, _ := aes.NewCipher(key)
		aead, _ = cipher.NewGCM(blk)
	}
	nonce := bytes.Clone(iv)
	for i := range 8 {
		nonce[4+i] ^= byte(seq >> (56 - 8*i))
	}
	pt, err := aead.Open(nil, nonce, body, hdr)
	return pt, err == nil
}
