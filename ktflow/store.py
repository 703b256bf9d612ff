"""Atomic publication of stage artifacts, and the manifest that describes each one.

Every stage writes into a staging directory beside its final one (same filesystem, so the
last step is a rename), writes ``manifest.json`` last, and renames the staging directory to
its final name. A directory under a final name is therefore always complete, and a reader
never sees half of one. The staging directory's name is deterministic, so a rerun after a
crash finds what the previous attempt finished and resumes there.

The manifest lists the inputs' identities (upstream manifest digests, source revisions),
the settings, the tool versions and the files with their sizes; its digest is the stage's
cache key, so a cache check never re-hashes a large folder.

Faults, the same way in every writing stage:

- **Concurrency**: :func:`artifact_lock` serializes writers of one artifact across processes
  (``fcntl.flock`` on ``.<name>.lock`` beside the final directory, holding the owner's pid and
  host). A second run of the same stage onto the same target waits (logging whom it waits for),
  then finds the artifact published and reuses it; with ``wait=False`` it fails at once with
  :class:`ArtifactBusyError`.
- **Full disk, read-only or unwritable target**: caught before any work where possible, as
  :class:`~ktflow.errors.HostRequirementError` (exit 2): :func:`check_free_space` when the size is
  known up front, and the lock file (the first thing a stage writes) for a read-only or
  unwritable target. The same errors arising mid-write (the disk filled up meanwhile) become
  :class:`StorageError` (exit 1) through :func:`storage_errors`, naming the path, what is free
  and what is needed; complete parts stay in the staging directory for the rerun, and nothing
  is published under the final name.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ktflow import ENGINE_VERSION, __version__
from ktflow.errors import ArtifactBusyError, HostRequirementError, InsufficientDiskError, StorageError
from ktflow.formats.safetensors_io import fsync_dir
from ktflow.units import human_bytes

MANIFEST_NAME = "manifest.json"
STAGING_SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"

log = logging.getLogger(__name__)

# Errors of the filesystem rather than of the stage: full, over quota, read-only, not ours.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
_NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})



class StoreLayout:
    """Where every artifact lives under a store root: the one place that spells store paths.

    ::

        weights/<source>            download: a hub snapshot (<repo>@<sha>...) or a local copy's revision
        bf16/<checkpoint digest>    dequantize
        int8/<bf16 name>-tp<T>      quantize-int8
        merged/<base>-<adapter>-<method>  merge: an adapter folded into its base, as a method serves it
        datasets/<name>-<digest>    the dataset as LlamaFactory reads it
        runs/<recipe>-<key>         an SFT run: checkpoints, logs, the adapter
        adapters/<sft digest[:16]>  convert-lora: the adapter a server loads
        registry/<recipe>/          adapter versions and the production pointer (ktflow.registry)
        eval/<recipe>/v<N>/         a candidate's evaluation; eval/<recipe>/endpoint/: ``ktflow eval``
        serving/<recipe>/           the production endpoint's record, log and key

    Paths keep the root as given (relative roots stay relative, as the CLI prints them).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def weights(self, name: str) -> Path:
        return self.root / "weights" / name

    def bf16(self, key: str) -> Path:
        return self.root / "bf16" / key

    def int8(self, name: str) -> Path:
        return self.root / "int8" / name

    def merged(self, name: str) -> Path:
        """A merge (:func:`ktflow.stages.merge.merged_dir_name`: base + adapter + method digests)."""
        return self.root / "merged" / name

    def dataset(self, name: str) -> Path:
        return self.root / "datasets" / name

    def run(self, name: str) -> Path:
        return self.root / "runs" / name

    def adapter(self, name: str) -> Path:
        return self.root / "adapters" / name

    def registry(self, recipe: str) -> Path:
        return self.root / "registry" / recipe

    def evaluation(self, recipe: str, version: int | None = None) -> Path:
        """A candidate version's evaluation, or (None) ``ktflow eval``'s of a running endpoint."""
        return self.root / "eval" / recipe / (f"v{version}" if version is not None else "endpoint")

    def serving(self, recipe: str) -> Path:
        return self.root / "serving" / recipe


