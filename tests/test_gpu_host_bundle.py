"""The GPU-host bundle builder both toolchains share (gpu_host/bundle.py), on small synthetic wheels and trees:
the member filter, unpacking, the shims, packing into parts that reassemble the way gpu_host/run.sh does, the
compression parameter, and the two declarations' names as run.sh reads them. No network: pip is never called."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "gpu_host"))

import build_bundle  # noqa: E402
import build_serve_bundle  # noqa: E402
import bundle  # noqa: E402

TOY = bundle.Bundle(
    name="toy", parts="toy-parts", toolchain="toy toolchain", requirements=lambda: ["toy==1.0"], caches=(),
    compression="gz", part_mib=1, skip={"toy": re.compile(r"^toy/docs/")},
    entry_points={"toy-cli": ("toy.cli", "main")},
)
MAGIC = {"gz": b"\x1f\x8b", "xz": b"\xfd7zXZ\x00"}


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _wheel(path: Path, members: dict[str, tuple[bytes, int]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, (data, mode) in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = ((0o100000 | mode) << 16) if mode else 0
            zf.writestr(info, data)
    return path


def _toy_tree(root: Path, random_mib: float) -> None:
    (root / "site" / "pkg").mkdir(parents=True)
    (root / "site" / "pkg" / "__init__.py").write_text("x = 1\n")
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("#!/bin/sh\n")
    (root / "bin" / "python").chmod(0o755)
    # incompressible, so the archive is as large as this and splits into parts
    (root / "site" / "pkg" / "blob.so").write_bytes(random.Random(0).randbytes(int(random_mib * (1 << 20))))


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("compression", ["gz", "xz"])
def test_pack_splits_into_parts_that_reassemble(tmp_path: Path, compression: str) -> None:
    root = tmp_path / "toy"
    _toy_tree(root, random_mib=2.5)
    toy = dataclasses.replace(TOY, compression=compression)
    parts = bundle.pack(toy, root, tmp_path / "parts", part_mib=1)

    assert [p.name for p in parts] == [f"toy.tar.{compression}.{i:02d}" for i in range(3)]
    assert [p.stat().st_size for p in parts[:-1]] == [1 << 20] * 2 and 0 < parts[-1].stat().st_size <= 1 << 20
    data = b"".join(p.read_bytes() for p in sorted((tmp_path / "parts").glob(f"toy.tar.{compression}.*")))
    assert data.startswith(MAGIC[compression])
    assert (tmp_path / "parts" / "toy.sha256").read_text() == (
        f"{hashlib.sha256(data).hexdigest()}  toy.tar.{compression}\n")
    # streamed, as gpu_host/run.sh unpacks the serving bundle (the training one goes through `tar xz`)
    out = tmp_path / "out"
    with tarfile.open(fileobj=io.BytesIO(data), mode=f"r|{compression}") as tar:
        tar.extractall(out, filter="tar")
    assert _tree(out / "toy") == _tree(root)


def test_pack_starts_the_parts_folder_afresh(tmp_path: Path) -> None:
    root = tmp_path / "toy"
    _toy_tree(root, random_mib=1.5)
    assert len(bundle.pack(TOY, root, tmp_path / "parts", part_mib=1)) == 2
    (root / "site" / "pkg" / "blob.so").write_bytes(b"small now")
    bundle.pack(TOY, root, tmp_path / "parts", part_mib=1)
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["toy.sha256", "toy.tar.gz.00"]


def test_a_reproducible_archive_does_not_depend_on_owners_and_mtimes(tmp_path: Path) -> None:
    root = tmp_path / "toy"
    _toy_tree(root, random_mib=0.01)
    toy = dataclasses.replace(TOY, compression="xz")

    def sha(b: bundle.Bundle) -> str:
        bundle.pack(b, root, tmp_path / "parts", part_mib=1)
        return (tmp_path / "parts" / "toy.sha256").read_text()

    first = sha(toy)
    os.utime(root / "site" / "pkg" / "__init__.py", (1_000_000_000, 1_000_000_000))
    assert sha(toy) == first
    with tarfile.open(tmp_path / "parts" / "toy.tar.xz.00") as tar:
        assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in tar.getmembers()} == {(0, 0, "", "", 0)}

    sha(dataclasses.replace(toy, reproducible=False))
    with tarfile.open(tmp_path / "parts" / "toy.tar.xz.00") as tar:
        assert tar.getmember("toy/site/pkg/__init__.py").mtime == 1_000_000_000


def test_an_unknown_compression_is_refused(tmp_path: Path) -> None:
    (tmp_path / "toy").mkdir()
    with pytest.raises(ValueError, match="zst"):
        bundle.pack(dataclasses.replace(TOY, compression="zst"), tmp_path / "toy", tmp_path / "parts", part_mib=1)


# --------------------------------------------------------------------------- the member filter and unpacking


@pytest.mark.parametrize("wheel, member, kept", [
    ("toy-1.0-py3-none-any.whl", "toy/__init__.py", True),
    ("toy-1.0-py3-none-any.whl", "toy/docs/index.md", False),              # the bundle's own filter, by wheel stem
    ("other-1.0-py3-none-any.whl", "toy/docs/index.md", True),             # ... of that wheel only
    ("Toy-1.0-py3-none-any.whl", "toy/docs/index.md", False),
    ("other-1.0-py3-none-any.whl", "other_sgl_kernel_payload/p.part", False),  # every bundle: SGLang's payloads
    ("other-1.0-py3-none-any.whl", "kt_kernel/_kt_kernel_ext_avx512.cpython-312-x86_64-linux-gnu.so", False),
    ("other-1.0-py3-none-any.whl", "kt_kernel/_kt_kernel_ext_amx.cpython-312-x86_64-linux-gnu.so", True),
    ("other-1.0-py3-none-any.whl", "kt_kernel/_kt_kernel_ext_amxint8.cpython-312-x86_64-linux-gnu.so", True),
])
def test_keep(wheel: str, member: str, kept: bool) -> None:
    assert TOY.keep(wheel, member) is kept


@pytest.mark.parametrize("declared", [build_bundle.TRAINING, build_serve_bundle.SERVE], ids=["training", "serve"])
@pytest.mark.parametrize("member, kept", [
    ("kt_kernel/__init__.py", True), ("kt_kernel.libs/libgomp.so.1", True), ("kt_kernel-0.7.2.dist-info/RECORD", True),
    ("sgl_kernel/__init__.py", False), ("deep_gemm/__init__.py", False),
])
def test_both_bundles_cut_kt_kernel_to_itself(declared: bundle.Bundle, member: str, kept: bool) -> None:
    assert declared.keep("kt_kernel-0.7.2-cp312-cp312-manylinux_2_35_x86_64.whl", member) is kept


@pytest.mark.parametrize("record_left_out", [False, True])
def test_assemble_unpacks_the_kept_members_and_writes_the_shims(tmp_path: Path, record_left_out: bool) -> None:
    wheel = _wheel(tmp_path / "cache" / "toy-1.0-py3-none-any.whl", {
        "toy/__init__.py": (b"x = 1\n", 0o644),
        "toy/tool.sh": (b"#!/bin/sh\n", 0o755),
        "toy/no_mode.py": (b"y = 2\n", 0),
        "toy/docs/index.md": (b"left out\n", 0o644),
        "toy_sgl_kernel_payload/p.part": (b"0123456789", 0o644),
        "toy-1.0.dist-info/METADATA": (b"Name: toy\n", 0o644),
    })
    patched: list[Path] = []

    def patch(site: Path) -> None:
        patched.append(site)
        (site / "toy" / "patched.py").write_text("z = 3\n")

    toy = dataclasses.replace(TOY, patch=patch, record_left_out=record_left_out)
    root = tmp_path / "toy"
    (root / "stale").mkdir(parents=True)
    sizes = bundle.assemble(toy, root, [wheel], ["toy==1.0"])

    site = root / "site"
    assert patched == [site] and not (root / "stale").exists()
    got = {k: v for k, v in _tree(site).items() if k.startswith("toy")}
    assert set(got) == {"toy/__init__.py", "toy/tool.sh", "toy/no_mode.py", "toy/patched.py",
                        "toy-1.0.dist-info/METADATA"}
    assert got["toy/tool.sh"] == (b"#!/bin/sh\n", 0o755) and got["toy/__init__.py"][1] == 0o644
    assert sizes == {wheel.name: {"kept": 6 + 10 + 6 + 10, "left_out": 9 + 10}}
    assert json.loads((root / "unpacked_bytes.json").read_text()) == (sizes if record_left_out else {wheel.name: 32})
    assert (root / "requirements.txt").read_text() == "toy==1.0\n"

    assert (site / "sitecustomize.py").read_text() == bundle._SITECUSTOMIZE
    assert (root / "ktflow-src" / "ktflow" / "__init__.py").is_file()
    assert [p.name for p in site.glob("ktflow-*.dist-info/METADATA")] == ["METADATA"]
    assert sorted(p.name for p in (root / "bin").iterdir()) == ["python", "toy-cli"]
    assert all(p.stat().st_mode & 0o777 == 0o755 for p in (root / "bin").iterdir())
    assert "# The toy toolchain: " in (root / "bin" / "python").read_text()
    assert "from toy.cli import main" in (root / "bin" / "toy-cli").read_text()


# --------------------------------------------------------------------------- the wheel cache and pip


def test_wheel_for_looks_through_the_caches_in_order(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    _wheel(second / "Foo_Bar-1.0-py3-none-any.whl", {})
    _wheel(first / "foo_bar-2.0-py3-none-any.whl", {})
    _wheel(second / "foo_bar-2.0-py3-none-any.whl", {})
    toy = dataclasses.replace(TOY, caches=(first, second, tmp_path / "absent"))
    assert bundle.wheel_for(toy, "foo-bar==1.0") == second / "Foo_Bar-1.0-py3-none-any.whl"
    assert bundle.wheel_for(toy, "foo.bar==2.0") == first / "foo_bar-2.0-py3-none-any.whl"
    assert bundle.wheel_for(toy, "foo-bar==3.0") is None


@pytest.mark.parametrize("build_sdists", [False, True])
def test_download_fetches_only_the_missing_wheels(tmp_path: Path, monkeypatch, build_sdists: bool) -> None:
    cache = tmp_path / "cache"
    _wheel(cache / "have-1.0-py3-none-any.whl", {})
    calls: list[tuple[list[str], bool]] = []

    def run(argv: list[str], check: bool = False) -> subprocess.CompletedProcess:
        calls.append((argv, check))
        if "download" in argv:  # the index has no wheel
            if check:
                raise subprocess.CalledProcessError(1, argv)
            return subprocess.CompletedProcess(argv, 1)
        _wheel(cache / "need-2.0-py3-none-any.whl", {})
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(bundle.subprocess, "run", run)
    toy = dataclasses.replace(TOY, caches=(cache,), platforms=("manylinux_2_35_x86_64", "manylinux1_x86_64"),
                              build_sdists=build_sdists)
    if not build_sdists:
        with pytest.raises(subprocess.CalledProcessError):
            bundle.download(toy, ["have==1.0", "need==2.0"])
        assert len(calls) == 1  # pip's failure stops the build
        return
    wheels = bundle.download(toy, ["have==1.0", "need==2.0"])
    assert [w.name for w in wheels] == ["have-1.0-py3-none-any.whl", "need-2.0-py3-none-any.whl"]
    (download, _), (build, _) = calls
    assert download[-1] == "need==2.0" and download[download.index("--python-version") + 1] == "3.12"
    assert [download[i + 1] for i, a in enumerate(download) if a == "--platform"] == list(toy.platforms)
    assert build[2:4] == ["pip", "wheel"] and build[-1] == "need==2.0"


# --------------------------------------------------------------------------- the two declarations


def test_the_parts_are_where_run_sh_unpacks_them() -> None:
    run_sh = (REPO / "gpu_host" / "run.sh").read_text()
    training, serve = build_bundle.TRAINING, build_serve_bundle.SERVE
    assert (training.root, training.parts_dir, training.archive) == (
        bundle.BUILD / "bundle", bundle.BUILD / "parts", "bundle.tar.gz")
    assert (serve.root, serve.parts_dir, serve.archive) == (
        bundle.BUILD / "serve", bundle.BUILD / "serve-parts", "serve.tar.xz")
    assert '"$B"/parts/bundle.tar.gz.* ' in run_sh and "| tar xz -C" in run_sh and '"$B/parts/bundle.sha256"' in run_sh
    assert '"$B"/serve-parts/serve.tar.xz.* ' in run_sh and 'mode="r|xz"' in run_sh
    assert '"$B/serve-parts/serve.sha256"' in run_sh
    assert (training.part_mib, serve.part_mib) == (60, 59)  # a part and what travels with it fit in 64 MiB


@pytest.mark.parametrize("declared", [build_bundle.TRAINING, build_serve_bundle.SERVE], ids=["training", "serve"])
def test_check_prints_the_pinned_requirements(declared: bundle.Bundle, capsys) -> None:
    assert bundle.main(declared, None, ["--check"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == declared.requirements()
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", r) for r in printed)
    assert "kt-kernel==0.7.2" in printed
