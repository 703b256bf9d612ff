"""ktflow.formats.safetensors_io against the reference implementation (the safetensors package)."""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import deserialize, safe_open
from safetensors.torch import load_file, save, save_file

import ktflow.formats.safetensors_io as sio
from ktflow.errors import CheckpointError
from ktflow.formats.safetensors_io import (
    DTYPE_SIZES,
    SafetensorsHeader,
    SafetensorsWriter,
    TensorInfo,
    header_bytes,
    read_header,
    read_tensor,
    st_dtype,
    torch_dtype,
)

# safetensors' on-disk order: dtype rank descending (observed from save(), see the byte-equality
# tests, which fail if this is wrong), then name.
ST_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
            "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor: torch.equal is not implemented for float8, and NaN != NaN."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Every byte random (NaNs, subnormals included), except bool, which must stay 0/1."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    n = dtype.itemsize * max(1, torch.Size(shape).numel())
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape)


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t.{name.lower()}": random_tensor(torch_dtype(name), (3, 5), gen) for name in DTYPE_SIZES}
    tensors["scalar.bf16"] = random_tensor(torch.bfloat16, (), gen)
    tensors["scalar.i64"] = torch.tensor(-7, dtype=torch.int64)
    tensors["empty.f32"] = torch.empty(4, 0, 2)
    tensors["empty.i8"] = torch.empty(0, dtype=torch.int8)
    tensors["model.layers.0.mlp.experts.1.down_proj.weight_packed"] = random_tensor(torch.int32, (16, 4), gen)
    return tensors


