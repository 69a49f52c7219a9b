#!/usr/bin/env bash
# System packages the deploy tests use, installed when missing (CI runs this before pytest):
#   systemd-analyze (Debian package 'systemd') for `systemd-analyze verify` of the unit files;
#   nginx (Debian package 'nginx-light') for the replicas behind deploy/nginx-edgerun.conf;
#   sshd (Debian package 'openssh-server') for the RPC worker reached through a restricted SSH tunnel.
#   chromium and chromedriver (Debian packages 'chromium', 'chromium-driver') for the browser test of the page at /.
# Without them those tests skip and say why. Needs root (or sudo) and apt; does nothing otherwise.
set -euo pipefail

want=()
command -v systemd-analyze >/dev/null || want+=(systemd)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || want+=(nginx-light)
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || want+=(openssh-server)
command -v chromium >/dev/null || want+=(chromium)
command -v chromedriver >/dev/null || want+=(chromium-driver)
if [ ${#want[@]} = 0 ]; then
    echo "ci-deps: systemd-analyze, nginx, sshd, chromium and chromedriver present"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "ci-deps: no apt-get here; install ${want[*]} by hand to run the unit-file, replica and tunnel checks" >&2
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
command -v sshd || ls /usr/sbin/sshd
command -v chromium
command -v chromedriver
