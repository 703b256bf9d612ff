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
  same ``sitecustomize`` as the training bundle (gpu_host/bundle.py writes both).

Self-contained: with the host's python3 it runs ``sglang.launch_server`` and ktflow (render the launch,
``convert-lora``), with or without the training bundle beside it. Built by gpu_host/bundle.py: wheels are
downloaded once into ``.cache/gpu-host/serve-wheels`` (the training bundle's ``.cache/gpu-host/wheels`` is
reused where it holds the pinned file), unpacked into ``build/gpu-host/serve`` and packed as
``build/gpu-host/serve-parts/serve.tar.xz.NN`` (each at most ``--part-mib`` MiB) + ``serve.sha256``
(gpu_host/run.sh serve-setup unpacks it with the host's python3, checking the sha256).

    .venv/bin/python gpu_host/build_serve_bundle.py           # download (if needed), unpack, trim, pack
    .venv/bin/python gpu_host/build_serve_bundle.py --check   # print the pinned requirements
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bundle  # noqa: E402  (the builder both GPU-host bundles share)

CONSTRAINTS = bundle.REPO / "constraints" / "sglang-gpu-host.txt"

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


SERVE = bundle.Bundle(
    name="serve", parts="serve-parts", toolchain="SGLang serving toolchain", requirements=requirements,
    # the training bundle's cache is reused where it holds the pinned file
    caches=(bundle.CACHE / "serve-wheels", bundle.CACHE / "wheels"),
    # xz, not gzip: 35 MB instead of 51 (sgl_kernel's sm90 ops, tokenizers and transformers' sources compress
    # much better), which leaves room in a 64 MiB call for the checkout, the inputs and an adapter.
    compression="xz", part_mib=59,
    platforms=(*bundle.MANYLINUX, "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_5_x86_64"),
    skip={
        "sglang_kt": re.compile(r"^sglang/multimodal_gen/"),
        # FA3 (1.7 GB), Blackwell build, FlashMLA: not used with --attention-backend triton on Hopper
        "sglang_kernel": re.compile(r"^sgl_kernel/(flash_ops\.|flashmla_ops\.|sm100/)"),
        "kt_kernel": bundle.KT_KERNEL_ONLY,
    },
    entry_points={"ktflow": ("ktflow.cli", "main")},
    patch=patch,
    build_sdists=True,  # rouge-score is an sdist only (pure Python)
    record_left_out=True,  # what each trim saved
)


if __name__ == "__main__":
    sys.exit(bundle.main(SERVE, __doc__))
