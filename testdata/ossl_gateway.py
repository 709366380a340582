#!/usr/bin/python3
"""An edge gateway made of OpenSSL (libssl.so.3 through ctypes), for the
sandbox forwarder's kernel tests.

It opens a mutual-TLS 1.3 connection, writes a signed preamble, then runs a
plan of steps against a target that echoes, and prints one JSON object with
what happened. `openssl s_client` cannot do this: it takes every stdin chunk
that starts with K, k, Q or R as a command (and drops it), and its -quiet and
-ign_eof switch the commands off altogether, so it cannot write the binary
preamble (magic "KTLP") and later send a KeyUpdate. libssl itself can.

usage: ossl_gateway.py ADDR:PORT CA CERT KEY PREAMBLE_FILE STEP...

Steps, run in order; the first that fails ends the plan (its error is
reported, the connection is closed):
  data:N       write N pseudo-random bytes, then read until the echo of
               everything written so far is back (so whatever follows
               happens between records the forwarder has already spliced)
  ku:req       send KeyUpdate(update_requested): the peer must answer with
               its own KeyUpdate, which the next read consumes
  ku:noreq     send KeyUpdate(update_not_requested)
  kuflood:N    send N KeyUpdate(update_not_requested) back to back
  badrecord    write one application_data record with a wrong tag straight
               on the socket, behind OpenSSL's back (the peer cannot decrypt it)
  alert:D      write a fatal alert with description D (e.g. 80, internal_error),
               sealed under the client's application key behind OpenSSL's
               back: libssl has no call that sends an alert mid-stream. Only
               before any KeyUpdate (the key log holds the first secret only)
  close        send close_notify, then wait
  wait         read to the end: the peer's close_notify, a TCP EOF, or an
               error (an alert, a reset)

Output (stdout, one line): {"version", "cipher", "steps_done", "error",
"sent", "sent_sha256", "received", "received_sha256", "key_updates",
"end"}. "end" says how the last read ended: "close_notify", "eof",
"error: ..." or "" when no read ran to the end.
"""

import ctypes
import hashlib
import json
import os
import random
import socket
import struct
import sys

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

SSL_FILETYPE_PEM = 1
SSL_VERIFY_PEER = 1
SSL_CTRL_SET_TLSEXT_HOSTNAME = 55
SSL_CTRL_SET_MIN_PROTO_VERSION = 123
SSL_CTRL_SET_MAX_PROTO_VERSION = 124
TLSEXT_NAMETYPE_host_name = 0
TLS1_3_VERSION = 0x0304
SSL_KEY_UPDATE_NOT_REQUESTED = 0
SSL_KEY_UPDATE_REQUESTED = 1
SSL_ERROR_SYSCALL = 5
SSL_ERROR_ZERO_RETURN = 6

# A hung peer turns into an error instead of a hang (SO_RCVTIMEO/SO_SNDTIMEO
# make the blocking read(2)/write(2) under libssl fail with EAGAIN).
IO_TIMEOUT_S = 120

# TLS 1.3 suite -> (hash, AEAD, key length), for sealing the alert step's record.
SUITES = {
    "TLS_AES_128_GCM_SHA256": (hashes.SHA256, AESGCM, 16),
    "TLS_AES_256_GCM_SHA384": (hashes.SHA384, AESGCM, 32),
    "TLS_CHACHA20_POLY1305_SHA256": (hashes.SHA256, ChaCha20Poly1305, 32),
}
RECORD_ALERT, RECORD_APPLICATION_DATA, ALERT_FATAL = 21, 23, 2
KEYLOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)

ssl = ctypes.CDLL("libssl.so.3", use_errno=True)
crypto = ctypes.CDLL("libcrypto.so.3")
P, I, L, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_char_p
for name, res, args in [
    ("TLS_client_method", P, []),
    ("SSL_CTX_new", P, [P]),
    ("SSL_CTX_ctrl", L, [P, I, L, P]),
    ("SSL_CTX_load_verify_locations", I, [P, S, S]),
    ("SSL_CTX_set_verify", None, [P, I, P]),
    ("SSL_CTX_use_certificate_chain_file", I, [P, S]),
    ("SSL_CTX_use_PrivateKey_file", I, [P, S, I]),
    ("SSL_CTX_set_keylog_callback", None, [P, KEYLOG_CALLBACK]),
    ("SSL_CTX_free", None, [P]),
    ("SSL_new", P, [P]),
    ("SSL_ctrl", L, [P, I, L, P]),
    ("SSL_set1_host", I, [P, S]),
    ("SSL_set_fd", I, [P, I]),
    ("SSL_connect", I, [P]),
    ("SSL_write", I, [P, P, I]),
    ("SSL_read", I, [P, P, I]),
    ("SSL_get_error", I, [P, I]),
    ("SSL_key_update", I, [P, I]),
    ("SSL_do_handshake", I, [P]),
    ("SSL_shutdown", I, [P]),
    ("SSL_get_version", S, [P]),
    ("SSL_get_current_cipher", P, [P]),
    ("SSL_CIPHER_get_name", S, [P]),
    ("SSL_free", None, [P]),
]:
    fn = getattr(ssl, name)
    fn.restype, fn.argtypes = res, args