class HostStore:
    """A store root as the recipe declares it, and where that store is on this host.

    Each host keeps its own store (issue #29): a worker started with ``--store-root`` (or a relative
    ``store.root``, read from each host's checkout) has it elsewhere than the path the recipe names.
    Stage flows map the paths the pipeline hands them onto this host (:meth:`to_host`) and the paths
    in their results back (:meth:`to_declared`), so no host's absolute path reaches another host's work.
    """

    def __init__(self, declared: Path | None, here: Path | None = None) -> None:
        """``declared`` None: no root is known, and paths are used as given."""
        self.declared = Path(declared) if declared is not None else None
        self.here = Path(here) if here is not None else self.declared

    def to_host(self, path: str | Path) -> Path:
        """``path`` (under the declared root, or anything else unchanged) on this host."""
        rel = self._relative(Path(path), self.declared)
        return Path(path) if rel is None or self.here is None else self.here / rel

    def to_declared(self, value: Any) -> Any:
        """``value`` (a path, string, pydantic model or container of them) with paths under this host's
        root written under the declared root instead; everything else is returned as it is."""
        if self.declared is None:
            return value
        if isinstance(value, BaseModel):
            return value.model_copy(update={name: self.to_declared(getattr(value, name))
                                            for name in type(value).model_fields})
        if isinstance(value, Path):
            rel = self._relative(value, self.here)
            return value if rel is None else self.declared / rel
        if isinstance(value, str) and "/" in value and "://" not in value:
            rel = self._relative(Path(value), self.here)
            return value if rel is None else str(self.declared / rel)
        if isinstance(value, list | tuple):
            return type(value)(self.to_declared(v) for v in value)
        if isinstance(value, dict):
            return {k: self.to_declared(v) for k, v in value.items()}
        return value

    def key(self, path: str | Path) -> str:
        """``path``'s place in the store (``runs/<run>/adapter``): the same on every host."""
        rel = self._relative(Path(path), self.declared) or self._relative(Path(path), self.here)
        if rel is None:
            raise ValueError(f"{path} is not in the store {self.declared}")
        return rel.as_posix()

    @staticmethod
    def _relative(path: Path, root: Path | None) -> Path | None:
        if root is None:
            return None
        for candidate in (root, root.absolute()):
            try:
                return path.relative_to(candidate)
            except ValueError:
                continue
        return None


class FileEntry(BaseModel):
    """One file of an artifact, relative to its directory."""

    path: str
    size: int
    sha256: str | None = None


class StageManifest(BaseModel):
    """What a published artifact is and what it was made from."""

    stage: str
    engine_version: str = ENGINE_VERSION
    ktflow_version: str = __version__
    inputs: dict[str, str] = Field(default_factory=dict, description="input name -> identity/digest")
    settings: dict[str, Any] = Field(default_factory=dict)
    tools: dict[str, str] = Field(default_factory=dict, description="tool -> version")
    files: list[FileEntry] = Field(default_factory=list)
    extra: dict[str, Any] = Field(default_factory=dict, description="stage-specific results")
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat())

    def digest(self) -> str:
        """sha256 of everything but the creation time: equal digests mean equal artifacts."""
        payload = self.model_dump(mode="json", exclude={"created_at"})
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def staging_dir_for(final_dir: Path) -> Path:
    """The staging directory a stage writes ``final_dir`` in (beside it, same filesystem)."""
    final_dir = Path(final_dir)
    return final_dir.parent / f".{final_dir.name}{STAGING_SUFFIX}"


def read_manifest(directory: Path) -> StageManifest | None:
    """The manifest of a published artifact, or None if the directory holds none."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    return StageManifest.model_validate_json(path.read_text(encoding="utf-8"))


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    """sha256 of the file at ``path``, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def list_files(directory: Path) -> list[FileEntry]:
    """Every regular file below ``directory`` (sizes only; manifest excluded), sorted."""
    directory = Path(directory)
    entries = []
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != MANIFEST_NAME:
            entries.append(FileEntry(path=path.relative_to(directory).as_posix(), size=path.stat().st_size))
    return entries


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write a small file so that readers see the old content or the new, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def atomic_write_json(path: Path, document: Any, *, fsync: bool = True) -> None:
    atomic_write_bytes(Path(path), (json.dumps(document, indent=2) + "\n").encode(), fsync=fsync)


def publish_dir(staging: Path, final_dir: Path, manifest: StageManifest, *, fsync: bool = True) -> StageManifest:
    """Write the manifest into ``staging`` (last) and rename it to ``final_dir``.

    ``manifest.files`` is filled from what ``staging`` holds when it is empty. An existing
    ``final_dir`` is replaced only if it is an artifact of ours (holds a manifest); anything
    else there is an error rather than silently deleted.
    """
    staging, final_dir = Path(staging), Path(final_dir)
    if not manifest.files:
        manifest = manifest.model_copy(update={"files": list_files(staging)})
    atomic_write_bytes(staging / MANIFEST_NAME, manifest.model_dump_json(indent=2).encode(), fsync=fsync)
    rename_into_place(staging, final_dir, fsync=fsync)
    return manifest


