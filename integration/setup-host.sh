#!/usr/bin/env bash
# Installs the host tools the VM harness needs, with apt, only when missing:
# qemu (TCG, no KVM needed), a static busybox for the guest's init, cpio for
# the initramfs, kmod (depmod/modprobe --show-depends), xz/zstd for compressed
# kernel modules, the Debian keyring that verifies the kernel packages, and
# the client tools the kernel tests run (openssl, curl, strace, python3), and the
# benchmark's HAProxy and nginx; and the checkers of the operator kit under
# deploy/ (systemd-analyze, promtool).
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "$0")/lib.sh"
need=()
have() { command -v "$1" >/dev/null 2>&1; }
have qemu-system-x86_64 || need+=(qemu-system-x86)
# The busybox copied into the initramfs must be static: the guest has no libc
# until the host root is mounted.
# (Without file(1) we cannot tell, so busybox-static is requested; apt keeps
# an installed one as it is.)
have file || need+=(file)
if ! { [ -x /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q 'statically linked'; }; then
  need+=(busybox-static)
fi
have cpio || need+=(cpio)
have xz || need+=(xz-utils)
have zstd || need+=(zstd)
have depmod || need+=(kmod)
have dpkg-deb || need+=(dpkg)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
# Tools the kernel tests and the demo run inside the VM (over the 9p root
# share): a real OpenSSL client, curl for HTTP/1.1 and HTTP/2 downloads,
# strace to count the sendfile(2) calls of the listener wrapper, and python3
# for the OpenSSL gateway (testdata/ossl_gateway.py: libssl through ctypes,
# and python3-cryptography to seal the alert it sends behind libssl's back).
have openssl || need+=(openssl)
have curl || need+=(curl)
have strace || need+=(strace)
have python3 || need+=(python3)
/usr/bin/python3 -c 'import cryptography' 2>/dev/null || need+=(python3-cryptography)
# The contenders of the benchmark harness (integration/bench.sh): HAProxy and
# nginx with its stream module (TLS termination in front of a TCP upstream).
[ -x /usr/sbin/haproxy ] || need+=(haproxy)
[ -x /usr/sbin/nginx ] || need+=(nginx)
[ -f /usr/lib/nginx/modules/ngx_stream_module.so ] || need+=(libnginx-mod-stream)
# The checkers of deploy/ (deploy/deploy_test.go): `systemd-analyze verify`
# on the systemd unit, `promtool check rules` and `promtool test rules` on
# the Prometheus alerts. Debian ships promtool only in the prometheus
# package; its server is not started (the policy-rc.d below, and no systemd
# as PID 1 in a container).
have systemd-analyze || need+=(systemd)
have promtool || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "ERROR: missing host packages (${need[*]}); run as root or: apt-get install ${need[*]}" >&2; exit 1; }
echo "setup-host: apt-get install ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# Packages such as nginx start their service on install; the harness starts
# its own instances, so a policy-rc.d forbids that while apt runs.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt_get update -qq
apt_get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
