"""A real SFTP server for tests: Debian's OpenSSH ``sshd`` on a free port of 127.0.0.1, with its own
host key, config and authorized keys in a temporary folder (``make test`` installs openssh-server).

Only public-key logins; the clients' keys are made here. Run as root it accepts any local user
whose key was authorized (the two-host test logs in as its artifact user); run as anyone else,
sshd can only log that same user in.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefect_cluster import free_port

SSHD = Path("/usr/sbin/sshd")


def sftp_skip_reason() -> str | None:
    if not SSHD.is_file():
        return "OpenSSH's sshd is not installed (make test installs Debian's openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed"
    return None


def make_key(path: Path) -> Path:
    """A new ed25519 key pair at ``path`` (private) and ``path.pub``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@dataclass
class SftpServer:
    host: str
    port: int
    user: str
    home: Path
    client_key: Path
    host_key: Path  # the server's private host key (its public half: ``host_key.pub``)

    def known_hosts_line(self) -> str:
        """The server's key as an OpenSSH known_hosts line (``[host]:port`` form)."""
        kind, key = Path(f"{self.host_key}.pub").read_text().split()[:2]
        return f"[{self.host}]:{self.port} {kind} {key}\n"

    def url(self, path: Path) -> str:
        """The sftp:// URL of the absolute ``path`` on this server."""
        return f"sftp://{self.user}@{self.host}:{self.port}{Path(path).absolute()}"

    @property
    def options(self) -> dict:
        """fsspec storage options of a client holding :attr:`client_key`."""
        return {"key_filename": str(self.client_key), "look_for_keys": False, "allow_agent": False}


@contextmanager
def sftp_server(root: Path, *, user: str | None = None, authorized: list[Path] = ()) -> Iterator[SftpServer]:
    """sshd serving SFTP for ``user`` (default: this process's user) on a free port.

    ``authorized``: extra public keys allowed in (besides the client key made here).
    """
    root.mkdir(parents=True, exist_ok=True)
    user = user or pwd.getpwuid(os.getuid()).pw_name
    entry = pwd.getpwnam(user)
    host_key = make_key(root / "ssh_host_ed25519_key")
    client_key = make_key(root / "client" / "id_ed25519")
    keys = root / "authorized_keys"
    keys.write_text("".join(Path(f"{k}.pub" if not str(k).endswith(".pub") else k).read_text()
                            for k in [client_key, *authorized]))
    os.chmod(keys, 0o644)
    port = free_port()
    config = root / "sshd_config"
    config.write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile {root / 'sshd.pid'}
AuthorizedKeysFile {keys}
AuthenticationMethods publickey
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
AllowUsers {user}
Subsystem sftp internal-sftp
LogLevel ERROR
""")
    Path("/run/sshd").mkdir(exist_ok=True) if os.geteuid() == 0 else None
    proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(root / "sshd.log", "wb"))
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not start: {(root / 'sshd.log').read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield SftpServer(host="127.0.0.1", port=port, user=user, home=Path(entry.pw_dir), client_key=client_key,
                         host_key=host_key)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
