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

Built by gpu_host/bundle.py: wheels are downloaded once into ``.cache/gpu-host/wheels`` (cp312,
manylinux_2_35 and older tags, ``--no-deps``: the list below is the whole closure), unpacked into
``build/gpu-host/bundle/site`` without the ``*_sgl_kernel_payload`` blobs (SGLang's kernels,
for serving only), and packed as ``build/gpu-host/parts/bundle.tar.gz.NN`` of at most
``--part-mib`` MiB each, so each part fits one device call's 64 MiB.

    .venv/bin/python gpu_host/build_bundle.py            # download (if needed), unpack, pack
    .venv/bin/python gpu_host/build_bundle.py --check    # list what would be fetched
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bundle  # noqa: E402  (the builder both GPU-host bundles share)

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


def requirements() -> list[str]:
    pins = bundle.pinned(bundle.REPO / "constraints" / "kt-train.txt")
    reqs = []
    for name, fallback in PACKAGES.items():
        version = pins.get(bundle.norm(name), fallback)
        if version is None:
            raise SystemExit(f"{name}: no pin in constraints/kt-train.txt and none in build_bundle.PACKAGES")
        reqs.append(f"{name}=={version}")
    return reqs


TRAINING = bundle.Bundle(
    name="bundle", parts="parts", toolchain="KT training toolchain", requirements=requirements,
    caches=(bundle.CACHE / "wheels",),
    compression="gz", part_mib=60,
    skip={"kt_kernel": bundle.KT_KERNEL_ONLY},
    entry_points={
        "llamafactory-cli": ("llamafactory.cli", "main"),
        "accelerate": ("accelerate.commands.accelerate_cli", "main"),
        "ktflow": ("ktflow.cli", "main"),
    },
    # as this bundle has always been built: gzip stamps the time into the archive, so zeroed tar headers
    # would not make its sha256 repeatable anyway
    reproducible=False,
)


if __name__ == "__main__":
    sys.exit(bundle.main(TRAINING, __doc__))