def st_sorted_plan(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    plan = [(name, st_dtype(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    return sorted(plan, key=lambda p: (ST_ORDER.index(p[1]), p[0]))


def write_all(path: Path, plan, tensors, metadata=None, order=None) -> SafetensorsWriter:
    with SafetensorsWriter(path, plan, metadata) as writer:
        for name in order or [p[0] for p in plan]:
            writer.write(name, tensors[name])
    return writer


# --- dtype tables ----------------------------------------------------------------------------


def test_dtype_tables() -> None:
    for name in ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64",
                 "U64", "F8_E4M3", "F8_E5M2"]:
        assert DTYPE_SIZES[name] == torch_dtype(name).itemsize
        assert st_dtype(torch_dtype(name)) == name
    assert torch_dtype("F8_E4M3") is torch.float8_e4m3fn and torch_dtype("BF16") is torch.bfloat16
    assert sorted(DTYPE_SIZES) == sorted(ST_ORDER)
    with pytest.raises(ValueError):
        torch_dtype("F4")
    with pytest.raises(ValueError):
        st_dtype(torch.qint8)


# --- reading files written by safetensors ----------------------------------------------------


def test_reads_what_safetensors_writes(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "ref.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    ref_header = json.loads(raw[8 : 8 + n])

    header = read_header(path)
    assert header.path == path and header.file_size == len(raw) and header.data_start == 8 + n
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    starts = [info.start for info in header.tensors.values()]
    assert starts == sorted(starts)  # offset order
    with safe_open(path, framework="pt") as ref:
        for name, info in header.tensors.items():
            assert isinstance(info, TensorInfo) and info.name == name
            assert info.dtype == ref.get_slice(name).get_dtype()
            assert list(info.shape) == ref.get_slice(name).get_shape()
            begin, end = ref_header[name]["data_offsets"]
            assert (info.start, info.end, info.nbytes) == (8 + n + begin, 8 + n + end, end - begin)
            got = read_tensor(header, name)
            assert_identical(got, ref.get_tensor(name))
            assert_identical(got, tensors[name])
    # Owns writable memory: mutating one read leaves the next read untouched.
    a = read_tensor(path, "t.f32")
    a.zero_()
    assert_identical(read_tensor(path, "t.f32"), tensors["t.f32"])


# --- writing ----------------------------------------------------------------------------------


def test_writer_is_byte_identical_to_save_in_safetensors_order(tmp_path: Path) -> None:
    tensors = sample_tensors()
    tensors["naïve \"quoted\"\n\x1f/名前 🙂"] = torch.ones(2, dtype=torch.float16)
    plan = st_sorted_plan(tensors)
    for metadata in [None, {}, {"format": "pt"}, {"ключ": "值 \"x\"\t"}]:
        path = tmp_path / "ours.safetensors"
        order = [p[0] for p in plan][::-1]  # reverse order on purpose
        writer = write_all(path, plan, tensors, metadata, order)
        expected = save(tensors, metadata=metadata)
        assert path.read_bytes() == expected
        assert writer.total_bytes == len(expected)
        assert header_bytes(plan, metadata) == expected[: read_header(path).data_start]


def test_writer_in_other_orders_loads_identically_but_bytes_differ(tmp_path: Path) -> None:
    tensors = sample_tensors()
    del tensors["t.f8_e8m0"]  # load_file (not safe_open) lacks F8_E8M0 in safetensors 0.8
    plan = st_sorted_plan(tensors)[::-1]  # valid, but not safetensors' own layout
    path = tmp_path / "rev.safetensors"
    order = [p[0] for p in plan]
    random.Random(1).shuffle(order)
    write_all(path, plan, tensors, {"format": "pt"}, order)
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert_identical(loaded[name], t)
    assert path.read_bytes() != save(tensors, metadata={"format": "pt"})
    assert [info.name for info in read_header(path).tensors.values()] == [p[0] for p in plan]


def test_writer_from_four_threads(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.float32, torch.bool]
    tensors = {f"layer.{i}.w": random_tensor(dtypes[i % 5], (i % 7, 33 + i), gen) for i in range(64)}
    plan = st_sorted_plan(tensors)
    path = tmp_path / "threads.safetensors"
    names = list(tensors)
    random.Random(2).shuffle(names)
    with SafetensorsWriter(path, plan, {"format": "pt"}) as writer:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda name: writer.write(name, tensors[name]), names))
    assert path.read_bytes() == save(tensors, metadata={"format": "pt"})
    loaded = load_file(path)
    for name, t in tensors.items():
        assert_identical(loaded[name], t)
        assert_identical(read_tensor(path, name), t)


def test_writer_accepts_views_and_autograd_tensors(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        "transposed": base.t(),
        "grad": torch.ones(3, requires_grad=True),
        "conj": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        "scalar": torch.tensor(True),
    }
    plan = [(n, st_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "views.safetensors"
    write_all(path, plan, tensors)
    with safe_open(path, framework="pt") as ref:
        for name, t in tensors.items():
            assert_identical(ref.get_tensor(name), t.detach().resolve_conj())


def test_metadata_round_trip(tmp_path: Path) -> None:
    metadata = {"format": "pt", "ktflow.stage": "dequant", "ünïcode": "✓ \"quoted\"\n", "empty": ""}
    tensors = {"w": torch.zeros(2, dtype=torch.bfloat16)}
    path = tmp_path / "meta.safetensors"
    write_all(path, st_sorted_plan(tensors), tensors, metadata)
    assert read_header(path).metadata == metadata
    with safe_open(path, framework="pt") as ref:
        assert ref.metadata() == metadata
    write_all(path, st_sorted_plan(tensors), tensors, None)
    assert read_header(path).metadata == {}


def test_writer_refusals(tmp_path: Path) -> None:
    plan = [("a", "BF16", (2, 3)), ("b", "I32", ())]
    path = tmp_path / "w.safetensors"
    writer = SafetensorsWriter(path, plan)
    assert os.path.getsize(path) == writer.total_bytes  # sized up front
    with pytest.raises(ValueError, match="planned as BF16"):
        writer.write("a", torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="planned as BF16"):
        writer.write("a", torch.zeros(3, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not in the plan"):
        writer.write("c", torch.zeros(1))
    writer.write("a", torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="twice"):
        writer.write("a", torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'b'"):
        writer.close(fsync=True)
    with pytest.raises(ValueError, match="closed"):
        writer.write("b", torch.tensor(1, dtype=torch.int32))
    writer.close()  # second close: no-op

    for bad_plan in ([("x", "F32", (1,)), ("x", "F32", (1,))], [("x", "F4", (2,))],
                     [("x", "F32", (-1,))], [("__metadata__", "F32", (1,))]):
        with pytest.raises(ValueError):
            SafetensorsWriter(tmp_path / "bad.safetensors", bad_plan)
    with pytest.raises(ValueError):
        header_bytes(plan, {"k": 1})  # type: ignore[dict-item]


def test_writer_context_manager_on_error_skips_completeness_check(tmp_path: Path) -> None:
    path = tmp_path / "partial.safetensors"
    with pytest.raises(RuntimeError, match="boom"):  # not the missing-tensor ValueError
        with SafetensorsWriter(path, [("a", "F32", (4,)), ("b", "F32", (4,))]) as writer:
            writer.write("a", torch.ones(4))
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="closed"):
        writer.write("b", torch.ones(4))
    with pytest.raises(ValueError, match="never written"):
        with SafetensorsWriter(path, [("a", "F32", (4,)), ("b", "F32", (4,))]) as writer:
            writer.write("a", torch.ones(4))


def test_close_waits_for_in_flight_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing under a running pwrite would let the fd number be reused by another file."""
    path = tmp_path / "race.safetensors"
    writer = SafetensorsWriter(path, [("a", "F32", (4,))])
    entered, release = threading.Event(), threading.Event()
    real = sio._pwrite_all

    def slow(fd: int, data: memoryview, offset: int) -> None:
        entered.set()
        release.wait(10)
        real(fd, data, offset)

    monkeypatch.setattr(sio, "_pwrite_all", slow)
    write = threading.Thread(target=writer.write, args=("a", torch.ones(4)))
    write.start()
    assert entered.wait(10)
    close = threading.Thread(target=writer.close)
    close.start()
    close.join(0.3)
    assert close.is_alive()  # still waiting for the write
    release.set()
    write.join(10)
    close.join(10)
    assert not close.is_alive()
    assert_identical(load_file(path)["a"], torch.ones(4))


def test_memory_stays_at_one_tensor(tmp_path: Path) -> None:
    """No whole-file or extra per-tensor copy: numpy/bytes buffers would show up in tracemalloc."""
    big = torch.randint(0, 2**31 - 1, (16 * 2**20,), dtype=torch.int32)  # 64 MiB
    small = torch.ones(8)
    path = tmp_path / "big.safetensors"
    plan = [("big", "I32", tuple(big.shape)), ("small", "F32", (8,))]
    tracemalloc.start()
    try:
        with SafetensorsWriter(path, plan) as writer:
            writer.write("big", big)
            writer.write("small", small)
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        header = read_header(path)
        _, header_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = read_tensor(header, "big")
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert os.path.getsize(path) > 64 * 2**20
    assert write_peak < 2**20 and header_peak < 2**20 and read_peak < 2**20
    assert torch.equal(got, big)
    assert_identical(load_file(path)["small"], small)


# --- malformed files --------------------------------------------------------------------------

GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I8", "shape": [4], "data_offsets": [8, 12]}}


def blob(header: object, data: bytes = bytes(12), raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def patched(name: str, **fields: object) -> dict:
    header = json.loads(json.dumps(GOOD))
    header[name].update(fields)
    return header


MALFORMED = {
    # id: (file bytes, tensor the error must name or None, word the reason must contain)
    "short_file": (b"\x08\x00\x00", None, "too few"),
    "header_len_beyond_file": (struct.pack("<Q", 500) + b"{}", None, "truncated"),
    "header_len_absurd": (struct.pack("<Q", 2**63) + b"{}", None, "absurd"),
    "truncated_data": (blob(GOOD, bytes(10)), "b", "truncated: expected"),
    "not_json": (blob(None, raw_header=b"{'a': 1}"), None, "JSON"),
    "not_utf8": (blob(None, raw_header=b'{"\xff": 1}'), None, "UTF-8"),
    "lone_surrogate": (blob(None, raw_header=b'{"\\ud800": 1}'), None, "JSON"),
    "nan": (blob(None, raw_header=b'{"__metadata__": {"x": NaN}}', data=b""), None, "JSON"),
    "json_array": (blob([1, 2]), None, "not an object"),
    "duplicate_key": (blob(None, raw_header=json.dumps(GOOD).encode()[:-1] + b', "a": '
                           + json.dumps(GOOD["a"]).encode() + b"}"), None, "duplicate"),
    "entry_not_object": (blob({**GOOD, "a": [1]}), "a", "not a JSON object"),
    "bad_dtype": (blob(patched("a", dtype="F33")), "a", "unknown dtype"),
    "sub_byte_dtype": (blob(patched("b", dtype="F4", shape=[8])), "b", "unknown dtype"),
    "shape_not_ints": (blob(patched("a", shape=[2.0])), "a", "shape"),
    "shape_negative": (blob(patched("a", shape=[-2])), "a", "shape"),
    "shape_bool": (blob(patched("b", shape=[True, 4])), "b", "shape"),
    "offsets_three": (blob(patched("a", data_offsets=[0, 4, 8])), "a", "data_offsets"),
    "offsets_mismatch_shape": (blob(patched("a", shape=[3])), "a", "needs 12"),
    "offsets_reversed": (blob(patched("a", data_offsets=[8, 0])), "a", "data_offsets"),
    "overlap": (blob(patched("b", data_offsets=[4, 8], shape=[4])), "b", "overlap"),
    "hole": (blob(patched("b", data_offsets=[9, 13]), bytes(13)), "b", "hole"),
    "hole_at_start": (blob(patched("a", data_offsets=[4, 12]) | {"b": {
        "dtype": "I8", "shape": [4], "data_offsets": [12, 16]}}, bytes(16)), "a", "hole"),
    "trailing_bytes": (blob(GOOD, bytes(13)), None, "after the last tensor"),
    "metadata_not_str": (blob({**GOOD, "__metadata__": {"k": 1}}), None, "__metadata__"),
    "metadata_list": (blob({**GOOD, "__metadata__": ["k"]}), None, "__metadata__"),
}


# Stricter than safetensors on purpose: it keeps the last of duplicate keys, and its F4 (4-bit)
# shapes count nibbles, which no torch dtype maps one to one.
REFERENCE_ACCEPTS = {"duplicate_key", "sub_byte_dtype"}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_raise_checkpoint_error(tmp_path: Path, case: str) -> None:
    data, tensor, word = MALFORMED[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message and word in message
    if tensor is not None:
        assert f"tensor '{tensor}'" in info.value.subject
    if case in REFERENCE_ACCEPTS:
        deserialize(data)
    else:
        with pytest.raises(Exception):
            deserialize(data)


def test_good_blob_is_valid_and_null_metadata_accepted(tmp_path: Path) -> None:
    """Guards MALFORMED: its base file must be valid, or every case passes for the wrong reason."""
    path = tmp_path / "good.safetensors"
    for header in (GOOD, {**GOOD, "__metadata__": None}):
        path.write_bytes(blob(header))
        assert list(read_header(path).tensors) == ["a", "b"]
        deserialize(path.read_bytes())


def test_unknown_tensor_name(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match="no such tensor") as info:
        read_tensor(path, "nope")
    assert str(path) in str(info.value) and "'nope'" in str(info.value)


def test_bool_bytes_other_than_0_1_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bool.safetensors"
    path.write_bytes(blob({"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\x01\x00\x02"))
    with pytest.raises(CheckpointError, match="BOOL"):
        read_tensor(path, "m")


# --- fuzzing ----------------------------------------------------------------------------------


def _valid_file() -> bytes:
    tensors = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "s": torch.tensor(3),
               "e": torch.empty(0, 2), "m": torch.tensor([True, False])}
    return save(tensors, metadata={"format": "pt"})


VALID = _valid_file()
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]


def check_only_checkpoint_errors(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        header = read_header(path)
    except CheckpointError as e:
        assert str(path) in str(e)
        return
    assert isinstance(header, SafetensorsHeader)
    deserialize(data)  # whatever we accept, the reference accepts too
    for name in header.tensors:
        try:
            read_tensor(header, name)
        except CheckpointError:
            pass


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 8 * HEADER_END - 1)),  # header bits: the hard part
    st.tuples(st.just("flip"), st.integers(0, 8 * len(VALID) - 1)),
    st.tuples(st.just("cut"), st.integers(0, len(VALID))),
    st.tuples(st.just("byte"), st.integers(0, len(VALID) - 1), st.integers(0, 255)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(mutation, min_size=1, max_size=4))
def test_fuzz_mutations_raise_only_checkpoint_error(tmp_path: Path, ops: list[tuple]) -> None:
    data = bytearray(VALID)
    for op in ops:
        if op[0] == "flip" and op[1] < 8 * len(data):
            data[op[1] // 8] ^= 1 << (op[1] % 8)
        elif op[0] == "cut":
            del data[op[1]:]
        elif op[0] == "byte" and op[1] < len(data):
            data[op[1]] = op[2]
    check_only_checkpoint_errors(tmp_path / "mut.safetensors", bytes(data))


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=6) | st.sampled_from(["F32", "BF16", "I64", "BOOL"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["w", "s", "e", "m", "__metadata__"]),
       st.sampled_from(["dtype", "shape", "data_offsets", None]), json_value)
def test_fuzz_header_fields_raise_only_checkpoint_error(tmp_path: Path, name, field, value) -> None:
    header = json.loads(VALID[8:HEADER_END])
    if field is None or name == "__metadata__":
        header[name] = value
    else:
        header[name][field] = value
    text = json.dumps(header).encode()
    check_only_checkpoint_errors(tmp_path / "fld.safetensors",
                                 struct.pack("<Q", len(text)) + text + VALID[HEADER_END:])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64) | st.builds(lambda n, rest: struct.pack("<Q", n) + rest,
                                           st.integers(0, 80), st.binary(max_size=80)))
def test_fuzz_random_bytes_raise_only_checkpoint_error(tmp_path: Path, data: bytes) -> None:
    check_only_checkpoint_errors(tmp_path / "rnd.safetensors", data)
