#!/bin/bash
# Install the Debian packages sandvisor needs on the host, when any is missing.
# Idempotent and quiet when everything is there; called by every nox session that
# boots or builds guests, so a fresh Debian 12 machine needs nothing installed by hand.
set -euo pipefail
# skopeo, umoci: pull and unpack OCI images (images/oci.py); docker-registry: the loopback
# registry the image tests and benchmark push to; nftables (libnftables1), iproute2: tap
# networking and egress policy (actors/net/hostnet.py, actors/net/nft.py); gcc, libc6-dev (libc.a
# for the static jail helper): the package build compiles actors/jail_exec.c and
# ram_discard.c (setup.py; without them serve refuses to start as root); binutils (objcopy):
# the image build strips the guest modules (images/build.py strip_module);
# python3: Debian's own interpreter, which tests run as other users (/root is 0700)
PKGS=(qemu-system-x86 qemu-utils mmdebstrap busybox-static cpio e2fsprogs lz4 tmux qemu-guest-agent procps
  skopeo umoci docker-registry nftables iproute2 gcc libc6-dev python3 binutils)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
echo "sandvisor: installing host packages: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# docker-registry ships a service listening on :5000; the tests start their own on loopback
if [[ " ${missing[*]} " == *" docker-registry "* ]] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
fi
