#!/usr/bin/env python3
"""Derives diag_hw_sw_zerocopy.hex from the recorded diag_6.1_sw_sw.hex.

No NIC with TLS offload is at hand, so the device-offload answer is the
recorded software one edited the way the kernel would write it
(net/tls/tls_main.c tls_get_info): TLS_INFO_CIPHER 51 -> 52 (AES-256-GCM),
TLS_INFO_TXCONF TLS_CONF_SW (2) -> TLS_CONF_HW (3), and a TLS_INFO_ZC_RO_TX
flag (a zero-length attribute, type 5) appended to the INET_ULP_INFO_TLS
nest, whose length, the enclosing INET_DIAG_ULP_INFO length and nlmsg_len
grow by the flag's 4 bytes. All integers are little endian (x86-64 host).
Usage: python3 diag_derive_hw.py > diag_hw_sw_zerocopy.hex
"""
import struct

lines = open("diag_6.1_sw_sw.hex").read().splitlines()
inode = next(l for l in lines if l.startswith("# inode:"))
b = bytearray.fromhex(" ".join(l for l in lines if not l.startswith("#")))

NLMSG_HDR, INET_DIAG_MSG = 16, 72
off = NLMSG_HDR + INET_DIAG_MSG
while off < len(b):
    alen, atype = struct.unpack_from("<HH", b, off)
    if atype & 0x3FFF == 19:  # INET_DIAG_ULP_INFO
        ulp = off
        break
    off += (alen + 3) & ~3
else:
    raise SystemExit("no INET_DIAG_ULP_INFO")

off = ulp + 4
while True:
    alen, atype = struct.unpack_from("<HH", b, off)
    if atype & 0x3FFF == 2:  # INET_ULP_INFO_TLS
        tls = off
        break
    off += (alen + 3) & ~3
tls_len = struct.unpack_from("<H", b, tls)[0]

off = tls + 4
while off < tls + tls_len:
    alen, atype = struct.unpack_from("<HH", b, off)
    if atype == 2:  # TLS_INFO_CIPHER
        struct.pack_into("<H", b, off + 4, 52)
    if atype == 3:  # TLS_INFO_TXCONF
        struct.pack_into("<H", b, off + 4, 3)
    off += (alen + 3) & ~3

flag = struct.pack("<HH", 4, 5)  # TLS_INFO_ZC_RO_TX
end = tls + ((tls_len + 3) & ~3)
b[end:end] = flag
for at in (tls, ulp):
    struct.pack_into("<H", b, at, struct.unpack_from("<H", b, at)[0] + 4)
struct.pack_into("<I", b, 0, struct.unpack_from("<I", b, 0)[0] + 4)

print("# derived by diag_derive_hw.py from diag_6.1_sw_sw.hex: TX hw (TLS_CONF_HW), RX sw, AES-256-GCM, TLS_INFO_ZC_RO_TX")
print(inode)
for i in range(0, len(b), 16):
    print(" ".join("%02x" % c for c in b[i:i + 16]))
