"""The builder both offline GPU-host toolchains share (gpu_host/build_bundle.py, gpu_host/build_serve_bundle.py).

A ``Bundle`` declares what one toolchain holds: its pinned requirements (the whole closure beyond what the host
has, installed ``--no-deps``), the wheel members it leaves out, its patches, its entry points, the compression and
the part size. ``build`` then does the same steps for each:

- download every pinned wheel once into the bundle's cache (cp312, manylinux tags, ``--no-deps``);
- unpack them into ``build/gpu-host/NAME/site``, leaving out SGLang's ``*_sgl_kernel_payload`` blobs, kt-kernel's
  CPU variants other than ``amx`` and whatever the bundle's own filter names, then apply its patches;
- add ktflow from this working tree and the shims: ``site/sitecustomize.py``, ``bin/python`` (the host's python3
  with the bundle first on sys.path) and one ``bin/`` script per entry point;
- pack ``build/gpu-host/NAME`` as ``build/gpu-host/PARTS/NAME.tar.EXT.NN`` (each at most ``--part-mib`` MiB: the
  GPU host takes its inputs in pieces of at most 64 MiB) + ``NAME.sha256`` of the whole archive, which
  gpu_host/run.sh checks on unpacking.

``main`` gives each script the same command line: no argument builds, ``--check`` prints the pinned requirements.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "gpu-host"
BUILD = REPO / "build" / "gpu-host"
PYTHON_VERSION = "3.12"
MANYLINUX = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")

Compression = Literal["gz", "xz"]
# Level 6 for both: tarfile's keyword differs by codec.
_LEVEL: dict[str, dict[str, int]] = {"gz": {"compresslevel": 6}, "xz": {"preset": 6}}

# Left out of every bundle: SGLang's kernel payloads (85-273 MB each; the training bundle does not serve, the
# serving one brings kernels built for the host's torch) and kt-kernel's CPU variants other than amx.
_PAYLOAD = re.compile(r"^[^/]*_sgl_kernel_payload/")
_KT_EXT = re.compile(r"^kt_kernel/_kt_kernel_ext_(?P<variant>[a-z0-9_]+)\.")
# kt-kernel's wheel also carries SGLang's kernels (sgl_kernel, deep_gemm, flash_attn_origin, ...) linked to
# torch 2.9.1: only kt_kernel itself stays. For a bundle's ``skip``, under the wheel stem "kt_kernel".
KT_KERNEL_ONLY = re.compile(r"^(?!kt_kernel/|kt_kernel\.libs/|kt_kernel-)")


@dataclass(frozen=True)
class Bundle:
    name: str                                  # build/gpu-host/NAME, NAME.tar.EXT.NN, NAME.sha256
    parts: str                                 # the parts' folder under build/gpu-host
    toolchain: str                             # what bin/python says it is
    requirements: Callable[[], list[str]]      # "name==version", the whole closure
    caches: Sequence[Path]                     # downloads go into the first; a pinned wheel in any is used
    compression: Compression
    part_mib: int                              # --part-mib's default
    platforms: Sequence[str] = MANYLINUX
    skip: Mapping[str, re.Pattern[str]] = field(default_factory=dict)  # wheel stem -> members left out
    entry_points: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # bin/NAME -> (module, function)
    patch: Callable[[Path], None] | None = None  # applied to site/ after unpacking
    build_sdists: bool = False                 # a requirement the index has only as an sdist: its wheel, built once
    reproducible: bool = True                  # tar headers without owners and mtimes: same tree, same sha256
    record_left_out: bool = False              # unpacked_bytes.json also says what each wheel left out

    @property
    def root(self) -> Path:
        return BUILD / self.name

    @property
    def parts_dir(self) -> Path:
        return BUILD / self.parts

    @property
    def archive(self) -> str:
        return f"{self.name}.tar.{self.compression}"

    def keep(self, wheel_name: str, member: str) -> bool:
        """Whether ``member`` of the wheel ``wheel_name`` goes into the bundle."""
        if _PAYLOAD.match(member):
            return False
        skip = self.skip.get(wheel_name.split("-", 1)[0].lower())
        if skip is not None and skip.match(member):
            return False
        m = _KT_EXT.match(member)
        return not (m and not m.group("variant").startswith("amx"))


def norm(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(path: Path) -> dict[str, str]:
    """``{normalized name: version}`` of every ``name==version`` line of a constraints file."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[norm(name)] = version.strip()
    return out


