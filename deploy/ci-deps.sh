#!/usr/bin/env bash
# System packages the deploy tests use, installed when missing (CI runs this before pytest):
#   systemd-analyze (Debian package 'systemd') for `systemd-analyze verify` of the unit files;
#   nginx (Debian package 'nginx-light') for the replicas behind deploy/nginx-edgerun.conf.
# Without them those tests skip and say why. Needs root (or sudo) and apt; does nothing otherwise.
set -euo pipefail

want=()
command -v systemd-analyze >/dev/null || want+=(systemd)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || want+=(nginx-light)
if [ ${#want[@]} = 0 ]; then
    echo "ci-deps: systemd-analyze and nginx present"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "ci-deps: no apt-get here; install ${want[*]} by hand to run the unit-file and replica checks" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "ci-deps: not root and no sudo; cannot install ${want[*]}" >&2
        exit 1
    fi
    sudo="sudo -n"
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${want[@]}"
command -v systemd-analyze
command -v nginx || ls /usr/sbin/nginx
