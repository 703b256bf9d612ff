"""Fit ktflow's serving decode model (CostModel.serve_decode_*) from measured runs, and check it on a run not used.

One sequence's decode at concurrency 1 is modelled, a token, as

    seconds = token_s[mode] + floors[mode] * floor_s

where ``floor_s`` is the time to read the routed experts one token activates, as stored, once at the read bandwidth
the plan models for the serving threads (``host_rate(kt_read_gb_s, threads)``, capped): the same figure for every
run below, since they all ran at ktflow serve's default threads (14 on 16 cores) on machines of one kind. The
per-run bandwidth measured before each server is not used: on one machine the server that decoded fastest had the
lowest (depth 2: base 111.5 tokens/s at 87.6 GB/s, the LoRA path 65.3 at 107.2), so it adds noise, not signal.
``lora`` is KT's LoRA path (CUDA graphs forced off); ``merged`` a server without LoRA flags (merged weights, or the
base model), CUDA graphs on.

- lora: the Kimi-K2.5 slice at 1 and 2 MoE layers (two H200 + 16-core machines), solved exactly. No LoRA-path run
  at the default threads is left to check it.
- merged: the merged and the base slice at 1 and 2 MoE layers on the same two machines, least squares over the
  four. Checked on runs not used, at 1 MoE layer: the merged slice on a third machine (the levers' baseline), on
  a fourth the two starts of the default settings in its levers step (the second with prefill chunks of 4096, which
  no prompt reached), and on a fifth the default settings' three starts and the slice merged as AMXINT4 and AMXINT8
  (its methods step: the floor is each method's bytes), and on a sixth the base and merged slices started in turn,
  two starts each, and the engine levers' baseline. At 2 MoE layers: on a seventh machine the base and merged slices
  started in turn, three starts each. Servers with GPU experts are not checks: the model has no term for them.

    .venv/bin/python benchmarks/serve_decode_model.py    # prints the fit and the check, writes decode-model.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ktflow.planning.costs import COSTS, SERVE_BYTES_PER_PARAM, host_rate

DATA = Path(__file__).resolve().parent / "data"
SERVING = DATA / "merged-serving"
OUT = SERVING / "decode-model.json"
THREADS = 14  # ktflow serve's default on these 16-core hosts (the physical cores less 2); each run's argv says so


def _point(path: Path, what: str) -> dict[str, float | str]:
    """A run's decode at concurrency 1 and its floor at the plan's modelled bandwidth for ``THREADS``."""
    doc = json.loads(path.read_text())
    server = json.loads(path.with_name(path.name.replace("-load.json", ".json")).read_text())
    argv = server["argv"]
    threads = int(argv[argv.index("--kt-cpuinfer") + 1])
    if threads != THREADS:
        raise SystemExit(f"{path}: served with {threads} KT threads, not the default {THREADS} this fit is for")
    level = next(lv for lv in doc["levels"] if lv["concurrency"] == 1)
    floor = doc["floor"]
    dims = doc["model_dims"]
    active = (dims["moe_layers"] * dims["num_experts_per_tok"] * 3 * dims["hidden_size"]
              * dims["moe_intermediate_size"] * SERVE_BYTES_PER_PARAM[floor["kt_method"]])
    read = min(host_rate(COSTS.kt_read_gb_s, THREADS), COSTS.serve_read_gb_s_ceiling)
    return {"what": what, "file": str(path.relative_to(DATA.parent.parent)), "moe_layers": dims["moe_layers"],
            "decode_tokens_per_s": level["decode_tokens_per_s_median"],
            "token_ms": 1e3 / level["decode_tokens_per_s_median"], "floor_ms": active / (read * 1e9) * 1e3,
            "read_gb_s_modelled": read, "read_gb_s_measured": floor["read_gb_s"]}


def _fit(points: list[dict]) -> dict[str, float]:
    """token_ms and floors by least squares (exact for two points)."""
    a = np.array([[1.0, p["floor_ms"]] for p in points])
    (token_ms, floors), *_ = np.linalg.lstsq(a, np.array([p["token_ms"] for p in points]), rcond=None)
    return {"token_ms": float(token_ms), "floors": float(floors)}


def _predict(fit: dict[str, float], point: dict) -> float:
    return fit["token_ms"] + fit["floors"] * point["floor_ms"]


def main() -> int:
    one, two = SERVING / "side-by-side" / "servers", SERVING / "h200-depth2" / "servers"
    lora = [_point(one / "load-lora-load.json", "Kimi slice, 1 MoE layer, LoRA path (H200 machine A)"),
            _point(two / "load-lora-load.json", "Kimi slice, 2 MoE layers, LoRA path (H200 machine C)")]
    merged = [_point(one / "load-merged-load.json", "Kimi slice, 1 MoE layer, merged (machine A)"),
              _point(one / "load-base-load.json", "Kimi slice, 1 MoE layer, base model (machine A)"),
              _point(two / "load-merged-load.json", "Kimi slice, 2 MoE layers, merged (machine C)"),
              _point(two / "load-base-load.json", "Kimi slice, 2 MoE layers, base model (machine C)")]
    four = SERVING / "h200-gpu-levers" / "servers"
    five = SERVING / "h200-methods" / "servers"
    left_out = [_point(SERVING / "h200-formats-and-levers" / "servers" / "lever-engine-baseline-load.json",
                       "Kimi slice, 1 MoE layer, merged, the levers' baseline (machine B; 3 x 256 tokens)"),
                _point(four / "lever-gpu-baseline-load.json",
                       "Kimi slice, 1 MoE layer, merged, the gpu levers' baseline (machine D; 3 x 256 tokens)"),
                _point(four / "lever-gpu-chunked-prefill-4096-load.json",
                       "Kimi slice, 1 MoE layer, merged, prefill chunks 4096: the baseline's second start "
                       "(machine D; 3 x 256 tokens, no prompt over 512)"),
                _point(five / "lever-methods-baseline-load.json",
                       "Kimi slice, 1 MoE layer, merged, the methods levers' baseline (machine E; 3 x 256 tokens)"),
                _point(five / "lever-methods-baseline-again-load.json",
                       "Kimi slice, 1 MoE layer, merged, the same settings started again (machine E; 3 x 256 tokens)"),
                _point(five / "lever-gpu-baseline-again-load.json",
                       "Kimi slice, 1 MoE layer, merged, the same settings started a third time (machine E; "
                       "3 x 256 tokens)"),
                _point(five / "lever-methods-AMXINT4-load.json",
                       "Kimi slice, 1 MoE layer, merged as AMXINT4 (machine E; 3 x 256 tokens)"),
                _point(five / "lever-methods-AMXINT8-load.json",
                       "Kimi slice, 1 MoE layer, merged as AMXINT8: 1.78x RAWINT4's bytes a token (machine E; "
                       "3 x 256 tokens)")]
    six = SERVING / "h200-alternate" / "servers"
    left_out += [_point(six / f"alternate-{n}-{what}-load.json",
                        f"Kimi slice, 1 MoE layer, the {what} model's {turn} start of two, the two models started "
                        f"in turn (machine F; 3 x 256 tokens)")
                 for n, what, turn in ((1, "base", "first"), (2, "merged", "first"), (3, "base", "second"),
                                       (4, "merged", "second"))]
    left_out.append(_point(six / "lever-engine-baseline-load.json",
                           "Kimi slice, 1 MoE layer, merged, the engine levers' baseline (machine F; 3 x 256 tokens)"))
    seven = SERVING / "h200-depth2-alternate"
    left_out += [_point(seven / "servers" / f"alternate-{n}-{what}-load.json",
                        f"Kimi slice, 2 MoE layers, the {what} model's {turn} start of two, the two models started "
                        f"in turn (machine G; 3 x 256 tokens)")
                 for n, what, turn in ((1, "base", "first"), (2, "merged", "first"), (3, "base", "second"),
                                       (4, "merged", "second"))]
    left_out += [_point(seven / "again" / "servers" / f"alternate-{n}-{what}-load.json",
                        f"Kimi slice, 2 MoE layers, the {what} model started a third time, merged first "
                        f"(machine G; 3 x 256 tokens)")
                 for n, what in ((1, "merged"), (2, "base"))]
    fits = {"lora": _fit(lora), "merged": _fit(merged)}
    predicted = [_predict(fits["merged"], c) for c in left_out]
    checks = [{"mode": "merged", "run": c["what"], "file": c["file"], "moe_layers": c["moe_layers"],
               "measured_ms": c["token_ms"],
               "predicted_ms": ms, "measured_over_predicted": c["token_ms"] / ms} for c, ms in zip(left_out, predicted)]
    doc = {"model": "seconds a token = token_s[mode] + floors[mode] x floor_s (floor_s at the plan's modelled "
                    f"read bandwidth for {THREADS} threads)",
           "threads": THREADS, "lora": {"fit": fits["lora"], "runs": lora},
           "merged": {"fit": fits["merged"], "runs": merged}, "checks_not_used_to_fit": checks,
           "not_checked": "lora: no LoRA-path run at the default threads is left out of its fit"}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    for mode, fit in fits.items():
        print(f"{mode:7s} token {fit['token_ms']:.2f} ms + {fit['floors']:.3f} floors")
    for c in checks:
        print(f"check {c['mode']:7s} {c['run']}: measured {c['measured_ms']:.2f} ms, predicted "
              f"{c['predicted_ms']:.2f} ms, measured/predicted {c['measured_over_predicted']:.3f}")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