def wheel_for(bundle: Bundle, req: str) -> Path | None:
    name, version = req.split("==")
    stem = re.sub(r"[-.]+", "_", name).lower()
    for cache in bundle.caches:
        for wheel in sorted(cache.glob("*.whl")) if cache.is_dir() else ():
            parts = wheel.name.split("-")
            if re.sub(r"[-.]+", "_", parts[0]).lower() == stem and parts[1] == version:
                return wheel
    return None


def download(bundle: Bundle, reqs: list[str]) -> list[Path]:
    cache = bundle.caches[0]
    cache.mkdir(parents=True, exist_ok=True)
    for req in [r for r in reqs if wheel_for(bundle, r) is None]:
        # one at a time: a pure-Python wheel needs no platform tags, pip accepts both
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--pre",
                "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(cache), "-q"]
        for platform in bundle.platforms:
            argv += ["--platform", platform]
        print(f"download {req}", flush=True)
        if subprocess.run(argv + [req], check=not bundle.build_sdists).returncode != 0:
            print(f"{req}: no wheel on the index; building one from its sdist", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(cache), req], check=True)
    wheels = []
    for req in reqs:
        wheel = wheel_for(bundle, req)
        if wheel is None:
            raise SystemExit(f"{req}: pip downloaded nothing matching")
        wheels.append(wheel)
    return wheels


def unpack(bundle: Bundle, wheels: Sequence[Path], site: Path) -> dict[str, dict[str, int]]:
    """Each wheel's kept members into ``site``; per wheel, the bytes kept and left out."""
    sizes: dict[str, dict[str, int]] = {}
    for wheel in wheels:
        kept = left = 0
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                if not bundle.keep(wheel.name, info.filename):
                    left += info.file_size
                    continue
                target = site / info.filename
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(target, mode)
                kept += info.file_size
        sizes[wheel.name] = {"kept": kept, "left_out": left}
    return sizes


def add_ktflow(site: Path) -> None:
    """ktflow from this working tree, in ``ktflow-src/`` (``KTFLOW_SRC`` points a run at a newer tree)."""
    src = site.parent / "ktflow-src"
    shutil.copytree(REPO / "ktflow", src / "ktflow", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # importlib.metadata must find ktflow (its version is recorded in manifests).
    version = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    dist = site / f"ktflow-{version.group(1) if version else '0'}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ktflow\nVersion: {version.group(1) if version else '0'}\n")


_PY_SHIM = """#!/bin/sh
# The TOOLCHAIN: the host's python3 with this bundle first on sys.path.
here="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${KTFLOW_SRC:-$here/ktflow-src}:$here/site${PYTHONPATH:+:$PYTHONPATH}"
exec "${KTFLOW_HOST_PYTHON:-python3}" "$@"
"""
_ENTRY = """#!/bin/sh
here="$(cd "$(dirname "$0")" && pwd)"
exec "$here/python" -c 'import sys
from {module} import {func}
sys.argv[0] = "{name}"
sys.exit({func}())' "$@"
"""

