"""The artifact store: what one host's stage hands another host's stage, through one URL.

Each host keeps its own store (``store.root``); what crosses hosts (the SFT adapter, with its
manifest) is published to the URL in ``store.artifacts`` (``file://``, ``sftp://``, ``s3://``,
``gs://``, ``az://``: any fsspec filesystem) and fetched into the consuming host's store at the
same store-relative path. Credentials never appear in the URL: they come from the environment of
the host (SSH keys or agent for sftp, ``AWS_*`` for s3, ...) or from its ArtifactStore block.

Layout under the URL, per artifact (its key is its store-relative path, e.g. ``runs/<run>/adapter``)::

    <key>/<file>               every file of the artifact, its own manifest.json among them
    <key>/transfer.json        written last: the files with sizes and sha256, and the artifact's digest

A file is uploaded under a temporary name and renamed; ``transfer.json`` goes last the same way,
so a reader either finds the whole artifact or none of it: an upload killed mid-way is simply not
published, and the next publish overwrites its leftovers. A fetch checks every file's size and
sha256 against ``transfer.json`` while it streams, fetches a bad object once more (a torn read),
then refuses it naming the key and the file; the local copy appears under its final name only once
complete (the store's staging + rename).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field

from ktflow.errors import ArtifactCorruptError, ArtifactNotPublishedError, ArtifactStoreError, RecipeError
from ktflow.formats.safetensors_io import fsync_dir
from ktflow.store import (
    MANIFEST_NAME,
    artifact_lock,
    file_sha256,
    list_files,
    read_manifest,
    rename_into_place,
    staging_dir_for,
    storage_errors,
)

TRANSFER_NAME = "transfer.json"
PART_SUFFIX = ".part"
CHUNK = 1 << 20

SUPPORTED_SCHEMES = ("file", "sftp", "s3", "gs", "gcs", "az", "abfs", "memory")
"""fsspec protocols ktflow accepts for ``store.artifacts`` (s3/gs/az need s3fs, gcsfs, adlfs)."""


def check_artifact_url(url: str, field: str = "store.artifacts") -> str:
    """``url`` if it names an artifact store ktflow can use, else a RecipeError saying why.

    A password in the URL is refused: credentials live in the host's environment or in an
    ArtifactStore block, never in a recipe (recipes are logged, hashed and shown in the UI).
    """
    parts = urlsplit(url)
    if parts.scheme not in SUPPORTED_SCHEMES:
        raise RecipeError(f"{field}={url!r}", f"scheme {parts.scheme or '(none)'!r} is not one of "
                          f"{', '.join(SUPPORTED_SCHEMES)}",
                          "write a URL such as sftp://user@host/srv/ktflow-artifacts, s3://bucket/prefix or "
                          "file:///mnt/artifacts")
    if parts.password is not None:
        raise RecipeError(f"{field}", "holds a password in its URL",
                          "remove it from the recipe: put the credentials in the host's environment (SSH key or "
                          "agent, AWS_* variables) or in an ArtifactStore block (`ktflow worker --artifacts BLOCK`)")
    if parts.scheme == "file" and not parts.path.startswith("/"):
        raise RecipeError(f"{field}={url!r}", "is a relative file:// URL", "write file:///absolute/path")
    return url.rstrip("/")


class TransferFile(BaseModel):
    """One object of a published artifact."""

    path: str
    size: int
    sha256: str


class TransferManifest(BaseModel):
    """What a complete artifact under a key holds (``transfer.json``, written last)."""

    key: str
    digest: str = Field(description="the artifact's own manifest digest (its identity in ktflow)")
    files: list[TransferFile]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


class ArtifactRef(BaseModel):
    """A published artifact, as a stage hands it to the next: the store's URL (no credentials),
    the key and the digest the consumer must find."""

    url: str
    key: str
    digest: str
    files: int = 0
    bytes: int = 0

    def where(self) -> str:
        return f"{self.url}/{self.key}"


Progress = Callable[[int, int], None]


# paramiko's connect waits forever by default where a host accepts TCP and says nothing (a dead sshd, a
# firewall that drops): each phase of an SFTP connection gets a limit, and every later read or write.
SFTP_CONNECT_TIMEOUTS: dict[str, float] = {"timeout": 30.0, "banner_timeout": 30.0, "auth_timeout": 30.0}
SFTP_IO_TIMEOUT_S = 120.0


def known_hosts_policy(path: Path) -> Any:
    """A paramiko host-key policy that accepts a server only if ``path`` (OpenSSH known_hosts format,
    hashed entries included) lists the key it presents for its host (``[host]:port`` off port 22).

    Raises:
        ArtifactStoreError: ``path`` cannot be read.
    """
    import paramiko

    try:
        keys = paramiko.HostKeys(str(path))
    except OSError as exc:
        raise ArtifactStoreError(f"known_hosts {path}: {exc}; give the path of an OpenSSH known_hosts file "
                                 "(ssh-keyscan -p PORT HOST >> FILE, after checking the key)") from exc

    class KnownHostsOnly(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            known = keys.lookup(hostname)
            if known is None or known.get(key.get_name()) != key:
                raise paramiko.SSHException(
                    f"the {key.get_name()} host key {key.get_fingerprint().hex()} of {hostname} is not in {path} "
                    "(add the server's key there after checking it, e.g. ssh-keyscan)")

    return KnownHostsOnly()


class ArtifactStore:
    """An fsspec filesystem under one URL, with atomic publication and verified fetches."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec.core

        self.url = check_artifact_url(url)
        options = dict(storage_options or {})
        # ktflow's own SFTP options (never passed to paramiko): the read/write limit, and a known_hosts
        # file whose key the server must present (fsspec's default accepts any key on first use).
        io_timeout = float(options.pop("io_timeout", SFTP_IO_TIMEOUT_S))
        known_hosts = options.pop("known_hosts", None)
        if self.url.startswith("sftp://"):
            options = {**SFTP_CONNECT_TIMEOUTS, **options}  # the block's or caller's values win
            # fsspec would hand a later store (a retry after a timeout) the same, possibly dead, connection
            options["skip_instance_cache"] = True
            if known_hosts:
                options["host_key_policy"] = known_hosts_policy(Path(str(known_hosts)).expanduser())
        try:
            self.fs, self._root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as exc:
            raise ArtifactStoreError(f"artifact store {self.url}: {exc} (install the fsspec backend it names "
                                     "in the orchestrator env)") from exc
        except Exception as exc:  # refused, timed out, bad key: paramiko's and botocore's own types
            raise self._fail("connecting", exc) from exc
        channel = getattr(getattr(self.fs, "ftp", None), "get_channel", None)
        if channel is not None:  # SFTP: a read or write that hears nothing for this long fails, not hangs
            channel().settimeout(io_timeout)
        self._root = self._root.rstrip("/")

    def object_path(self, key: str, name: str = "") -> str:
        """The filesystem path (no scheme) of ``name`` in the artifact ``key``, or of the key itself."""
        return "/".join(p for p in (self._root, key.strip("/"), name) if p)

    def _fail(self, what: str, exc: BaseException) -> ArtifactStoreError:
        return ArtifactStoreError(f"artifact store {self.url}: {what} failed: {type(exc).__name__}: {exc}. Check that "
                                  "the host reaches it and that its credentials (environment or ArtifactStore block) "
                                  "allow it")

    def transfer_manifest(self, key: str) -> TransferManifest | None:
        """The complete artifact published under ``key`` (None: none is)."""
        path = self.object_path(key, TRANSFER_NAME)
        try:
            with self.fs.open(path, "rb") as fh:
                text = fh.read()
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._fail(f"reading {key}/{TRANSFER_NAME}", exc) from exc
        return TransferManifest.model_validate_json(text)

    def publish(self, local_dir: Path, key: str, *, progress: Progress | None = None) -> ArtifactRef:
        """Upload the published artifact ``local_dir`` under ``key``; cached when the same artifact is there.

        Raises:
            ArtifactNotPublishedError: ``local_dir`` is not a complete artifact (no manifest).
            ArtifactStoreError: the store cannot be written.
        """
        manifest = read_manifest(local_dir)
        if manifest is None:
            raise ArtifactNotPublishedError(str(local_dir), "holds no manifest.json: not a published artifact",
                                            "publish only what a stage finished")
        digest = manifest.digest()
        there = self.transfer_manifest(key)
        if there is not None and there.digest == digest:
            return self._ref(there)
        names = [e.path for e in list_files(local_dir)] + [MANIFEST_NAME]  # its own manifest travels too
        files = [TransferFile(path=name, size=(local_dir / name).stat().st_size, sha256=file_sha256(local_dir / name))
                 for name in names]
        transfer = TransferManifest(key=key, digest=digest, files=files)
        total, done = transfer.bytes, 0
        try:
            self.fs.makedirs(self.object_path(key), exist_ok=True)
            self._remove_leftovers(key)
            for entry in files:
                self._upload(local_dir / entry.path, self.object_path(key, entry.path))
                done += entry.size
                if progress:
                    progress(done, total)
            self._put_bytes(transfer.model_dump_json(indent=1).encode(), self.object_path(key, TRANSFER_NAME))
        except ArtifactStoreError:
            raise
        except Exception as exc:
            raise self._fail(f"publishing {key}", exc) from exc
        return self._ref(transfer)

    def _remove_leftovers(self, key: str) -> None:
        """Temporary objects of an upload that was killed (they are never read: no manifest names them)."""
        for path in self.fs.find(self.object_path(key)):
            if PART_SUFFIX + "-" in path.rsplit("/", 1)[-1]:
                self.fs.rm(path)

    def _ref(self, transfer: TransferManifest) -> ArtifactRef:
        return ArtifactRef(url=self.url, key=transfer.key, digest=transfer.digest, files=len(transfer.files),
                           bytes=transfer.bytes)

    def _upload(self, src: Path, dst: str) -> None:
        part = f"{dst}{PART_SUFFIX}-{uuid.uuid4().hex[:8]}"
        parent = dst.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        with open(src, "rb") as fin, self.fs.open(part, "wb") as fout:
            shutil.copyfileobj(fin, fout, CHUNK)
        self._replace(part, dst)

    def _put_bytes(self, data: bytes, dst: str) -> None:
        part = f"{dst}{PART_SUFFIX}-{uuid.uuid4().hex[:8]}"
        with self.fs.open(part, "wb") as fout:
            fout.write(data)
        self._replace(part, dst)

    def _replace(self, part: str, dst: str) -> None:
        if self.fs.exists(dst):  # sftp's rename does not replace; a rerun overwrites a killed upload's leftovers
            self.fs.rm(dst)
        self.fs.mv(part, dst)

    def fetch(self, ref: ArtifactRef, final_dir: Path, *, attempts: int = 2,
              progress: Progress | None = None) -> Path:
        """The artifact ``ref`` in this host's store at ``final_dir``, fetched and verified if not there yet.

        Raises:
            ArtifactNotPublishedError: nothing complete is published under the key, or another artifact is.
            ArtifactCorruptError: an object kept failing its size or sha256 check (the key and file named).
        """
        final_dir = Path(final_dir)
        local = read_manifest(final_dir) if final_dir.is_dir() else None
        if local is not None and local.digest() == ref.digest:
            return final_dir
        transfer = self.transfer_manifest(ref.key)
        if transfer is None:
            raise ArtifactNotPublishedError(ref.where(), "has no complete artifact (no transfer.json)",
                                            "rerun the stage that publishes it (on its host); an upload killed mid-way "
                                            "publishes nothing")
        if transfer.digest != ref.digest:
            raise ArtifactNotPublishedError(ref.where(), f"holds artifact {transfer.digest[:12]}, not {ref.digest[:12]}",
                                            "rerun the pipeline: the producing stage republishes under this key")
        with artifact_lock(final_dir), storage_errors(final_dir, need=transfer.bytes):
            local = read_manifest(final_dir) if final_dir.is_dir() else None
            if local is not None and local.digest() == ref.digest:
                return final_dir
            staging = staging_dir_for(final_dir)
            shutil.rmtree(staging, ignore_errors=True)
            done = 0
            for entry in transfer.files:
                self._fetch_file(ref, entry, staging / entry.path, attempts)
                done += entry.size
                if progress:
                    progress(done, transfer.bytes)
            fetched = read_manifest(staging)
            if fetched is None or fetched.digest() != ref.digest:
                raise ArtifactCorruptError(f"{ref.where()}/{MANIFEST_NAME}: the fetched manifest's digest is not "
                                           f"{ref.digest[:12]}. Rerun the producing stage to republish it")
            fsync_dir(staging)
            rename_into_place(staging, final_dir)  # an older artifact there is replaced whole, never merged
        return final_dir

    def _fetch_file(self, ref: ArtifactRef, entry: TransferFile, dst: Path, attempts: int) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        problem = ""
        for _ in range(max(attempts, 1)):
            digest, size = hashlib.sha256(), 0
            try:
                with self.fs.open(self.object_path(ref.key, entry.path), "rb") as fin, open(dst, "wb") as fout:
                    while chunk := fin.read(CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
                        fout.write(chunk)
                    fout.flush()
                    os.fsync(fout.fileno())
            except FileNotFoundError:
                problem = "is missing"
                continue
            except OSError as exc:
                problem = f"could not be read ({exc})"
                continue
            if size != entry.size:
                problem = f"has {size} bytes, the transfer manifest says {entry.size} (truncated)"
            elif digest.hexdigest() != entry.sha256:
                problem = f"has sha256 {digest.hexdigest()[:16]}..., the transfer manifest says {entry.sha256[:16]}..."
            else:
                return
        dst.unlink(missing_ok=True)
        raise ArtifactCorruptError(f"{ref.where()}/{entry.path} {problem}, after {attempts} fetches: refused. Delete "
                                   f"{ref.where()}/{TRANSFER_NAME} and rerun the producing stage to republish it")