crypto.ERR_get_error.restype = ctypes.c_ulong
crypto.ERR_error_string_n.argtypes = [ctypes.c_ulong, ctypes.c_char_p, ctypes.c_size_t]


class Failure(Exception):
    pass


def ssl_failure(what, s=None, ret=0):
    """Describes the failed libssl call: SSL_get_error, then the error queue
    or errno (libssl leaves a failed read(2)/write(2) in errno)."""
    kind = ssl.SSL_get_error(s, ret) if s else 0
    errno = ctypes.get_errno()
    msgs = []
    while True:
        code = crypto.ERR_get_error()
        if not code:
            break
        buf = ctypes.create_string_buffer(256)
        crypto.ERR_error_string_n(code, buf, len(buf))
        msgs.append(buf.value.decode())
    if not msgs and kind == SSL_ERROR_SYSCALL:
        msgs.append(os.strerror(errno) if errno else "unexpected eof")
    return Failure(f"{what}: SSL_get_error {kind}: {'; '.join(msgs) or 'no detail'}")


def hkdf_expand_label(hash_alg, secret, label, length):
    """RFC 8446 section 7.1, with an empty context."""
    full = b"tls13 " + label.encode()
    info = struct.pack("!HB", length, len(full)) + full + b"\x00"
    return HKDFExpand(hash_alg(), length, info).derive(secret)


