#!/usr/bin/env python3
"""The host probe on a GPU host: kt-kernel's own SFT expert kernels timed as `ktflow plan` times them, at the shapes
of the models the KT step model was fitted on, so the reference the probe's scale needs (the machine of the fit's
measured / predicted ratio, ``CostModel.kt_probe_reference``) can be filled in, and the out-of-sample check made.

    PY=build/gpu-host/bundle/bin/python
    $PY gpu_host/probe.py [--threads 16] [--runs-store build/gpu-host/slice/store]   # or: gpu_host/run.sh probe

For each fitted model (benchmarks/kt_step_model.py's model 1, Kimi geometry, and model 2) and each method the fit
used (RAWINT4 from gpu_host/big-kt-rawint4.yaml, and BF16), it runs ktflow's probe (ktflow.planning.host_probe,
up to ~30 s each, in this python's toolchain) and writes build/gpu-host/results/probe-<hostname>.json: the host
(HostInfo.machine, ISA), each probe's raw figures (forward and backward seconds, weights, tokens), the time
model's prediction for it and the ratio. With ``--runs-store``, the KT runs that store holds for this machine
and recipe give their median measured / predicted step, and the reference this host implies is the probe's
ratio divided by it (a host where both were measured; several hosts of the fit's kind give the reference).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from ktflow.host.hardware import probe_host  # noqa: E402
from ktflow.planning.host_probe import probe_scale  # noqa: E402
from ktflow.planning.host_speed import host_records, kt_threads  # noqa: E402
from ktflow.recipe import load_recipe  # noqa: E402

RECIPE = REPO / "gpu_host/big-kt-rawint4.yaml"
BF16 = ["sft.kt_config.kt_backend=AMXBF16", "sft.kt_config.kt_expert_weight_format=bf16",
        "sft.kt_config.kt_share_backward_bb=null", "sft.kt_config.kt_force_fused_expert_lora=null"]


def main() -> int:
    import kt_step_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, help="KT threads (default: the recipe's, else every physical core)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds each probe may take")
    parser.add_argument("--store", default=str(REPO / "build/gpu-host/probe-store"),
                        help="where the probes are kept (a later plan with this store reuses them)")
    parser.add_argument("--runs-store", help="a store with KT runs on this machine: the reference this host implies")
    parser.add_argument("--methods", default="RAWINT4,BF16", help="which of the fit's methods to probe (comma-separated)")
    parser.add_argument("--out", default=str(REPO / "build/gpu-host/results"), help="results directory")
    args = parser.parse_args()

    sets = [f"store.root={args.store}", "sft.kt_config.kt_model_max_length=4096",
            f"toolchains.train.python={sys.executable}", f"toolchains.serve.python={sys.executable}"]
    if args.threads:
        sets.append(f"sft.kt_config.kt_num_threads={args.threads}")
    host = probe_host(args.store)
    rows = []
    for model, size in kt_step_model.model_sizes().items():
        for method, extra in (("RAWINT4", []), ("BF16", BF16)):
            if method not in args.methods.split(","):
                continue
            recipe = load_recipe(RECIPE, sets + extra)
            threads = kt_threads(recipe.sft, host.physical_cores)
            scale = probe_scale(recipe, size, host, threads, run=True, time_limit_s=args.time_limit)
            row = {"model": model, "method": method, "threads": threads, "factor": scale.factor,
                   "ratio": scale.ratio, "predicted_s": scale.predicted_s, "reference": scale.reference,
                   "basis": scale.basis, "probe": scale.probe.model_dump(mode="json") if scale.probe else None}
            if args.runs_store and scale.ratio:
                runs_recipe = load_recipe(RECIPE, [*sets[1:], f"store.root={args.runs_store}", *extra])
                runs = host_records(runs_recipe, host.hostname, threads, host.machine)
                if runs:
                    step_ratio = statistics.median(r.ratio for _, _, r in runs)
                    row["runs"] = {"names": [name for _, name, _ in runs], "step_ratio": step_ratio,
                                   "implied_reference": scale.ratio / step_ratio}
            print(json.dumps({k: v for k, v in row.items() if k != "probe"}), flush=True)
            rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"probe-{socket.gethostname()}.json"
    path.write_text(json.dumps({"hostname": host.hostname, "machine": host.machine, "cpu": host.describe_cpu(),
                                "gpus": [g.name for g in host.gpus], "probes": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
