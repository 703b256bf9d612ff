#!/usr/bin/env python3
"""Build the offline SGLang serving toolchain for the GPU host ("Stack B", shared/reference/sglang-gpu-host.md).

sglang-kt 0.7.2 (KT's SGLang fork: KT CPU experts, the KT LoRA adapter) ships kernels linked to torch 2.9.1;
the host has torch 2.11.0+cu130 and a call carries at most 64 MiB. This bundle pairs sglang-kt's Python with
upstream ``sglang-kernel`` 0.4.4 (built for torch 2.11 / CUDA 13), every version pinned in
``constraints/sglang-gpu-host.txt`` (the whole closure beyond what the host has, installed ``--no-deps``):

- sglang-kt without ``sglang_kt_sgl_kernel_payload`` (its torch 2.9.1 kernels) and without
  ``sglang/multimodal_gen`` (diffusion serving, not imported by ``sglang.srt``);
- sglang-kernel without FlashAttention-3 (``flash_ops``, 1.7 GB), the sm100 build and FlashMLA: serve with
  ``--attention-backend triton``; ``sgl_kernel.flash_attn`` then imports (FA3 unsupported, a call raises), so
  model modules that import it at the top (Kimi K2.5's) still load. sglang-kt imports four FP4 names that no
  torch-2.11 build of the kernel has (``scaled_fp4_quant``, ...; FP4 never runs on an H100): they are added as
  placeholders that raise;
- flashinfer-python, apache-tvm-ffi, the HTTP/OpenAI stack (fastapi, uvicorn, openai, ...);
- from the KT stack: transformers-kt (without its payload), accelerate-kt (transformers-kt refuses to import
  without an accelerate distribution), tokenizers, kt-kernel cut to its ``amx`` extension, gguf, pydantic, dill,
  einops, loguru;
- a stand-in ``IPython.display`` (sglang/utils.py imports ``HTML`` and ``display`` from it at import time,
  for notebooks only), ktflow from this working tree, and ``bin/python`` / ``bin/ktflow`` shims with the
  same ``sitecustomize`` as the training bundle (gpu_host/build_bundle.py).

Self-contained: with the host's python3 it runs ``sglang.launch_server`` and ktflow (render the launch,
``convert-lora``), with or without the training bundle beside it. Wheels are downloaded once into
``.cache/gpu-host/serve-wheels`` (the training bundle's ``.cache/gpu-host/wheels`` is reused where it
holds the pinned file), unpacked into ``build/gpu-host/serve`` and packed as
``build/gpu-host/serve-parts/serve.tar.xz.NN`` (each at most ``--part-mib`` MiB) + ``serve.sha256``
(gpu_host/run.sh serve-setup unpacks it with the host's python3, checking the sha256).

    .venv/bin/python gpu_host/build_serve_bundle.py           # download (if needed), unpack, trim, pack
    .venv/bin/python gpu_host/build_serve_bundle.py --check   # print the pinned requirements
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build_bundle  # noqa: E402  (the training bundle's shims, platform tags and ktflow copy)

REPO = HERE.parent
CONSTRAINTS = REPO / "constraints" / "sglang-gpu-host.txt"
CACHE = REPO / ".cache" / "gpu-host" / "serve-wheels"
CACHES = (CACHE, build_bundle.CACHE)
BUILD = REPO / "build" / "gpu-host"
SERVE = BUILD / "serve"
PARTS = BUILD / "serve-parts"
PLATFORMS = build_bundle.PLATFORMS + ["manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_5_x86_64"]

# What each wheel leaves out (a member path matching any pattern is not unpacked).
_SKIP_ALWAYS = re.compile(r"^[^/]*_sgl_kernel_payload/")
_SKIP: dict[str, re.Pattern[str]] = {
    "sglang_kt": re.compile(r"^sglang/multimodal_gen/"),
    # FA3 (1.7 GB), Blackwell build, FlashMLA: not used with --attention-backend triton on Hopper
    "sglang_kernel": re.compile(r"^sgl_kernel/(flash_ops\.|flashmla_ops\.|sm100/)"),
    # kt-kernel's wheel also carries torch-2.9.1 SGLang kernels (sgl_kernel, deep_gemm, ...): only kt_kernel stays
    "kt_kernel": re.compile(r"^(?!kt_kernel/|kt_kernel\.libs/|kt_kernel-)"),
}
_KT_EXT = build_bundle._KT_EXT

# sglang-kt 0.7.2 imports these from sgl_kernel; sglang-kernel 0.4.4 (and every torch-2.11 build) lacks them.
# All are FP4 (Blackwell) paths; quantization/fp8.py imports flashinfer_trtllm.py, which imports
# scaled_fp4_quant, on every start.
FP4_PLACEHOLDERS = ("scaled_fp4_quant", "cutlass_scaled_fp4_mm", "scaled_fp4_experts_quant", "cutlass_fp4_group_mm")
_SGL_KERNEL_PATCH = '''

# --- added by ktflow gpu_host/build_serve_bundle.py: names sglang-kt 0.7.2 imports that this build lacks
def _ktflow_missing(_name):
    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{_name} is not in sglang-kernel " + __version__ + " (FP4 kernels; ktflow GPU-host bundle)")
    _missing.__name__ = _name
    return _missing


for _name in NAMES:
    if _name not in globals():
        globals()[_name] = _ktflow_missing(_name)
'''
# sgl_kernel/flash_attn.py raises ImportError when FA3 (flash_ops) is absent, which makes sglang-kt skip every model
# module importing it at the top, Kimi K2.5's among them (KimiK25ForConditionalGeneration, via its vision tower's
# sglang.srt.layers.attention.vision): without FA3 they import, FA3 reports itself unsupported, and a call raises.
_FA3_IMPORT = """try:
    from sgl_kernel import flash_ops
