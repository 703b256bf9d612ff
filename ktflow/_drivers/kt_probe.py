"""kt-kernel's own SFT expert kernels timed on synthetic weights: the host probe, run inside a KT toolchain.

Started by :func:`ktflow.planning.host_probe.run_probe` as::

    <toolchain python> -m ktflow._drivers.kt_probe --plan PLAN.json --out RESULT.json

with ``PYTHONPATH`` naming a directory that holds only the ``ktflow`` package. It imports the standard
library, torch and kt_kernel, never pydantic. The plan (JSON, written by the orchestrator) says the
kt-kernel SFT method, the expert shape (hidden, moe_intermediate, experts, top-k), the tokens, KT threads
and NUMA pools, the LoRA rank and the time limit; this program makes no decisions about a recipe.

What it does: builds one layer of kt-kernel's SFT MoE wrapper (``KTMoEWrapper(mode="sft")``, as KT's SFT
wrapping builds each MoE layer) over synthetic weights in the method's own format (BF16 tensors, Kimi
RAWINT4 packed nibbles with BF16 group scales, or block FP8), sized by the orchestrator to defeat the
CPU caches, gives it LoRA weights and times ``forward(save_for_backward=True)`` and ``backward`` over
random tokens with random top-k routing: one warm-up pair, then pairs until the time limit. The weights
are tiled from a small random block: what the kernels cost depends on the bytes and shapes, not on the
values, and filling gigabytes with fresh random numbers would spend the time limit.

The result (one JSON object, written to ``--out`` under a temporary name and renamed) is either
``{"status": "ok", ...}`` with every forward's and backward's seconds, ``{"status": "skipped",
"reason": ...}`` where kt-kernel cannot run the method on this machine (the loaded build has no SFT
kernels, the method needs pre-quantized files the probe does not make), or ``{"status": "unavailable",
"reason": ...}`` where kt-kernel does not import in this toolchain. Exit status 0 either way; anything else
is a failure the orchestrator reports with this program's output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# kt-kernel's SFT kernels are built into these variants only (kt_kernel/_cpu_detect.py, 0.7.x).
SFT_VARIANTS = ("amx", "avx512_bf16")
# Methods whose synthetic weights this probe makes; others are skipped with the reason.
PROBED_METHODS = ("AMXBF16_SFT", "AMXINT4_SFT", "RAWINT4_SFT", "AMXFP8_SFT")
UNPROBED_REASONS = {
    "INT8_SFT": "kt-kernel's INT8 SFT reads pre-quantized .kt experts only; the probe does not make them",
    "MXFP4_SFT": "kt-kernel's MXFP4 SFT needs a model's swiglu limit and native MXFP4 experts; the probe does not "
                 "make them",
}
_BLOCK = 1 << 22  # elements of the random block the weights are tiled from


def _write(out: Path, result: dict[str, Any]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
    os.replace(tmp, out)


def _tiled(shape: tuple[int, ...], dtype: Any, make: Callable[[int], Any]) -> Any:
    """A contiguous tensor of ``shape`` filled by repeating ``make(n)`` (a flat random block)."""
    import torch

    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    block = make(min(flat.numel(), _BLOCK)).to(dtype)
    for start in range(0, flat.numel(), block.numel()):
        end = min(start + block.numel(), flat.numel())
        flat[start:end].copy_(block[: end - start])
    return out


def _bf16(shape: tuple[int, ...]) -> Any:
    import torch

    return _tiled(shape, torch.bfloat16, lambda n: torch.randn(n) * 0.02)


def _load_weights(wrapper: Any, method: str, experts: int, hidden: int, inter: int) -> int:
    """Synthetic experts in ``method``'s format handed to ``wrapper``; returns their bytes as stored."""
    import torch

    ids = torch.arange(experts, dtype=torch.int64)
    if method == "RAWINT4_SFT":
        from kt_kernel.sft.weights import RAWINT4ExpertWeights

        def packed(rows: int, cols: int) -> tuple[Any, Any]:
            weight = _tiled((experts, rows, cols // 2), torch.uint8, lambda n: torch.randint(0, 256, (n,)))
            scale = _tiled((experts, rows, cols // 32), torch.bfloat16, lambda n: torch.rand(n) * 0.01 + 1e-3)
            return weight, scale

        (gate, gate_s), (up, up_s), (down, down_s) = packed(inter, hidden), packed(inter, hidden), packed(hidden, inter)
        wrapper.load_rawint4_weights(RAWINT4ExpertWeights(gate_proj=gate, gate_scale=gate_s, up_proj=up,
                                                          up_scale=up_s, down_proj=down, down_scale=down_s,
                                                          group_size=32), ids)
        return sum(t.numel() * t.element_size() for t in (gate, gate_s, up, up_s, down, down_s))
    if method == "AMXFP8_SFT":
        from kt_kernel.sft.weights import BlockFP8ExpertWeights

        def fp8(rows: int, cols: int) -> tuple[list[Any], list[Any]]:
            stacked = _tiled((experts, rows, cols), torch.float8_e4m3fn, lambda n: torch.randn(n).clamp(-4, 4))
            scales = _tiled((experts, rows // 128, cols // 128), torch.float32, lambda n: torch.rand(n) * 0.01 + 1e-3)
            return list(stacked.unbind(0)), list(scales.unbind(0))

        (gate, gate_s), (up, up_s), (down, down_s) = fp8(inter, hidden), fp8(inter, hidden), fp8(hidden, inter)
        wrapper.load_block_fp8_weights(BlockFP8ExpertWeights(gate_proj=gate, gate_scale=gate_s, up_proj=up,
                                                             up_scale=up_s, down_proj=down, down_scale=down_s), ids)
        return 3 * experts * hidden * inter + sum(s.numel() * 4 for s in (*gate_s, *up_s, *down_s))
    gate, up, down = _bf16((experts, inter, hidden)), _bf16((experts, inter, hidden)), _bf16((experts, hidden, inter))
    wrapper.load_weights_from_tensors(gate, up, down, ids)
    return 3 * experts * hidden * inter * 2


def _skip(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


def _runtime() -> tuple[str, str]:
    """kt-kernel's version and the CPU variant its loaded extension was built for."""
    import importlib.metadata

    import kt_kernel

    variant = str(getattr(kt_kernel.kt_kernel_ext, "__cpu_variant__", "unknown")).lower()
    try:
        version = importlib.metadata.version("kt-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(kt_kernel, "__version__", "unknown")
    return version, variant


def probe(plan: dict[str, Any]) -> dict[str, Any]:
    """Time kt-kernel's SFT forward and backward for ``plan``; the result document (see the module doc)."""
    started = time.monotonic()
    method = plan["method"]
    try:
        version, variant = _runtime()
    except ImportError as exc:  # the toolchain, not this machine: "unavailable" is not kept as the machine's result
        return {"status": "unavailable", "reason": f"kt-kernel does not import ({str(exc).splitlines()[0]})"}
    facts = {"kt_kernel": version, "cpu_variant": variant}
    if variant not in SFT_VARIANTS:
        return {**_skip(f"kt-kernel loaded its {variant} build; its SFT kernels exist only in the "
                        f"{' and '.join(SFT_VARIANTS)} builds (this CPU lacks AVX512-BF16 and AMX)"), **facts}
    if method in UNPROBED_REASONS or method not in PROBED_METHODS:
        return {**_skip(UNPROBED_REASONS.get(method, f"the probe does not make weights for {method}")), **facts}
    from kt_kernel.sft import amx

    if amx._SFT_METHOD_TO_CLASS.get(method) is None:
        return {**_skip(f"this kt-kernel build has no {method} kernels"), **facts}

    import torch
    from kt_kernel.experts import KTMoEWrapper

    torch.set_num_threads(1)  # kt-kernel's own pool does the work; torch's threads would contend for the cores
    experts, top_k, hidden, inter = plan["experts"], plan["top_k"], plan["hidden"], plan["moe_intermediate"]
    tokens, rank = plan["tokens"], plan["lora_rank"]
    quantized = method in ("RAWINT4_SFT", "AMXFP8_SFT")
    wrapper = KTMoEWrapper(
        layer_idx=0, num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
        moe_intermediate_size=inter, gpu_experts_mask=None, num_gpu_experts=0, cpuinfer_threads=plan["threads"],
        threadpool_count=plan["pools"], weight_path="", chunked_prefill_size=tokens, method=method, mode="sft",
        lora_rank=rank, lora_alpha=float(plan["lora_alpha"]), lora_dropout=0.0, max_cache_depth=1,
        group_size=32 if method == "RAWINT4_SFT" else 128, zero_point=not quantized)
    # Read while kt-kernel builds its C++ config, as KT's SFT wrapping sets it per layer.
    wrapper.share_backward_bb = bool(plan["share_backward_bb"])
    weight_bytes = _load_weights(wrapper, method, experts, hidden, inter)
    lora = [_bf16(s) for s in ((experts, rank, hidden), (experts, inter, rank), (experts, rank, hidden),
                                (experts, inter, rank), (experts, rank, inter), (experts, hidden, rank))]
    wrapper.init_lora_weights(*lora, *[torch.zeros_like(t) for t in lora])
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, hidden, generator=generator)).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=1)
    grad = (torch.randn(tokens, hidden, generator=generator) * 0.01).to(torch.bfloat16)
    setup_s = time.monotonic() - started

    def pair() -> tuple[float, float]:
        t0 = time.perf_counter()
        wrapper.forward(x, ids, weights, save_for_backward=True)
        t1 = time.perf_counter()
        wrapper.backward(grad)
        return t1 - t0, time.perf_counter() - t1

    warmup = pair()
    forward, backward = [], []
    limit, most = float(plan["time_limit_s"]), int(plan.get("max_pairs", 50))
    while len(forward) < most:
        f, b = pair()
        forward.append(f)
        backward.append(b)
        if time.monotonic() - started + f + b > limit:
            break
    return {"status": "ok", **facts, "forward_s": forward, "backward_s": backward,
            "forward_median_s": statistics.median(forward), "backward_median_s": statistics.median(backward),
            "warmup_s": sum(warmup), "setup_s": round(setup_s, 3), "weight_bytes": weight_bytes,
            "active_experts": int(torch.unique(ids).numel()), "wall_s": round(time.monotonic() - started, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="the probe's settings (JSON), written by the orchestrator")
    parser.add_argument("--out", required=True, help="where the result (JSON) is written")
    args = parser.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text(encoding="utf-8"))
    result = probe(plan)
    _write(Path(args.out), result)
    print(f"KTFLOW-PROBE {json.dumps({k: v for k, v in result.items() if not isinstance(v, list)})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
