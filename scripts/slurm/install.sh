#!/usr/bin/env bash
# Installs the Debian packages of a single-node SLURM cluster (slurmctld, slurmd, munge, the client
# tools), if they are missing. Needs root and apt-get. ~3 MB; not the slurm-wlm metapackage (~43 packages).
set -euo pipefail
PACKAGES=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then exit 0; fi
if [[ $(id -u) -ne 0 ]]; then
  echo "[slurm-install] missing packages: ${missing[*]}; run as root, or: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "[slurm-install] missing packages: ${missing[*]}, and apt-get is not available here" >&2
  exit 1
fi
echo "[slurm-install] installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