except:
    raise ImportError(
        "Can not import FA3 in sgl_kernel. Please check your installation."
    )
"""
_FA3_IMPORT_PATCHED = """try:
    from sgl_kernel import flash_ops
except ImportError:  # ktflow GPU-host bundle: FlashAttention-3 (flash_ops) left out; serve with --attention-backend triton
    flash_ops = None
"""
_FA3_TAIL = """

# --- added by ktflow gpu_host/build_serve_bundle.py: this bundle has no FlashAttention-3
if flash_ops is None:

    def is_fa3_supported(device=None) -> bool:
        return False
"""
_IPYTHON_INIT = '"""Stand-in for IPython (ktflow GPU-host serving bundle): sglang/utils.py imports IPython.display."""\n'
_IPYTHON_DISPLAY = '''"""Stand-in for IPython.display: sglang/utils.py imports HTML and display (notebooks) at import."""


class HTML:
    def __init__(self, data=None, *args, **kwargs):
        self.data = data


def display(*objs, **kwargs):
    for obj in objs:
        print(getattr(obj, "data", obj))
'''
ENTRY_POINTS = {"ktflow": ("ktflow.cli", "main")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(path: Path = CONSTRAINTS) -> list[str]:
    """``name==version`` for every line of the constraints file (comments dropped)."""
    reqs = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            if "==" not in line:
                raise SystemExit(f"{path.name}: {line!r} is not pinned exactly")
            reqs.append(line.replace(" ", ""))
    return reqs


def _wheel_for(req: str) -> Path | None:
    name, version = req.split("==")
    stem = re.sub(r"[-.]+", "_", name).lower()
    for cache in CACHES:
        for wheel in sorted(cache.glob("*.whl")) if cache.is_dir() else ():
            parts = wheel.name.split("-")
            if re.sub(r"[-.]+", "_", parts[0]).lower() == stem and parts[1] == version:
                return wheel
    return None


def download(reqs: list[str]) -> list[Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    for req in [r for r in reqs if _wheel_for(r) is None]:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--pre",
                "--python-version", build_bundle.PYTHON_VERSION, "--implementation", "cp", "-d", str(CACHE), "-q"]
        for platform in PLATFORMS:
            argv += ["--platform", platform]
        print(f"download {req}", flush=True)
        if subprocess.run(argv + [req]).returncode != 0:  # a pure-Python sdist (rouge-score): its wheel, built once
            print(f"{req}: no wheel on the index; building one from its sdist", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(CACHE), req], check=True)
    wheels = []
    for req in reqs:
        wheel = _wheel_for(req)
        if wheel is None:
            raise SystemExit(f"{req}: pip downloaded nothing matching")
        wheels.append(wheel)
    return wheels


def keep(wheel_name: str, member: str) -> bool:
    """Whether ``member`` of the wheel ``wheel_name`` goes into the bundle."""
    if _SKIP_ALWAYS.match(member):
        return False
    stem = wheel_name.split("-", 1)[0].lower()
    skip = _SKIP.get(stem)
    if skip is not None and skip.match(member):
        return False
    m = _KT_EXT.match(member)
    return not (m and not m.group("variant").startswith("amx"))


def unpack(wheels: list[Path], site: Path) -> dict[str, dict[str, int]]:
    sizes: dict[str, dict[str, int]] = {}
    for wheel in wheels:
        kept = left = 0
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                if not keep(wheel.name, info.filename):
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


def patch(site: Path) -> None:
    init = site / "sgl_kernel" / "__init__.py"
    text = init.read_text()
    if "_ktflow_missing" not in text:
        init.write_text(text + _SGL_KERNEL_PATCH.replace("NAMES", repr(FP4_PLACEHOLDERS)))
    fa3 = site / "sgl_kernel" / "flash_attn.py"
    text = fa3.read_text()
    if _FA3_IMPORT in text:
        fa3.write_text(text.replace(_FA3_IMPORT, _FA3_IMPORT_PATCHED) + _FA3_TAIL)
    elif _FA3_IMPORT_PATCHED not in text:
        raise SystemExit(f"{fa3}: its FA3 import is not the one this builder patches (another sglang-kernel?)")
    ipython = site / "IPython"
    ipython.mkdir(exist_ok=True)
    (ipython / "__init__.py").write_text(_IPYTHON_INIT)
    (ipython / "display.py").write_text(_IPYTHON_DISPLAY)


def write_shims(bundle: Path) -> None:
    (bundle / "site" / "sitecustomize.py").write_text(build_bundle._SITECUSTOMIZE)
    bin_dir = bundle / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text(build_bundle._PY_SHIM.replace("The KT training toolchain", "The SGLang serving "
                                                                   "toolchain"))
    for name, (module, func) in ENTRY_POINTS.items():
        (bin_dir / name).write_text(build_bundle._ENTRY.format(module=module, func=func, name=name))
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def pack(bundle: Path, parts_dir: Path, part_mib: int) -> list[Path]:
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    buf = io.BytesIO()
    # xz, not gzip: 35 MB instead of 51 (sgl_kernel's sm90 ops, tokenizers and transformers' sources compress
    # much better), which leaves room in a 64 MiB call for the checkout, the inputs and an adapter.
    with tarfile.open(fileobj=buf, mode="w:xz", preset=6) as tar:
        tar.add(bundle, arcname=bundle.name, filter=_reproducible)
    data = buf.getvalue()
    size = part_mib << 20
    parts = []
    for i in range(0, len(data), size):
        part = parts_dir / f"serve.tar.xz.{i // size:02d}"
        part.write_bytes(data[i:i + size])
        parts.append(part)
    (parts_dir / "serve.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  serve.tar.xz\n")
    return parts


def _reproducible(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="print the pinned requirements and exit")
    ap.add_argument("--part-mib", type=int, default=59)
    args = ap.parse_args()
    reqs = requirements()
    if args.check:
        print("\n".join(reqs))
        return 0
    wheels = download(reqs)
    shutil.rmtree(SERVE, ignore_errors=True)
    site = SERVE / "site"
    site.mkdir(parents=True)
    sizes = unpack(wheels, site)
    patch(site)
    build_bundle.add_ktflow(site)
    write_shims(SERVE)
    (SERVE / "requirements.txt").write_text("\n".join(reqs) + "\n")
    (SERVE / "unpacked_bytes.json").write_text(json.dumps(sizes, indent=1) + "\n")
    parts = pack(SERVE, PARTS, args.part_mib)
    total = sum(p.stat().st_size for p in parts)
    kept = sum(s["kept"] for s in sizes.values())
    print(f"serve bundle: {kept / 1e6:.0f} MB unpacked, {total / 1e6:.1f} MB packed in {len(parts)} part(s) under "
          f"{PARTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
