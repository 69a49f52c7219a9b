#!/usr/bin/env bash
# System packages the deploy tests use, installed when missing (CI runs this before pytest):
#   systemd-analyze (Debian package 'systemd') for `systemd-analyze verify` of the unit file.
# Without it those tests skip and say why. Needs root (or sudo) and apt; does nothing otherwise.
set -euo pipefail

if command -v systemd-analyze >/dev/null; then
    echo "ci-deps: systemd-analyze present"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "ci-deps: no apt-get here; install systemd-analyze by hand to run the unit-file check" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "ci-deps: not root and no sudo; cannot install the systemd package" >&2
        exit 1
    fi
    sudo="sudo -n"
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends systemd
command -v systemd-analyze
