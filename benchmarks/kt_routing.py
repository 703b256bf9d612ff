"""The shaper's gain and the experts a micro-batch reaches: KT's own timers against the shipped step model.

    .venv/bin/python benchmarks/kt_routing.py             # print the tables, write routing.json
    .venv/bin/python benchmarks/kt_routing.py --no-write  # print only

The step model (:func:`ktflow.planning.costs.kt_step_estimate`) counts a micro-batch's token-independent
cost per routed expert it reaches, and assumes balanced routing: a micro-batch of T tokens with top-k of
E experts reaches E x (1 - (1 - k/E)^T) of them (383.6 of 384 at 331 tokens). kt-kernel counts the
experts each call reached (``active_experts`` in its timers, ``KT_SFT_PROFILE=1``). This script sets
the two side by side on every profiled run, and predicts each run twice with the constants as shipped:
under balanced routing (what ``ktflow plan`` prints) and given the run's own count (the model's cost
per expert, with the routing taken from the run). Nothing is fitted here.

Runs: the fit's own (``benchmarks/data/kt-throughput``, model 1 at 180 experts, model 2 at 256), and the
runs of ``benchmarks/data/plan-probe/routing/`` (the Kimi-K2.5 slice at 384 experts and model 3 at 96,
the same chat records; ``gpu_host/throughput.py run``), which no fit has used. Pairs of splits trained on
one machine give the shaper's gain, measured and predicted both ways. Writes
``benchmarks/data/plan-probe/routing.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from kt_out_of_sample import sft_of  # noqa: E402
from kt_step_model import load_runs  # noqa: E402

from ktflow.planning.costs import COSTS, kt_step_estimate  # noqa: E402
from ktflow.planning.sizing import ModelSize  # noqa: E402

ROUTING = REPO / "benchmarks/data/plan-probe/routing"
OUT = REPO / "benchmarks/data/plan-probe/routing.json"
# Pairs of runs on one machine: (machine folder, the split as written, the faster split).
PAIRS = (("h200-16-cores-e", "k3-written", "k3-shaped"), ("h200-16-cores-e", "m3-written", "m3-shaped"),
         ("h200-16-cores-f", "k3-b2x4", "k3-b4x2"))


def active_per_call(profile: dict[str, Any]) -> float:
    """Routed experts a call reached, averaged over the MoE layers and calls (kt-kernel's own count)."""
    layers = profile["profile"]["layers"].values()
    return statistics.fmean(v["tp.0.active_experts"] / v["tp.0.forward.total.calls"] for v in layers)


def _point(name: str, where: str, size: ModelSize, sft, threads: int, tokens: float, measured: dict[str, float],
           active: float) -> dict[str, Any]:
    balanced = kt_step_estimate(size, sft, threads, COSTS, tokens)
    given = kt_step_estimate(size, sft, threads, COSTS, tokens, active_experts=active)
    kt_measured = measured["forward"] + measured["backward"]
    return {
        "run": name, "where": where, "experts": size.routed_experts, "tokens_per_micro_batch": tokens,
        "micro_batches": sft.gradient_accumulation_steps, "active_measured": round(active, 1),
        "active_balanced": round(balanced.active_experts, 1), "step_s": measured["step"], "kt_s": round(kt_measured, 2),
        "kt_balanced_s": round(balanced.kt_forward_s + balanced.kt_backward_s, 2),
        "kt_given_active_s": round(given.kt_forward_s + given.kt_backward_s, 2),
        "step_balanced_s": round(balanced.step_s, 2), "step_given_active_s": round(given.step_s, 2),
    }


def fit_points() -> list[dict[str, Any]]:
    """The step model's own runs (their KT timers are what it was fitted on)."""
    data = REPO / "benchmarks/data/kt-throughput"
    points = []
    for run in load_runs(data):
        profile = json.loads((data / f"{run['name']}.kt_profile.json").read_text())
        points.append(_point(run["name"], "fit" if not run["held_out"] else "fit's held-out", run["size"], run["sft"],
                             run["threads"], run["tokens"],
                             {"forward": run["forward"], "backward": run["backward"], "step": run["step"]},
                             active_per_call(profile)))
    return points


def check_points() -> list[dict[str, Any]]:
    """The routing runs, which no fit has used."""
    points = []
    for path in sorted(ROUTING.glob("*/*.kt_profile.json")):
        name = path.name.removesuffix(".kt_profile.json")
        run = json.loads((path.parent / f"{name}.json").read_text())
        size = ModelSize(**run["plan"]["model"], linear_shapes={})
        kt = run["kt_timers"]["kt_moe_s_per_step"]
        points.append(_point(name, path.parent.name, size, sft_of(run), run["settings"]["kt_num_threads"],
                             run["tokens_per_microbatch_measured"],
                             {"forward": kt["forward"], "backward": kt["backward"], "step": run["steady_step_s"]},
                             active_per_call(json.loads(path.read_text()))))
    return points


def _pct(predicted: float, measured: float) -> float:
    return round(100 * (predicted / measured - 1), 1)


def gains(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shaper's gain (the slower split's step over the faster's) for each pair, measured and predicted."""
    by = {(p["where"], p["run"]): p for p in points}
    rows = []
    for where, slow, fast in PAIRS:
        a, b = by[(where, slow)], by[(where, fast)]
        measured = a["step_s"] / b["step_s"]
        balanced = a["step_balanced_s"] / b["step_balanced_s"]
        given = a["step_given_active_s"] / b["step_given_active_s"]
        rows.append({"where": where, "experts": a["experts"], "pair": f"{slow} over {fast}",
                     "measured": round(measured, 3), "balanced": round(balanced, 3), "balanced_error_pct":
                     _pct(balanced, measured), "given_active": round(given, 3),
                     "given_active_error_pct": _pct(given, measured)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    points = fit_points() + check_points()
    print(f"{'run':<12} {'where':<16} {'E':>4} {'tokens':>6} {'active':>6} {'balanced':>8} {'KT s':>6} "
          f"{'pred bal':>8} {'err':>6} {'pred act':>8} {'err':>6}")
    for p in points:
        print(f"{p['run']:<12} {p['where']:<16} {p['experts']:>4} {p['tokens_per_micro_batch']:>6.0f} "
              f"{p['active_measured']:>6.1f} {p['active_balanced']:>8.1f} {p['kt_s']:>6.2f} {p['kt_balanced_s']:>8.2f} "
              f"{_pct(p['kt_balanced_s'], p['kt_s']):>+5.1f}% {p['kt_given_active_s']:>8.2f} "
              f"{_pct(p['kt_given_active_s'], p['kt_s']):>+5.1f}%")
    rows = gains(points)
    print(f"\n{'pair':<28} {'E':>4} {'measured':>8} {'balanced':>8} {'err':>7} {'given active':>12} {'err':>7}")
    for r in rows:
        print(f"{r['pair']:<28} {r['experts']:>4} {r['measured']:>8.3f} {r['balanced']:>8.3f} "
              f"{r['balanced_error_pct']:>+6.1f}% {r['given_active']:>12.3f} {r['given_active_error_pct']:>+6.1f}%")
    if not args.no_write:
        OUT.write_text(json.dumps({"points": points, "gains": rows}, indent=1) + "\n")
        print(f"\nwrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
