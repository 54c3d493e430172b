#!/usr/bin/env bash
# Installs Debian's Slurm (slurmctld, slurmd, slurm-client) and munge when any is missing;
# does nothing when all are there. Root and apt-get (Debian 12: Slurm 22.05, about 15 s).
#
# No daemon may start on install: cluster.sh starts its own, with its own config and key. On
# hosts without a policy-rc.d (containers usually have one), one that refuses every start is
# put in place for the install and removed afterwards.
set -euo pipefail

missing=()
for tool in slurmctld slurmd sbatch munged; do command -v "$tool" >/dev/null || missing+=("$tool"); done
((${#missing[@]})) || exit 0
echo "ensure_packages.sh: missing ${missing[*]}; installing Slurm and munge with apt-get" >&2
[[ $(id -u) == 0 ]] || { echo "ensure_packages.sh: installing needs root" >&2; exit 2; }
command -v apt-get >/dev/null || { echo "ensure_packages.sh: no apt-get; install Slurm and munge yourself" >&2; exit 2; }

policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  trap 'rm -f "$policy"' EXIT
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
echo "ensure_packages.sh: $(slurmctld -V), munge $(munged -V 2>&1 | awk '{print $1}')" >&2