# LlamaFactory-kt refuses to run where an upstream transformers/accelerate/peft/trl distribution
# is installed (the -kt forks share their module names). On a host whose python has them, the
# bundle comes first on sys.path, so the forks are what gets imported; this hook also hides the
# upstream distributions' metadata outside the bundle, which makes the bundle the separate
# environment KT asks for without touching the host's python.
_SITECUSTOMIZE = """\
import importlib.metadata as _md
import os as _os
import re as _re

_HIDE = {"transformers", "accelerate", "peft", "trl"}
_BUNDLE = _os.path.dirname(_os.path.abspath(__file__))
_find = _md.MetadataPathFinder.find_distributions.__func__


def _find_distributions(cls, context=_md.DistributionFinder.Context()):
    for dist in _find(cls, context):
        path = str(getattr(dist, "_path", ""))
        name = _re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower() if path else ""
        if name in _HIDE and not path.startswith(_BUNDLE):
            continue
        yield dist


_md.MetadataPathFinder.find_distributions = classmethod(_find_distributions)
"""


def write_shims(bundle: Bundle, root: Path) -> None:
    (root / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text(_PY_SHIM.replace("TOOLCHAIN", bundle.toolchain))
    for name, (module, func) in bundle.entry_points.items():
        (bin_dir / name).write_text(_ENTRY.format(module=module, func=func, name=name))
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def pack(bundle: Bundle, root: Path, parts_dir: Path, part_mib: int) -> list[Path]:
    """``root`` as ``NAME.tar.EXT.NN`` parts of at most ``part_mib`` MiB + ``NAME.sha256`` of their concatenation."""
    if bundle.compression not in _LEVEL:
        raise ValueError(f"compression {bundle.compression!r}: one of {sorted(_LEVEL)}")
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{bundle.compression}", **_LEVEL[bundle.compression]) as tar:
        tar.add(root, arcname=bundle.name, filter=_reproducible if bundle.reproducible else None)
    data = buf.getvalue()
    size = part_mib << 20
    parts = []
    for i in range(0, len(data), size):
        part = parts_dir / f"{bundle.archive}.{i // size:02d}"
        part.write_bytes(data[i:i + size])
        parts.append(part)
    (parts_dir / f"{bundle.name}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {bundle.archive}\n")
    return parts


def _reproducible(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def assemble(bundle: Bundle, root: Path, wheels: Sequence[Path], reqs: list[str]) -> dict[str, dict[str, int]]:
    """The unpacked bundle in ``root`` (emptied first): site, patches, ktflow, shims, requirements, sizes."""
    shutil.rmtree(root, ignore_errors=True)
    site = root / "site"
    site.mkdir(parents=True)
    sizes = unpack(bundle, wheels, site)
    if bundle.patch is not None:
        bundle.patch(site)
    add_ktflow(site)
    write_shims(bundle, root)
    (root / "requirements.txt").write_text("\n".join(reqs) + "\n")
    recorded = sizes if bundle.record_left_out else {wheel: s["kept"] for wheel, s in sizes.items()}
    (root / "unpacked_bytes.json").write_text(json.dumps(recorded, indent=1) + "\n")
    return sizes


def build(bundle: Bundle, part_mib: int | None = None) -> list[Path]:
    reqs = bundle.requirements()
    wheels = download(bundle, reqs)
    sizes = assemble(bundle, bundle.root, wheels, reqs)
    parts = pack(bundle, bundle.root, bundle.parts_dir, bundle.part_mib if part_mib is None else part_mib)
    total = sum(p.stat().st_size for p in parts)
    kept = sum(s["kept"] for s in sizes.values())
    print(f"{bundle.toolchain}: {kept / 1e6:.0f} MB unpacked, {total / 1e6:.1f} MB packed in {len(parts)} part(s) "
          f"under {bundle.parts_dir.relative_to(REPO)}")
    return parts


def main(bundle: Bundle, doc: str | None, argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="print the pinned requirements and exit")
    ap.add_argument("--part-mib", type=int, default=bundle.part_mib)
    args = ap.parse_args(argv)
    if args.check:
        print("\n".join(bundle.requirements()))
        return 0
    build(bundle, args.part_mib)
    return 0
