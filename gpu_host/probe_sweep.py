#!/usr/bin/env python3
"""The KT probe swept on a GPU host: how its ratio to the time model moves with its settings, beside what the host's
own KT runs needed.

``ktflow plan`` scales an uncalibrated KT step by the probe (:mod:`ktflow.planning.host_probe`): kt-kernel's SFT
kernels timed on one MoE layer of synthetic experts, sized to defeat the caches (22 of Kimi-K2.5's experts), at the
recipe's bound on the tokens a pass carries (29 tokens over those 22 at the slice's cutoff 512). On a 64-core host
its ratio came out 1.25, 1.41 and 1.59 on three runs, and it scaled a batch of 8 x 1 (3,623 tokens a micro-batch)
well and the batch as written (1 x 8) 49 % slow, while the runs themselves needed x1.20 and x0.91 on the model's
CPU passes (``benchmarks/data/plan-probe/reference.json``). This sweep measures, on one host, what the probe's ratio
depends on: repeats (its noise), the synthetic experts' count (22 leave most of 64 threads idle; the real layer has
384) and the tokens a pass carries (the recipe's bound, or the shaper's micro-batch), each point timed by the
product's own :func:`~ktflow.planning.host_probe.run_probe` and predicted by its
:func:`~ktflow.planning.host_probe.probe_model_seconds`.

Run from the repository root after ``bash gpu_host/run.sh setup`` (``run.sh probe-sweep``); points already in the
results are skipped, so a second run goes on where a cut one stopped:

    build/gpu-host/bundle/bin/python gpu_host/probe_sweep.py [--threads 64] [--points as-shipped,all-experts-bound]

Output: ``build/gpu-host/probe-sweep/<machine digest>.json``, one record a probe (its settings, forward and backward
medians, setup and wall time, the model's seconds and the ratio).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ktflow.errors import KtflowError  # noqa: E402
from ktflow.fixtures.stream import KIMI_K25  # noqa: E402
from ktflow.host.hardware import probe_host  # noqa: E402
from ktflow.planning.host_probe import (  # noqa: E402
    KtProbeSettings,
    probe_model_seconds,
    probe_settings,
    run_probe,
)
from ktflow.planning.sizing import ModelSize  # noqa: E402
from ktflow.recipe import SftConfig, load_recipe  # noqa: E402

RECIPE = REPO / "gpu_host" / "slice-kt-rawint4.yaml"
OUT = REPO / "build" / "gpu-host" / "probe-sweep"
SHAPED_TOKENS = 3623  # the slice's 8 x 1 micro-batch (8 records of ~314 tokens padded to the longest)

# name -> (synthetic experts, or None for the product's count; tokens a pass over the whole model's experts, or None
# for the recipe's bound; repeats). In the order they are measured: the most telling first, so a cut run still
# answers something.
POINTS: dict[str, tuple[int | None, int | None, int]] = {
    "as-shipped": (None, None, 3),
    "all-experts-bound": (384, None, 2),
    "all-experts-shaped": (384, SHAPED_TOKENS, 2),
    "128-experts-bound": (128, None, 2),
    "128-experts-shaped": (128, SHAPED_TOKENS, 2),
    "as-shipped-shaped": (None, SHAPED_TOKENS, 2),
}


def kimi_slice_size(moe_layers: int = 1) -> ModelSize:
    """Kimi-K2.5's expert geometry at ``moe_layers`` MoE layers (what the probe's settings read of a model)."""
    dims = KIMI_K25
    experts = moe_layers * dims.experts * 3 * dims.hidden * dims.moe_intermediate
    return ModelSize(path="kimi-k2.5-slice", parameters=experts, hidden_size=dims.hidden, num_layers=moe_layers + 1,
                     vocab_size=dims.vocab, linear_shapes={}, expert_parameters=experts, moe_layers=moe_layers,
                     routed_experts=dims.experts, experts_per_token=dims.experts_per_tok)


def point_settings(sft: SftConfig, threads: int, experts: int | None, tokens: int | None) -> KtProbeSettings:
    """The product's probe settings for the slice recipe at ``threads``, with the synthetic experts' count and the
    tokens a pass carries (over the model's 384 experts, shared out in proportion to the probe's) replaced."""
    shipped = probe_settings(sft, kimi_slice_size(), threads)
    assert shipped is not None
    count = experts or shipped.experts
    whole_pass = tokens if tokens is not None else sft.cutoff_len * sft.per_device_train_batch_size
    return shipped.model_copy(update={"experts": count,
                                      "tokens": max(1, round(whole_pass * count / KIMI_K25.experts))})


def sweep(names: list[str], threads: int, out: Path, python: Path, machine: str) -> list[dict[str, Any]]:
    """Measure each named point (its repeats) not yet in ``out`` on ``machine`` (this one's ``HostInfo.machine``);
    returns every record in ``out``."""
    sft = load_recipe(RECIPE).sft
    records: list[dict[str, Any]] = json.loads(out.read_text()) if out.is_file() else []
    for name in names:
        experts, tokens, repeats = POINTS[name]
        settings = point_settings(sft, threads, experts, tokens)
        done = sum(1 for r in records if r["point"] == name and r["settings"] == settings.model_dump())
        for repeat in range(done, repeats):
            started = time.monotonic()
            try:
                probe = run_probe(settings, machine, python, toolchain="bundle")
            except KtflowError as exc:  # the toolchain's fault, not the machine's: nothing to record, stop here
                raise SystemExit(f"{name} #{repeat + 1}: the probe could not run in {python}: {exc}") from None
            model = probe_model_seconds(settings, sft)
            record = {"point": name, "repeat": repeat, "settings": settings.model_dump(), "status": probe.status,
                      "reason": probe.reason, "forward_s": probe.forward_s, "backward_s": probe.backward_s,
                      "pairs": probe.pairs, "weight_bytes": probe.weight_bytes, "setup_s": probe.setup_s,
                      "wall_s": probe.wall_s, "model_s": model,
                      "ratio": probe.seconds / model if probe.seconds is not None else None}
            record.update(machine=machine, seconds=round(time.monotonic() - started, 1))
            records.append(record)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(records, indent=1) + "\n")
            tmp.replace(out)
            print(f"{name} #{repeat + 1}: {settings.describe()}: "
                  + (f"ratio {record['ratio']:.3f} (forward {probe.forward_s * 1e3:.1f} ms, backward "
                     f"{probe.backward_s * 1e3:.1f} ms, model {model * 1e3:.1f} ms)" if record["ratio"] is not None
                     else f"not measured: {probe.reason}"), flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="KT threads (default: every physical core)")
    parser.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, of: {', '.join(POINTS)}")
    parser.add_argument("--python", default=sys.executable, help="the python with kt-kernel (the training bundle's)")
    parser.add_argument("--out", type=Path, default=None, help="the results file (default: one a machine)")
    args = parser.parse_args(argv)
    names = [n for n in args.points.split(",") if n]
    unknown = [n for n in names if n not in POINTS]
    if unknown:
        parser.error(f"unknown point(s) {', '.join(unknown)}: choose from {', '.join(POINTS)}")
    host = probe_host()
    threads = args.threads or host.physical_cores
    out = args.out or OUT / f"{hashlib.sha256(host.machine.encode()).hexdigest()[:16]}-t{threads}.json"
    records = sweep(names, threads, out, Path(args.python), host.machine)
    print(f"{len(records)} probe(s) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
