"""A real sshd on a loopback port and `ssh -N -L` forwards through it: the deployment's transport for RPC
workers (deploy/edgerun-tunnel@.service), for tests and bench/cluster.py. The client key is authorized the
way `deploy/install.sh --worker --authorize-key` does it: restrict,port-forwarding,permitopen=... only.

Needs root (sshd authenticates the user it runs as, and wants /run/sshd), sshd, ssh and ssh-keygen.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None)


def available() -> str | None:
    """None if a tunnel can run here, else the reason it cannot."""
    if SSHD is None or not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "sshd/ssh are not installed (Debian: openssh-server, openssh-client)"
    if os.geteuid() != 0:
        return "sshd on a test port must run as root here"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Tunnel:
    """sshd allowing forwards to `permit` ports only, and one forward per port in `forward`:
    local_ports[i] on this side -> 127.0.0.1:forward[i] on the 'worker' side."""

    def __init__(self, tmp: Path, forward: list[int], permit: list[int] | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        for k in ("host", "client"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / k)], check=True)
        opens = ",".join(f'permitopen="127.0.0.1:{p}"' for p in (forward if permit is None else permit))
        auth = tmp / "authorized_keys"
        auth.write_text(f'restrict,port-forwarding,{opens},command="/usr/sbin/nologin" '
                        + (tmp / "client.pub").read_text())
        auth.chmod(0o600)
        port = free_port()
        (tmp / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp}/host\nAuthorizedKeysFile {auth}\n"
            f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nPidFile {tmp}/sshd.pid\n"
            "StrictModes no\nPermitRootLogin prohibit-password\nUsePAM no\n")
        Path("/run/sshd").mkdir(exist_ok=True)
        self.procs.append(subprocess.Popen([SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(port)
        self.local_ports: list[int] = []
        user = os.environ.get("USER") or "root"
        for remote in forward:
            lp = free_port()
            self.procs.append(subprocess.Popen(
                ["ssh", "-N", "-T", "-F", "none", "-i", str(tmp / "client"), "-p", str(port),
                 "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "ExitOnForwardFailure=yes",
                 "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={tmp}/known_hosts",
                 "-L", f"127.0.0.1:{lp}:127.0.0.1:{remote}", f"{user}@127.0.0.1"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_port(lp)
            self.local_ports.append(lp)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
