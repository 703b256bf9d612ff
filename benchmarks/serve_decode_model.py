"""Fit ktflow's serving decode model (CostModel.serve_decode_*) from measured runs, and check it on runs not used.

One sequence's decode at concurrency 1 is modelled, a token, as

    seconds = token_s[mode] + moe_layers * layer_s[mode] + floors * floor_s

where ``floor_s`` is the time to read the routed experts one token activates, as stored, once at the read bandwidth
measured on the host just before the server started. ``lora`` is KT's LoRA path (CUDA graphs forced off);
``merged`` is a server without LoRA flags (merged weights, or the base model), CUDA graphs on.

- lora: three constants from three runs, solved exactly: the Kimi-K2.5 slice at 1 and 3 MoE layers (H100 + 16
  cores) and the 7-MoE-layer bigger-than-GPU model's AMXINT8 run (4 x H200, 64 cores). Checked on the same model's
  RAWINT4 run (not used).
- merged: ``floors`` shared with lora (the same bytes are read), two constants from the merged slice at 1 MoE layer
  and the base slice at 2 MoE layers with CUDA graphs on (an earlier run on another H100 + 16-core machine, whose
  raw data was not kept: 43.5 tokens/s; its floor taken at this run's bytes per MoE layer and median bandwidth).
  Checked on the base slice at 1 MoE layer (not used).

    .venv/bin/python benchmarks/serve_decode_model.py    # prints the fit and the checks, writes decode-model.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
OUT = DATA / "merged-serving" / "decode-model.json"

# The one input without raw data in the repository (see the module docstring).
EARLIER_BASE_2_LAYERS_GRAPHS_ON = {"moe_layers": 2, "decode_tokens_per_s": 43.5,
                                   "what": "Kimi-K2.5 slice, 2 MoE layers, base model, RAWINT4, CUDA graphs on, "
                                           "concurrency 1, 128 tokens, ignore_eos; H100 + 16-core host"}


def _point(path: Path, moe_layers: int, what: str) -> dict[str, float | str]:
    doc = json.loads(path.read_text())
    level = next(lv for lv in doc["levels"] if lv["concurrency"] == 1)
    floor = doc["floor"]
    return {"what": what, "file": str(path.relative_to(DATA.parent.parent)), "moe_layers": moe_layers,
            "decode_tokens_per_s": level["decode_tokens_per_s_median"],
            "token_ms": 1e3 / level["decode_tokens_per_s_median"],
            "floor_ms": 1e3 / floor["floor_tokens_per_s"], "read_gb_s": floor["read_gb_s"]}


def _predict(fit: dict[str, float], point: dict) -> float:
    return fit["token_ms"] + point["moe_layers"] * fit["layer_ms"] + fit["floors"] * point["floor_ms"]


def main() -> int:
    served = DATA / "merged-serving" / "serving" / "servers"
    lora = [_point(served / "load-lora-load.json", 1, "Kimi slice, 1 MoE layer, LoRA path, RAWINT4"),
            _point(DATA / "kimi-slice" / "moe3" / "results" / "serve-load-RAWINT4.json", 3,
                   "Kimi slice, 3 MoE layers, LoRA path, RAWINT4"),
            _point(DATA / "bigger-than-gpu-served" / "serve-load-AMXINT8.json", 7,
                   "bigger-than-GPU model, 7 MoE layers, LoRA path, AMXINT8")]
    lora_check = _point(DATA / "bigger-than-gpu-served" / "serve-load-RAWINT4.json", 7,
                        "bigger-than-GPU model, 7 MoE layers, LoRA path, RAWINT4")
    a = np.array([[1.0, p["moe_layers"], p["floor_ms"]] for p in lora])
    token_ms, layer_ms, floors = np.linalg.solve(a, np.array([p["token_ms"] for p in lora]))
    lora_fit = {"token_ms": float(token_ms), "layer_ms": float(layer_ms), "floors": float(floors)}

    merged = _point(served / "load-merged-load.json", 1, "Kimi slice, 1 MoE layer, merged RAWINT4, graphs on")
    base_check = _point(served / "load-base-load.json", 1, "Kimi slice, 1 MoE layer, base model, graphs on")
    # the earlier 2-layer run's floor: this run's routed-expert bytes a MoE layer, at this run's median bandwidth
    bytes_per_layer = merged["read_gb_s"] * merged["floor_ms"] / 1e3  # GB a token at 1 MoE layer
    bandwidth = statistics.median(p["read_gb_s"] for p in (merged, base_check, lora[0]))
    earlier = {**EARLIER_BASE_2_LAYERS_GRAPHS_ON, "file": None,
               "token_ms": 1e3 / EARLIER_BASE_2_LAYERS_GRAPHS_ON["decode_tokens_per_s"],
               "floor_ms": 2 * bytes_per_layer / bandwidth * 1e3, "read_gb_s": bandwidth}
    rest = [p["token_ms"] - floors * p["floor_ms"] for p in (merged, earlier)]
    m_layer = rest[1] - rest[0]  # 2 layers minus 1
    merged_fit = {"token_ms": rest[0] - m_layer, "layer_ms": m_layer, "floors": float(floors)}

    checks = []
    for name, fit, point in (("lora", lora_fit, lora_check), ("merged", merged_fit, base_check)):
        predicted = _predict(fit, point)
        checks.append({"mode": name, "run": point["what"], "file": point["file"], "measured_ms": point["token_ms"],
                       "predicted_ms": predicted, "measured_over_predicted": point["token_ms"] / predicted})
    doc = {"model": "seconds a token = token_s + moe_layers x layer_s + floors x floor_s",
           "lora": {"fit": lora_fit, "runs": lora}, "merged": {"fit": merged_fit, "runs": [merged, earlier]},
           "checks_not_used_to_fit": checks}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    for mode in ("lora", "merged"):
        fit = doc[mode]["fit"]
        print(f"{mode:7s} token {fit['token_ms']:.2f} ms + layer {fit['layer_ms']:.2f} ms + {fit['floors']:.3f} floors")
    for check in checks:
        print(f"check {check['mode']:7s} {check['run']}: measured {check['measured_ms']:.1f} ms, predicted "
              f"{check['predicted_ms']:.1f} ms, measured/predicted {check['measured_over_predicted']:.3f}")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
