// Package ktls hands the record layer of a crypto/tls connection to Linux
// kernel TLS (kTLS) after a normal userspace handshake, and falls back to
// crypto/tls, behind the same API, when it cannot.
//
// Server (or Client) returns a *Conn whose handshake runs lazily on the
// first Read, Write or Handshake. The handshake reads through a
// record-bounded conn and captures the traffic secrets through a key log
// bound to this one connection (set on a per-handshake Clone of the config,
// including the config GetConfigForClient returns). Then it attaches the
// "tls" ULP and installs TLS_TX and TLS_RX. Offload reports the outcome and,
// when not fully offloaded, a Reason from a fixed set; an Observer and the
// process-wide Stats see every outcome.
//
// Kernel surprises this package handles, and where:
//
//   - crypto/tls over-reads (its buffer grows by needs+512): application
//     data in the segment of the peer's Finished would be stranded in
//     userspace, so the handshake reads through recordConn, which never
//     returns a byte past the current record.
//   - Go's TLS 1.3 server sends NewSessionTickets under the application key
//     during Handshake: the TX rec_seq is the number of tickets wrapped
//     (counted through WrapSession), not 0. TLS 1.2 starts both at 1
//     (Finished).
//   - TLS_TX/TLS_RX take host-endian u16 header fields but a big-endian
//     rec_seq; for TLS 1.2 AES-GCM the "iv" field is the explicit nonce
//     and must start at rec_seq, while TLS 1.2 ChaCha20-Poly1305 has no
//     explicit nonce and takes the whole 12-byte IV, as in TLS 1.3
//     (kernel.go).
//   - TCP_ULP fails with ENOTCONN before ESTABLISHED and ENOENT without the
//     module; only a CAP_NET_ADMIN caller makes the kernel autoload it
//     (Probe).
//   - A non-data record at the head of the RX queue makes read(2) fail with
//     EIO, splice(2) with EINVAL, and anything after a KeyUpdate with
//     EKEYEXPIRED until the new key is in: Read then takes that one record
//     with recvmsg(2) and TLS_GET_RECORD_TYPE (read.go). The data path
//     (package splice) calls Read once on such an error and resumes.
//   - The kernel TLS module must own the receive queue from the moment the
//     ULP attaches (CVE-2025-38616): the install runs inside the handshake,
//     under its lock, before any kernel read.
//   - A second TLS_TX/TLS_RX (KeyUpdate) works only on Linux >= 6.14; on
//     older kernels a peer's KeyUpdate closes the connection with
//     ErrRekeyUnsupported (with RX in userspace only one that requests
//     our update: the Go opener rekeys on any kernel). KeyUpdates are rate
//     limited per connection (Options.KeyUpdateLimit): a peer may send
//     them back to back, and each costs a key derivation and a setsockopt.
//   - The kernel counts records per key (rec_seq, read back with
//     getsockopt) but enforces no limit: a Conn renews its key or fails at
//     Options.RecordLimit (wear.go). A KeyUpdate must not be followed by a
//     record sealed under the old key, so KeyUpdates go out under the
//     write lock, which a relay's splice into the socket also holds
//     (splice.Sealer); the reading side only asks for them (txWant).
//   - Closing a kTLS socket drops what is left of a record the kernel
//     could only partly hand to TCP: the peer reads a truncated record,
//     then FIN. Abort resets instead of sending its alert where the send
//     buffer may not take it.
//   - Once TLS_TX is in, crypto/tls can no longer write on the socket: a
//     later failure (TLS_RX, an option) closes the connection instead of
//     leaving it half-working.
//   - Go's sendfile path unwraps one *io.LimitedReader; Caddy nests two, so
//     ReadFrom flattens them (copy.go).
//   - The keys, record sequence numbers and any record the kernel holds
//     (one decrypted in part, one sealed but not yet sent) belong to the
//     socket, not to the descriptor: a duplicate passed to another process
//     carries them, and close(2) of one descriptor of several is not the
//     socket's close. getsockopt(TLS_TX/TLS_RX) returns the whole
//     crypto_info, key included, at the struct's exact size only (EINVAL
//     otherwise; EBUSY without a key). Handoff and Adopt move a connection
//     on that (handoff.go).
//
// Handoff stops a Conn with both directions in the kernel at a point where
// nothing of a record is held in userspace and returns its socket and a
// HandoffState; Adopt, in this process or another, checks the socket
// against the state and continues the session (key wear, KeyUpdates and
// closed ends included).
package ktls
