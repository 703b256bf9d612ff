"""Streaming safetensors I/O: validated headers, single-tensor reads, parallel shard writes.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian u64 ``N``, ``N``
bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, then the byte buffer. Offsets are relative to the buffer, and the
tensors must cover it exactly.

Memory is bounded by one tensor: :func:`read_header` reads only the header, :func:`read_tensor`
reads one tensor's bytes straight into its own storage, and :class:`SafetensorsWriter` writes the
header first and then each tensor at its precomputed offset, from any number of threads.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ktflow.errors import CheckpointError

if sys.byteorder != "little":  # raw bytes are copied as-is; safetensors is little-endian
    raise ImportError("ktflow.formats.safetensors_io supports little-endian hosts only")

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_REFETCH = "re-download or re-run the stage"

# safetensors' dtype names, in its Rust enum order. Sub-byte F4/F6 are left out: their shapes
# count 4/6-bit elements, which no torch dtype maps one to one.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8, "I64": 8, "U64": 8,
}


@functools.cache
def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_dtypes() -> dict[str, torch.dtype]:
    # torch is imported on first use: reading headers (inspect, cache checks, the SFT stage's
    # preflight) must not pay torch's ~1 s import.
    import torch

    return {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
        "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
        "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32, "C64": torch.complex64,
        "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
    }

Plan = Sequence[tuple[str, str, tuple[int, ...]]]
_Entry = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, begin, end


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
    try:
        return _torch_dtypes()[st_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown safetensors dtype {st_dtype!r}; known: {list(DTYPE_SIZES)}") from None


def st_dtype(torch_dtype: torch.dtype) -> str:
    """The safetensors dtype name of a torch dtype (``torch.float8_e4m3fn`` -> ``"F8_E4M3"``)."""
    try:
        return {dt: name for name, dt in _torch_dtypes().items()}[torch_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"torch dtype {torch_dtype!r} has no safetensors equivalent") from None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file; ``start`` and ``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: ``tensors`` is in offset order and covers ``[data_start, file_size)``."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON object hook: refuse duplicate keys (which entry is real?) and lone surrogates."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        key.encode("utf-8")  # "\ud800" parses in Python but is not UTF-8 (safetensors refuses it)
        if isinstance(value, str):
            value.encode("utf-8")
        obj[key] = value
    return obj


def _reject_constant(token: str) -> None:
    raise ValueError(f"{token} is not JSON")


def _is_uint(x: object) -> bool:
    return type(x) is int and 0 <= x < 2**64  # type(), not isinstance: true is not a dimension


def _parse_entry(file: str, name: str, entry: object, data_start: int) -> TensorInfo:
    where = f"{file}: tensor '{name}'"
    if not isinstance(entry, dict):
        raise CheckpointError(where, f"header entry {entry!r:.80} is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CheckpointError(where, f"unknown dtype {dtype!r:.80}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise CheckpointError(where, f"shape {shape!r:.80} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets))):
        raise CheckpointError(where, f"data_offsets {offsets!r:.80} is not two non-negative integers")
    begin, end = offsets
    nbytes = DTYPE_SIZES[dtype]
    for d in shape:  # capped: a lying header may hold a million huge dimensions
        nbytes = min(nbytes * d, 2**64)
    if end - begin != nbytes:
        raise CheckpointError(
            where, f"data_offsets [{begin}, {end}] hold {end - begin} bytes, {dtype} {shape} needs {nbytes}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file, without reading its tensors.

    Raises:
        CheckpointError: the file is short or truncated, or its header is malformed or lies about
            the layout (sizes, overlaps, holes, bytes past the last tensor).
    """
    path = Path(path)
    file = str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(file, f"file has {size} bytes, too few for a safetensors header", _REFETCH)
        n = int.from_bytes(prefix, "little")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(file, f"header length {n} is absurd (limit {MAX_HEADER_BYTES})", _REFETCH)
        if 8 + n > size:
            raise CheckpointError(file, f"truncated: header length {n} runs past the end of the file "
                                        f"({size} bytes)", _REFETCH)
        raw = f.read(n)
    if len(raw) != n:
        raise CheckpointError(file, "truncated: the file shrank while being read", _REFETCH)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_json_object, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(file, f"header is not UTF-8 JSON: {e}", _REFETCH) from None
    if not isinstance(doc, dict):
        raise CheckpointError(file, f"header is a JSON {type(doc).__name__}, not an object")
    metadata = doc.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # safetensors accepts null
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(file, f"__metadata__ {metadata!r:.80} is not an object of strings")

    data_start = 8 + n
    infos = [_parse_entry(file, name, entry, data_start) for name, entry in doc.items()]
    infos.sort(key=lambda t: (t.start, t.end))
    covered: int = data_start
    previous: TensorInfo | None = None
    for info in infos:
        if info.start != covered:
            problem = (
                f"overlap tensor '{previous.name}'" if previous is not None and info.start < covered
                else f"leave a hole of {info.start - covered} bytes before it"
            )
            raise CheckpointError(
                f"{file}: tensor '{info.name}'",
                f"data_offsets [{info.start - data_start}, {info.end - data_start}] {problem}; "
                "safetensors requires the tensors to cover the data buffer contiguously",
            )
        covered, previous = info.end, info
    if covered > size:
        cut = next(t for t in infos if t.end > size)
        raise CheckpointError(
            f"{file}: tensor '{cut.name}'", f"truncated: expected {covered} bytes, file has {size}", _REFETCH
        )
    if covered < size:
        raise CheckpointError(file, f"expected {covered} bytes, file has {size} "
                                    f"({size - covered} after the last tensor)", _REFETCH)
    return SafetensorsHeader(path, {t.name: t for t in infos}, metadata, data_start, size)


