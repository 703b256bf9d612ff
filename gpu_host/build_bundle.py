#!/usr/bin/env python3
"""Build the offline KT training toolchain bundle for a GPU + AMX host without network.

The host brings Python 3.12 with torch (2.11 + CUDA was checked), transformers' own deps
(numpy, safetensors, huggingface_hub, pyyaml, rich, psutil, jinja2, ...). This bundle adds,
from pinned versions (``constraints/kt-train.txt`` wins where it pins a package):

- the KT SFT stack: llamafactory-kt, transformers-kt, accelerate-kt, peft-kt, trl-kt and what
  they import that such a host lacks (datasets, dill, multiprocess, fire, omegaconf, tyro, ...);
- kt-kernel trimmed to its ``amx`` extension (+ ``kt_kernel.libs``) and gguf;
- what ktflow's engine needs that the host lacks (pydantic + pydantic-core, annotated-types,
  typing-inspection);
- compressed-tensors (+ loguru), for plain LlamaFactory on Kimi INT4 (gpu_host/big.py hf);
- ktflow itself, from this working tree;
- entry-point shims ``bin/llamafactory-cli``, ``bin/accelerate`` and ``bin/python`` (the
  toolchain python the recipe names: the host's python3 with the bundle first on sys.path).

Wheels are downloaded once into ``.cache/gpu-host/wheels`` (cp312, manylinux_2_35 and older
tags, ``--no-deps``: the list below is the whole closure), unpacked into
``build/gpu-host/bundle/site`` without the ``*_sgl_kernel_payload`` blobs (SGLang's kernels,
for serving only), and packed as ``build/gpu-host/parts/bundle.tar.gz.NN`` of at most
``--part-mib`` MiB each, so each part fits one device call's 64 MiB.

    .venv/bin/python gpu_host/build_bundle.py            # download (if needed), unpack, pack
    .venv/bin/python gpu_host/build_bundle.py --check    # list what would be fetched
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "gpu-host" / "wheels"
BUILD = REPO / "build" / "gpu-host"
BUNDLE = BUILD / "bundle"
PARTS = BUILD / "parts"
PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]

# The closure, beyond what the host has. A version here is used only where
# constraints/kt-train.txt does not pin the package.
PACKAGES: dict[str, str | None] = {
    "llamafactory-kt": None, "transformers-kt": None, "accelerate-kt": None, "peft-kt": None, "trl-kt": None,
    "kt-kernel": None, "gguf": None,
    "datasets": None, "dill": None, "multiprocess": None, "fsspec": None, "torchdata": None,
    "tokenizers": None,  # transformers-kt wants <= 0.23.0; hosts often have newer
    "fire": None, "termcolor": None, "omegaconf": None,
    "tyro": None, "docstring_parser": None, "shtab": None,
    "pydantic": None, "pydantic_core": None, "annotated-types": None, "typing-inspection": None,
    "einops": None,
    # Not used by KT: lets the plain-LlamaFactory attempt on a Kimi INT4 checkpoint (gpu_host/big.py hf) meet
    # transformers' compressed-tensors quantizer wherever transformers engages it, so a failure there is never
    # "the library is missing". The orchestrator's pins (constraints/orchestrator.txt); 0.20 needs torch >= 2.10,
    # which the host has (2.11).
    "compressed-tensors": "0.20.0", "loguru": "0.7.3",
}
# Left out of the unpacked tree: SGLang kernel payloads (serving only, 85-273 MB each) and
# kt-kernel's CPU variants other than amx.
_SKIP_DIR = re.compile(r"^[^/]*_sgl_kernel_payload/")
_KT_EXT = re.compile(r"^kt_kernel/_kt_kernel_ext_(?P<variant>[a-z0-9_]+)\.")
# kt-kernel's wheel also carries SGLang's kernels (sgl_kernel, deep_gemm, flash_attn_origin, ...)
# for serving; training needs only these of its top-level entries.
_KT_KERNEL_KEEP = ("kt_kernel/", "kt_kernel.libs/", "kt_kernel-")


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (REPO / "constraints" / "kt-train.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_norm(name)] = version.strip()
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    pinned = pins()
    reqs = []
    for name, fallback in PACKAGES.items():
        version = pinned.get(_norm(name), fallback)
        if version is None:
            raise SystemExit(f"{name}: no pin in constraints/kt-train.txt and none in build_bundle.PACKAGES")
        reqs.append(f"{name}=={version}")
    return reqs


def _wheel_for(req: str) -> Path | None:
    name, version = req.split("==")
    stem = re.sub(r"[-.]+", "_", name).lower()
    for wheel in CACHE.glob("*.whl"):
        parts = wheel.name.split("-")
        if re.sub(r"[-.]+", "_", parts[0]).lower() == stem and parts[1] == version:
            return wheel
    return None


def download(reqs: list[str]) -> list[Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    missing = [r for r in reqs if _wheel_for(r) is None]
    for req in missing:  # one at a time: a pure-Python wheel needs no platform tags, pip accepts both
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--pre",
                "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(CACHE), "-q"]
        for platform in PLATFORMS:
            argv += ["--platform", platform]
        print(f"download {req}", flush=True)
        subprocess.run(argv + [req], check=True)
    wheels = []
    for req in reqs:
        wheel = _wheel_for(req)
        if wheel is None:
            raise SystemExit(f"{req}: pip downloaded nothing matching")
        wheels.append(wheel)
    return wheels


def unpack(wheels: list[Path], site: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for wheel in wheels:
        total = 0
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                name = info.filename
                if info.is_dir() or _SKIP_DIR.match(name):
                    continue
                if wheel.name.startswith("kt_kernel-") and not name.startswith(_KT_KERNEL_KEEP):
                    continue
                m = _KT_EXT.match(name)
                if m and not m.group("variant").startswith("amx"):
                    continue
                target = site / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(target, mode)
                total += info.file_size
        sizes[wheel.name] = total
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
# The KT training toolchain: the host's python3 with this bundle first on sys.path.
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
ENTRY_POINTS = {
    "llamafactory-cli": ("llamafactory.cli", "main"),
    "accelerate": ("accelerate.commands.accelerate_cli", "main"),
    "ktflow": ("ktflow.cli", "main"),
}


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


def write_shims(bundle: Path) -> None:
    (bundle / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    bin_dir = bundle / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text(_PY_SHIM)
    for name, (module, func) in ENTRY_POINTS.items():
        (bin_dir / name).write_text(_ENTRY.format(module=module, func=func, name=name))
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def pack(bundle: Path, parts_dir: Path, part_mib: int) -> list[Path]:
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        tar.add(bundle, arcname="bundle")
    data = buf.getvalue()
    size = part_mib << 20
    parts = []
    for i in range(0, len(data), size):
        part = parts_dir / f"bundle.tar.gz.{i // size:02d}"
        part.write_bytes(data[i:i + size])
        parts.append(part)
    digest = hashlib.sha256(data).hexdigest()
    (parts_dir / "bundle.sha256").write_text(f"{digest}  bundle.tar.gz\n")
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="print the pinned requirements and exit")
    ap.add_argument("--part-mib", type=int, default=60)
    args = ap.parse_args()
    reqs = requirements()
    if args.check:
        print("\n".join(reqs))
        return 0
    wheels = download(reqs)
    shutil.rmtree(BUNDLE, ignore_errors=True)
    site = BUNDLE / "site"
    site.mkdir(parents=True)
    sizes = unpack(wheels, site)
    add_ktflow(site)
    write_shims(BUNDLE)
    (BUNDLE / "requirements.txt").write_text("\n".join(reqs) + "\n")
    (BUNDLE / "unpacked_bytes.json").write_text(json.dumps(sizes, indent=1) + "\n")
    parts = pack(BUNDLE, PARTS, args.part_mib)
    total = sum(p.stat().st_size for p in parts)
    print(f"bundle: {sum(sizes.values()) / 1e6:.0f} MB unpacked, {total / 1e6:.1f} MB packed in {len(parts)} part(s) "
          f"under {PARTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
