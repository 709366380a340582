package ktls

// Key schedule: turning the secrets crypto/tls hands out through
// KeyLogWriter into the record keys and IVs that the kernel (crypto_info)
// and the userspace record opener need. TLS 1.3 uses HKDF-Expand-Label
// (RFC 8446 section 7), TLS 1.2 the PRF key expansion (RFC 5246 section 6.3).

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"hash"
)

// hkdfExpandLabel is HKDF-Expand-Label (RFC 8446 section 7.1) with an empty
// context, the only form the record keys and KeyUpdate need.
func hkdfExpandLabel(h func() hash.Hash, secret []byte, label string, length int) ([]byte, error) {
	const prefix = "tls13 "
	// struct HkdfLabel { uint16 length; opaque label<7..255>; opaque context<0..255>; }
	info := make([]byte, 0, 2+1+len(prefix)+len(label)+1)
	info = binary.BigEndian.AppendUint16(info, uint16(length))
	info = append(info, byte(len(prefix)+len(label)))
	info = append(info, prefix...)
	info = append(info, label...)
	info = append(info, 0) // zero-length context
	return hkdf.Expand(h, secret, string(info), length)
}

// checkSecret rejects a traffic secret whose length is not the suite's hash
// length: a truncated or mixed-up key log line must not silently produce keys.
func checkSecret(cs *cipherSuite, secret []byte) error {
	if n := cs.hash().Size(); len(secret) != n {
		return fmt.Errorf("ktls: traffic secret for %s is %d bytes, want %d", tls.CipherSuiteName(cs.id), len(secret), n)
	}
	return nil
}

// trafficKeys derives the record key and the 12-byte static IV of a TLS 1.3
// traffic secret (RFC 8446 section 7.3).
func trafficKeys(suite uint16, secret []byte) (key, iv []byte, err error) {
	cs, err := tls13Suite(suite, secret)
	if err != nil {
		return nil, nil, err
	}
	if key, err = hkdfExpandLabel(cs.hash, secret, "key", cs.keyLen); err != nil {
		return nil, nil, err
	}
	if iv, err = hkdfExpandLabel(cs.hash, secret, "iv", cs.ivLen); err != nil {
		clear(key)
		return nil, nil, err
	}
	return key, iv, nil
}

// trafficKey derives the record key alone of a TLS 1.3 traffic secret.
func trafficKey(suite uint16, secret []byte) ([]byte, error) {
	cs, err := tls13Suite(suite, secret)
	if err != nil {
		return nil, err
	}
	return hkdfExpandLabel(cs.hash, secret, "key", cs.keyLen)
}

// nextTrafficSecret derives application_traffic_secret_N+1 from
// application_traffic_secret_N, as both sides do after a KeyUpdate
// (RFC 8446 section 7.2).
func nextTrafficSecret(suite uint16, secret []byte) ([]byte, error) {
	cs, err := tls13Suite(suite, secret)
	if err != nil {
		return nil, err
	}
	return hkdfExpandLabel(cs.hash, secret, "traffic upd", cs.hash().Size())
}

// tls13Suite returns the TLS 1.3 suite whose traffic secret secret is,
// once its length is the suite's hash length.
func tls13Suite(suite uint16, secret []byte) (*cipherSuite, error) {
	cs, err := suiteFor(tls.VersionTLS13, suite)
	if err != nil {
		return nil, err
	}
	if err := checkSecret(cs, secret); err != nil {
		return nil, err
	}
	return cs, nil
}

// tls12KeyBlock is the part of a TLS 1.2 key block an AEAD suite uses
// (RFC 5246 section 6.3; AEAD suites have no MAC keys). For AES-GCM the IVs
// are the 4-byte implicit salts (RFC 5288), for ChaCha20-Poly1305 the
// 12-byte IVs (RFC 7905).
type tls12KeyBlock struct {
	ClientKey, ServerKey []byte
	ClientIV, ServerIV   []byte
}

// tls12Keys expands the 48-byte master secret into the record keys:
// key_block = PRF(master_secret, "key expansion", server_random + client_random).
// The master secret may come from the extended master secret computation
// (RFC 7627): the key expansion is the same.
func tls12Keys(suite uint16, master, clientRandom, serverRandom []byte) (tls12KeyBlock, error) {
	cs, err := suiteFor(tls.VersionTLS12, suite)
	if err != nil {
		return tls12KeyBlock{}, err
	}
	if len(master) != 48 {
		return tls12KeyBlock{}, fmt.Errorf("ktls: TLS 1.2 master secret is %d bytes, want 48", len(master))
	}
	if len(clientRandom) != 32 || len(serverRandom) != 32 {
		return tls12KeyBlock{}, fmt.Errorf("ktls: TLS 1.2 randoms are %d and %d bytes, want 32", len(clientRandom), len(serverRandom))
	}
	seed := make([]byte, 0, 64)
	seed = append(seed, serverRandom...)
	seed = append(seed, clientRandom...)
	block := tls12PRF(cs.hash, master, "key expansion", seed, 2*cs.keyLen+2*cs.ivLen)
	// client_write_key, server_write_key, client_write_IV, server_write_IV,
	// each sliced with a full slice expression so that an append by a caller
	// cannot run into its neighbour.
	k, v := cs.keyLen, cs.ivLen
	return tls12KeyBlock{
		ClientKey: block[0:k:k],
		ServerKey: block[k : 2*k : 2*k],
		ClientIV:  block[2*k : 2*k+v : 2*k+v],
		ServerIV:  block[2*k+v : 2*k+2*v : 2*k+2*v],
	}, nil
}

// tls12PRF is the TLS 1.2 PRF: P_hash(secret, label + seed) truncated to
// length bytes (RFC 5246 section 5).
func tls12PRF(h func() hash.Hash, secret []byte, label string, seed []byte, length int) []byte {
	labelSeed := make([]byte, 0, len(label)+len(seed))
	labelSeed = append(labelSeed, label...)
	labelSeed = append(labelSeed, seed...)

	mac := hmac.New(h, secret)
	out := make([]byte, 0, length+mac.Size())
	// A(1) = HMAC(secret, A(0)) with A(0) = label + seed.
	mac.Write(labelSeed)
	a := mac.Sum(nil)
	for len(out) < length {
		// P_hash output block: HMAC(secret, A(i) + label + seed).
		mac.Reset()
		mac.Write(a)
		mac.Write(labelSeed)
		out = mac.Sum(out)
		// A(i+1) = HMAC(secret, A(i)).
		mac.Reset()
		mac.Write(a)
		a = mac.Sum(a[:0])
	}
	return out[:length:length]
}