def holds_planned_tensors(path: str | os.PathLike[str], planned: Sequence[tuple[str, str, tuple[int, ...]]]) -> bool:
    """Whether the safetensors file at ``path`` exists and its header lists exactly ``planned`` ``(name, dtype,
    shape)``, in order: a shard a stage renamed into place when complete, checked anyway before it is reused."""
    if not Path(path).exists():
        return False
    try:
        header = read_header(path)
    except CheckpointError:
        return False
    return [(t.name, t.dtype, tuple(t.shape)) for t in header.tensors.values()] == [
        (name, dtype, tuple(shape)) for name, dtype, shape in planned]


def read_tensor(
    path_or_header: str | os.PathLike[str] | SafetensorsHeader,
    name: str,
    *,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Read one tensor with positioned reads straight into its own (writable) storage."""
    header = path_or_header if isinstance(path_or_header, SafetensorsHeader) else read_header(path_or_header)
    where = f"{header.path}: tensor '{name}'"
    info = header.tensors.get(name)
    if info is None:
        raise CheckpointError(where, f"no such tensor in this file ({len(header.tensors)} tensors)",
                              "check the name against model.safetensors.index.json")
    import torch

    raw = torch.empty(info.nbytes, dtype=torch.uint8)
    view = memoryview(raw.numpy())
    with open(header.path, "rb", buffering=0) as f:
        f.seek(info.start)
        done = 0
        while done < info.nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(where, f"truncated: expected {header.file_size} bytes, file ends "
                                             f"at {info.start + done}", _REFETCH)
            done += got
    if info.dtype == "BOOL" and bool((raw > 1).any()):
        raise CheckpointError(where, "BOOL tensor holds bytes other than 0 and 1", _REFETCH)
    tensor = raw.view(_torch_dtypes()[info.dtype]).reshape(info.shape)
    return tensor if torch.device(device).type == "cpu" else tensor.to(device)


def _layout(plan: Plan, metadata: Mapping[str, str] | None) -> tuple[bytes, list[_Entry]]:
    """The 8+N header bytes and one ``(name, dtype, shape, begin, end)`` per tensor, in plan order."""
    doc: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"metadata must map str to str, got {dict(metadata)!r:.200}")
        doc["__metadata__"] = dict(metadata)
    entries: list[_Entry] = []
    offset = 0
    for name, dtype, shape in plan:
        if not isinstance(name, str) or name == "__metadata__" or name in doc:
            raise ValueError(f"plan: tensor name {name!r} is not a str, is reserved or is repeated")
        shape = tuple(shape)
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES or not all(map(_is_uint, shape)):
            raise ValueError(f"plan: tensor {name!r} has a bad dtype {dtype!r} or shape {shape!r}")
        end = offset + DTYPE_SIZES[dtype] * math.prod(shape)
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        entries.append((name, dtype, shape, offset, end))
        offset = end
    # Compact JSON with raw UTF-8 escapes exactly like serde_json, which safetensors uses.
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # safetensors' padding: the data buffer starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, entries


def header_bytes(plan: Plan, metadata: Mapping[str, str] | None) -> bytes:
    """The exact ``8 + N`` header for ``plan``, tensors laid out in plan order.

    Byte-identical to ``safetensors.torch.save``'s header when ``plan`` is in safetensors' own order
    (dtype enum rank descending, then name) and ``metadata`` has at most one key: safetensors keeps
    metadata in a hash map, so its key order varies from call to call. ``None`` omits
    ``__metadata__``; ``{}`` writes an empty one, as safetensors does.
    """
    return _layout(plan, metadata)[0]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked (Linux caps one call just under 2 GiB)
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class SafetensorsWriter:
    """Write a safetensors file whose layout is fixed up front by ``plan``.

    The header is written on construction and the file sized to :attr:`total_bytes`; each
    :meth:`write` then ``pwrite``-s one tensor at its own offset, so any number of threads can fill
    one file in any order, holding one tensor each. As a context manager, an exception closes the
    descriptor without the completeness check (the caller deletes the partial file).
    """

    def __init__(
        self, path: str | os.PathLike[str], plan: Plan, metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        header, entries = _layout(plan, metadata)
        self._slots = {name: (dtype, shape, len(header) + begin, end - begin)
                       for name, dtype, shape, begin, end in entries}
        self._total = len(header) + (entries[-1][4] if entries else 0)
        self._written: set[str] = set()
        self._busy = 0
        self._cond = threading.Condition()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _pwrite_all(fd, memoryview(header), 0)
            os.ftruncate(fd, self._total)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    @property
    def total_bytes(self) -> int:
        """Size of the finished file in bytes."""
        return self._total

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the planned tensor ``name``, which must have the planned dtype and shape.

        Raises:
            ValueError: unplanned name, wrong dtype or shape, second write of a name, writer closed.
        """
        dtype, shape, _, _ = self._slot(name)
        if tensor.dtype != _torch_dtypes()[dtype] or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: tensor {name!r} is planned as {dtype} {list(shape)}, "
                             f"got {tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
        self.write_pieces(name, [memoryview(data.reshape(-1).view(_torch_dtypes()["U8"]).numpy())])

    def write_pieces(self, name: str, pieces: Iterable[memoryview]) -> None:
        """Write tensor ``name`` as consecutive byte pieces that together are exactly its planned bytes.

        A converter can then hand over a tensor a few rows at a time, each piece while it is still
        in the CPU cache, without ever holding the whole tensor. ``pieces`` may reuse one buffer:
        each is written before the next is asked for.

        Raises:
            ValueError: unplanned name, more or fewer bytes than planned, second write, writer closed.
        """
        _, _, offset, nbytes = self._slot(name)
        with self._cond:
            if self._fd is None:
                raise ValueError(f"{self.path}: writer is closed")
            if name in self._written:
                raise ValueError(f"{self.path}: tensor {name!r} written twice")
            self._written.add(name)
            self._busy += 1
            fd = self._fd
        try:
            end = offset + nbytes
            for piece in pieces:
                if offset + len(piece) > end:
                    raise ValueError(f"{self.path}: tensor {name!r} got more than its {nbytes} bytes")
                _pwrite_all(fd, piece, offset)
                offset += len(piece)
            if offset != end:
                raise ValueError(f"{self.path}: tensor {name!r} got {nbytes - (end - offset)} of its {nbytes} bytes")
        except BaseException:
            with self._cond:
                self._written.discard(name)
            raise
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def _slot(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        slot = self._slots.get(name)
        if slot is None:
            raise ValueError(f"{self.path}: tensor {name!r} is not in the plan")
        return slot

    def start_writeback(self, name: str) -> None:
        """Start writing tensor ``name``'s dirty pages to disk (asynchronously) and drop them once clean."""
        _, _, offset, nbytes = self._slots[name]
        with self._cond:
            fd = self._fd
            if fd is None:
                return
            self._busy += 1
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def close(self, *, fsync: bool = False) -> None:
        """Finish the file: fsync if asked, close, then raise ValueError if a tensor is missing.

        The descriptor is closed even when tensors are missing; a second close does nothing.
        """
        missing = self._release(fsync=fsync)
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} planned tensors never written: {missing[:5]}")

    def _release(self, *, fsync: bool) -> list[str]:
        with self._cond:
            fd, self._fd = self._fd, None
            if fd is None:
                return []
            self._cond.wait_for(lambda: self._busy == 0)  # the fd number could be reused under them
            missing = [name for name in self._slots if name not in self._written]
        try:
            if fsync and not missing:
                os.fsync(fd)
        finally:
            os.close(fd)
        return missing

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._release(fsync=False)