class Gateway:
    def __init__(self, addr, ca, cert, key):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        tv = struct.pack("ll", IO_TIMEOUT_S, 0)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.ctx = ssl.SSL_CTX_new(ssl.TLS_client_method())
        for op in (SSL_CTRL_SET_MIN_PROTO_VERSION, SSL_CTRL_SET_MAX_PROTO_VERSION):
            ssl.SSL_CTX_ctrl(self.ctx, op, TLS1_3_VERSION, None)
        if ssl.SSL_CTX_load_verify_locations(self.ctx, ca.encode(), None) != 1:
            raise ssl_failure("load CA")
        ssl.SSL_CTX_set_verify(self.ctx, SSL_VERIFY_PEER, None)
        if ssl.SSL_CTX_use_certificate_chain_file(self.ctx, cert.encode()) != 1:
            raise ssl_failure("load client certificate")
        if ssl.SSL_CTX_use_PrivateKey_file(self.ctx, key.encode(), SSL_FILETYPE_PEM) != 1:
            raise ssl_failure("load client key")
        # The key log hands over the client's first application traffic
        # secret, which the alert step seals its record with.
        self.secrets = {}
        self.keylog = KEYLOG_CALLBACK(self.log_secret)
        ssl.SSL_CTX_set_keylog_callback(self.ctx, self.keylog)
        self.ssl = ssl.SSL_new(self.ctx)
        ssl.SSL_ctrl(self.ssl, SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name, S(b"localhost"))
        ssl.SSL_set1_host(self.ssl, b"localhost")
        ssl.SSL_set_fd(self.ssl, self.sock.fileno())
        ret = ssl.SSL_connect(self.ssl)
        if ret != 1:
            raise ssl_failure("handshake", self.ssl, ret)
        self.rand = random.Random(1)
        self.sent = self.received = self.key_updates = 0
        self.sent_hash, self.recv_hash = hashlib.sha256(), hashlib.sha256()
        self.buf = ctypes.create_string_buffer(64 << 10)
        self.end = ""
        # Records written under the first application key: the sequence
        # number of the next one.
        self.records = 0

    def log_secret(self, _ssl, line):
        label, _, secret = line.decode().split(" ")
        self.secrets[label] = bytes.fromhex(secret)

    def write(self, data, hashed=True):
        view = memoryview(data)
        while view:
            chunk = bytes(view[: 16 << 10])
            ret = ssl.SSL_write(self.ssl, chunk, len(chunk))
            if ret <= 0:
                raise ssl_failure(f"write after {self.sent} bytes", self.ssl, ret)
            # One record per call: a chunk fits libssl's 16 KiB fragment.
            self.records += 1
            view = view[ret:]
            if hashed:
                self.sent += ret
                self.sent_hash.update(chunk[:ret])

    def read(self):
        """Reads one chunk; returns 0 at the end of the stream and records
        how it ended."""
        ctypes.set_errno(0)
        ret = ssl.SSL_read(self.ssl, self.buf, len(self.buf))
        if ret > 0:
            self.received += ret
            self.recv_hash.update(self.buf.raw[:ret])
            return ret
        kind = ssl.SSL_get_error(self.ssl, ret)
        if kind == SSL_ERROR_ZERO_RETURN:
            self.end = "close_notify"
        else:
            # OpenSSL 3 reports a TCP EOF without close_notify as an error
            # ("unexpected eof while reading").
            err = str(ssl_failure("read", self.ssl, ret))
            self.end = "eof" if "unexpected eof" in err else "error: " + err
        return 0

    def data(self, n):
        self.write(self.rand.randbytes(n))
        while self.received < self.sent:
            if not self.read():
                raise Failure(f"echo ended after {self.received} of {self.sent} bytes: {self.end}")

    def key_update(self, kind):
        if ssl.SSL_key_update(self.ssl, kind) != 1:
            raise ssl_failure(f"SSL_key_update after {self.key_updates}")
        # libssl sends the KeyUpdate with the next write; send it now.
        ret = ssl.SSL_do_handshake(self.ssl)
        if ret != 1:
            raise ssl_failure(f"send KeyUpdate after {self.key_updates}", self.ssl, ret)
        self.key_updates += 1

    def bad_record(self):
        # An application_data record whose ciphertext and tag are garbage:
        # the peer's AEAD open fails (the kernel: EBADMSG, TlsDecryptError).
        body = bytes(range(64))
        self.sock.sendall(struct.pack("!BHH", 23, 0x0303, len(body)) + body)

    def alert(self, description):
        if self.key_updates:
            raise SystemExit("alert step after a KeyUpdate: its key is not in the key log")
        name = ssl.SSL_CIPHER_get_name(ssl.SSL_get_current_cipher(self.ssl)).decode()
        hash_alg, aead, key_len = SUITES[name]
        secret = self.secrets["CLIENT_TRAFFIC_SECRET_0"]
        key = hkdf_expand_label(hash_alg, secret, "key", key_len)
        iv = hkdf_expand_label(hash_alg, secret, "iv", 12)
        nonce = bytes(a ^ b for a, b in zip(iv, self.records.to_bytes(12, "big")))
        # TLSInnerPlaintext: the alert, then its real content type.
        inner = bytes([ALERT_FATAL, description, RECORD_ALERT])
        header = struct.pack("!BHH", RECORD_APPLICATION_DATA, 0x0303, len(inner) + 16)
        self.sock.sendall(header + aead(key).encrypt(nonce, inner, header))
        self.records += 1

    def close(self):
        ret = ssl.SSL_shutdown(self.ssl)
        if ret < 0:
            raise ssl_failure("send close_notify", self.ssl, ret)
        self.wait()

    def wait(self):
        while self.read():
            pass

    def step(self, spec):
        op, _, arg = spec.partition(":")
        if op == "data":
            self.data(int(arg))
        elif op == "ku" and arg in ("req", "noreq"):
            self.key_update(SSL_KEY_UPDATE_REQUESTED if arg == "req" else SSL_KEY_UPDATE_NOT_REQUESTED)
        elif op == "kuflood":
            for _ in range(int(arg)):
                self.key_update(SSL_KEY_UPDATE_NOT_REQUESTED)
        elif op == "badrecord":
            self.bad_record()
        elif op == "alert":
            self.alert(int(arg))
        elif op == "close":
            self.close()
        elif op == "wait":
            self.wait()
        else:
            raise SystemExit(f"unknown step {spec!r}")

    def result(self, steps_done, error):
        cipher = ssl.SSL_get_current_cipher(self.ssl)
        return {
            "version": ssl.SSL_get_version(self.ssl).decode(),
            "cipher": ssl.SSL_CIPHER_get_name(cipher).decode() if cipher else "",
            "steps_done": steps_done,
            "error": error,
            "sent": self.sent,
            "sent_sha256": self.sent_hash.hexdigest(),
            "received": self.received,
            "received_sha256": self.recv_hash.hexdigest(),
            "key_updates": self.key_updates,
            "end": self.end,
        }

    def free(self):
        ssl.SSL_free(self.ssl)
        ssl.SSL_CTX_free(self.ctx)
        self.sock.close()


def main():
    if len(sys.argv) < 7:
        raise SystemExit(__doc__)
    addr, ca, cert, key, preamble_file, *steps = sys.argv[1:]
    with open(preamble_file, "rb") as f:
        preamble = f.read()
    gw = Gateway(addr, ca, cert, key)
    done, error = 0, ""
    try:
        gw.write(preamble, hashed=False)
        for spec in steps:
            gw.step(spec)
            done += 1
    except Failure as e:
        error = str(e)
    print(json.dumps(gw.result(done, error)), flush=True)
    gw.free()


if __name__ == "__main__":
    main()
