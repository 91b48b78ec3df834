#!/usr/bin/env bash
# Install the Debian packages that the real-service tests use: slurm-wlm + munge (a real
# Slurm for tests/slurm), prometheus (tests/monitor's scrape test) and iproute2 (ip, tc:
# the emulated network of scripts/netemu.sh). Needs root and apt;
# does nothing when every package is already there. Usage: sudo bash scripts/system-deps.sh
set -euo pipefail
pkgs=(slurm-wlm munge prometheus iproute2)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "scripts/system-deps.sh: need root and apt-get to install ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian starts no services here (no systemd); the test fixtures start their own daemons.