def rename_into_place(staging: Path, final_dir: Path, *, fsync: bool = True) -> None:
    """Rename the complete ``staging`` to ``final_dir``, replacing an artifact of ours there.

    Anything else under the final name is an error rather than silently deleted.
    """
    if final_dir.exists():
        if read_manifest(final_dir) is None:
            raise FileExistsError(f"{final_dir} exists and is not a ktflow artifact; refusing to replace it")
        # Move the old artifact aside first so the final name is never absent or mixed.
        retired = final_dir.parent / f".{final_dir.name}.retired"
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final_dir, retired)
        os.replace(staging, final_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final_dir)
    if fsync:
        fsync_dir(final_dir.parent)


# --------------------------------------------------------------------------- faults: space, permissions, locks




def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a new directory would be created)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files below ``path`` (links not followed); 0 where it does not exist."""
    path = Path(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) if path.exists() else 0


def free_bytes(path: Path) -> int:
    """Free bytes (for this user) on the filesystem that holds, or would hold, ``path``."""
    return shutil.disk_usage(existing_ancestor(path)).free


def space_margin(need: int, files: int = 1) -> int:
    """``need`` plus what a filesystem adds: a block per file, a percent for metadata."""
    return int(need * 1.01) + 4096 * (files + 4)


_FREE_SPACE_FIX = ("free space there, or write the artifact to a larger filesystem, then rerun "
                   "(finished parts in the staging directory are reused).")


def free_space_shortfall(at: Path, need: int, *, what: str, files: int = 1, overhead: float | None = None,
                         subject: str | None = None, fix: str | None = None) -> InsufficientDiskError | None:
    """The error to raise when the filesystem holding ``at`` cannot take ``need`` more bytes, else None.

    Args:
        at: a directory on the filesystem (or one to be created there).
        need: the bytes still to write; ``files``: how many files they make.
        what: the subject of the sentence, e.g. ``"the BF16 output"``.
        overhead: None adds :func:`space_margin`; a number asks for exactly ``need * overhead``.
        subject, fix: of the error (default: ``at``, and "free space there ...").
    """
    want = space_margin(need, files) if overhead is None else math.ceil(need * overhead)
    free = free_bytes(at)
    if want <= free:
        return None
    return InsufficientDiskError(
        subject or str(at),
        f"{what} needs ~{human_bytes(want)} ({want} bytes) more on this filesystem; "
        f"{existing_ancestor(at)} has {human_bytes(free)} ({free} bytes) free",
        fix or _FREE_SPACE_FIX, need=want, free=free,
    )


def check_free_space(final_dir: Path, need: int, *, what: str, files: int = 1) -> None:
    """Preflight: refuse to start writing ``need`` bytes (``files`` files) for ``final_dir`` when
    its filesystem has less free (with :func:`space_margin`), before anything is written.

    Raises:
        InsufficientDiskError: naming the directory, the bytes needed and the bytes free (exit 2).
    """
    final_dir = Path(final_dir)
    shortfall = free_space_shortfall(final_dir.parent, need, what=what, files=files, subject=str(final_dir))
    if shortfall is not None:
        raise shortfall


@contextmanager
def storage_errors(final_dir: Path, *, need: int | None = None) -> Iterator[None]:
    """Turn a full, read-only or unwritable filesystem met while writing ``final_dir`` into a
    :class:`StorageError` naming the path, the free space and ``need`` (the artifact's size)."""
    final_dir = Path(final_dir)
    try:
        yield
    except OSError as exc:
        if isinstance(exc, StorageError) or exc.errno not in _NO_SPACE | _NOT_WRITABLE:
            raise  # an inner storage_errors already named it (StorageError is an OSError too)
        target = getattr(exc, "filename2", None) or exc.filename  # a copy names its source first
        staging = staging_dir_for(final_dir)
        where = Path(target) if target else staging
        kept = f"finished parts stay in {staging} and are reused. " if staging.is_dir() else ""
        if exc.errno in _NO_SPACE:
            try:
                free = f"{human_bytes(free_bytes(final_dir.parent))} free now at {existing_ancestor(final_dir.parent)}"
            except OSError:
                free = "free space unknown"
            needed = f"; the artifact needs ~{human_bytes(need)} in all" if need else ""
            message = (f"no space left on the device while writing {where} for {final_dir} "
                       f"({os.strerror(exc.errno)}; {free}{needed}). Nothing was published; {kept}"
                       "Free space, or write to a larger filesystem, and rerun.")
        else:
            message = (f"cannot write {where} for {final_dir}: {os.strerror(exc.errno or 0)}. Nothing was published. "
                       "Make the directory writable (or choose a writable one) and rerun.")
        raise StorageError(message, path=where, errno_=exc.errno) from exc


def lock_path_for(final_dir: Path) -> Path:
    """The lock file that serializes writers of ``final_dir`` (beside its staging directory)."""
    final_dir = Path(final_dir)
    return final_dir.parent / f".{final_dir.name}{LOCK_SUFFIX}"


def _lock_owner(fd: int) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {owner['pid']} on {owner['host']} (since {owner['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextmanager
def artifact_lock(
    final_dir: Path, *, wait: bool = True, on_wait: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold the exclusive right to write ``final_dir`` (and its staging directory) while inside.

    The lock is ``fcntl.flock`` on ``.<name>.lock`` beside ``final_dir``: released by the kernel
    when its holder dies (kill -9 included), so a crash never leaves a stale lock. The holder's
    pid, host and start time are written into the file, so a waiter can say whom it waits for
    (``on_wait``, default: a warning on this module's logger). The holder removes the file when it
    leaves; a waiter that then finds a different (or no) file at the path locks again.

    Use it around check-published / stage / publish, and check for a published artifact again
    inside it: the process that waited finds its work done by the other one. flock is local to a
    host on most network filesystems; writers on different hosts need distinct stores.

    Raises:
        ArtifactBusyError: ``wait=False`` and another process holds the lock.
        HostRequirementError: the lock file cannot be created (read-only or unwritable directory),
            unless ``final_dir`` is already published: then nothing will be written, and the
            caller goes on unlocked to read it.
    """
    final_dir = Path(final_dir)
    path = lock_path_for(final_dir)
    created: list[Path] = []  # directories made for the lock file, removed with it if still empty
    while True:
        fd = _open_lock_file(path, final_dir, created)
        if fd is None:  # it cannot be created, but the artifact is published: readers need no lock
            yield
            return
        if _lock(fd, path, final_dir, wait=wait, say=on_wait or log.warning):
            break
    try:
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(owner).encode(), 0)
        except OSError:  # a full disk: the lock holds without its note
            pass
        yield
    finally:
        _unlock(fd, path, created)


def _open_lock_file(path: Path, final_dir: Path, created: list[Path]) -> int | None:
    """The lock file, opened (created, with the directories it needs, which go into ``created``);
    None when it cannot be created but ``final_dir`` is published (nothing will be written)."""
    while True:
        try:
            missing = [d for d in [path.parent, *path.parent.parents] if not d.exists()]
            path.parent.mkdir(parents=True, exist_ok=True)
            created += [d for d in missing if d not in created]
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # another holder removed the directory it had made: make it again
            continue
        except OSError as exc:
            if exc.errno not in _NO_SPACE | _NOT_WRITABLE:
                raise
            if read_manifest(final_dir) is not None:
                return None
            raise HostRequirementError(
                str(final_dir.parent),
                f"cannot create {path.name} there to write {final_dir.name}: {os.strerror(exc.errno or 0)}",
                "make the directory writable (a read-only mount or another user's directory cannot hold the "
                "artifact), or choose another output directory / store.root.",
            ) from exc


def _lock(fd: int, path: Path, final_dir: Path, *, wait: bool, say: Callable[[str], None]) -> bool:
    """Lock ``fd`` (waiting for the holder, unless not ``wait``). False, with ``fd`` closed, when the
    file at ``path`` was replaced meanwhile (the previous holder removed it): lock the current one."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_owner(fd)
            for _ in range(20):  # the holder writes its note just after locking: give it a moment
                if "pid " in owner:
                    break
                time.sleep(0.05)
                owner = _lock_owner(fd)
            if not wait:
                raise ArtifactBusyError(
                    f"{final_dir} is being written by {owner} (lock {path}); wait for it to finish, or rerun "
                    "without fail-fast to wait") from None
            say(f"waiting for {final_dir}: it is being written by {owner} (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
    except BaseException:
        os.close(fd)
        raise
    if not same:
        os.close(fd)
    return same


def _unlock(fd: int, path: Path, created: list[Path]) -> None:
    try:
        path.unlink()  # while still holding it: a waiter re-checks the inode and locks afresh
    except OSError:
        pass
    os.close(fd)
    for directory in created:  # deepest first: the lock leaves no trace of its own
        try:
            directory.rmdir()
        except OSError:
            pass
