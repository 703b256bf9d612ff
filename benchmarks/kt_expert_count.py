"""Would a cost per micro-batch that does not grow with the experts fix the shaper's gain? Fitted on two expert
counts, checked on the others.

    .venv/bin/python benchmarks/kt_expert_count.py    # prints the fit and the checks, writes plan-probe/expert-count.json

The time model ktflow ships (ktflow.planning.costs.kt_step_estimate) prices each micro-batch's pass over a MoE layer
as a call cost, a multiple of the *bytes floor* (the active experts' bytes over the read bandwidth: it grows with the
experts a layer) and a multiple of the *FLOP floor* (the tokens' expert FLOPs). Its constants were fitted on one expert
count (180 a layer), where a cost per expert and a cost per micro-batch and layer that does not grow with the experts
cannot be told apart; the shaper's gain is then under-predicted at 96 experts and over-predicted at 384
(benchmarks/shaper_gain.py). This script tries the alternative, without changing anything ktflow ships:

    KT's CPU time of a run = f_machine x (calls + s x bytes-floor part + FLOP-floor part + t0 x micro-batches x MoE layers)

where the parts are the shipped model's own (the shipped model is s = 1, t0 = 0), ``f_machine`` is each machine's
speed (eliminated: only splits of one batch on one machine are compared, as the shaper does) and ``s`` and ``t0`` are
fitted by least squares on the ratios of each run's CPU time to its machine's shaped run:

- fitted on (:data:`FIT`): the Kimi-K2.5 slice on one H200 + 16-core machine at 8 x 1, 4 x 2, 2 x 4 and 1 x 8 (384
  experts a layer), and model 3 on another at 8 x 1, 4 x 2 and 1 x 8 (96 experts);
- checked on (:data:`CHECK`): model 1 on an H100 + 16-core machine (180 experts, the shipped fit's count), the slice on
  a second H200 + 16-core machine, and the slice on a 4 x H200 + 64-core host at 64 threads (``t0`` is counted at 16
  threads and scales with the threads as the model's read bandwidth does, as the bytes-floor part it takes over).

KT's CPU time is its own timers' forward + backward where the run has them (the ``benchmarks/data/kt-throughput``
runs) and the measured step less the model's GPU part where not (the slice's runs, ``benchmarks/probe_reference.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import kt_out_of_sample  # noqa: E402  (the kt-throughput runs, as its checks read them)
import kt_step_model  # noqa: E402  (its least squares)
import probe_reference  # noqa: E402  (the slice's runs, as its checks read them)

from ktflow.planning.costs import COSTS, host_rate, kt_step_estimate  # noqa: E402
from ktflow.planning.sizing import ModelSize  # noqa: E402

_PART_CONSTANTS = {"calls": ("kt_forward_call_s", "kt_backward_call_s"),
                   "bytes": ("kt_forward_bytes_floors", "kt_backward_bytes_floors"),
                   "flops": ("kt_forward_flop_floors", "kt_backward_flop_floors")}
# (machine, the shaped run, the other splits): kt-throughput runs by machine folder and name, the slice's by
# probe_reference.CHECKS name.
FIT = [("kimi slice, h200-16-cores-d", "h200-16-cores-d, 3 MoE layers, 8 x 1",
        ["h200-16-cores-d, 3 MoE layers, 4 x 2", "h200-16-cores-d, 3 MoE layers, 2 x 4",
         "h200-16-cores-d, 3 MoE layers, 1 x 8"]),
       ("model 3, H200 A", "out-of-sample-h200a/m3-shaped", ["out-of-sample-h200a/m3-hand-4x2",
                                                            "out-of-sample-h200a/m3-written"])]
# Another expert width, carried over as absolute KT CPU seconds a step (no split pairs there): DeepSeek-V2-Lite, 64
# experts of [1408, 2048] a layer in BF16, 4 x 1 of 1,024 tokens, on three machines of two kinds.
OTHER_WIDTH = ["out-of-sample/v2l-base", "out-of-sample-h200b/v2l-base", "out-of-sample-h200d/v2l-base"]
CHECK = [("model 1, H100 #2", "out-of-sample/shaped", ["out-of-sample/hand-4x2", "out-of-sample/written"]),
         ("kimi slice, h200-16-cores-c", "h200-16-cores-c, 3 MoE layers, 8 x 1", ["h200-16-cores-c, 3 MoE layers, 1 x 8"]),
         ("kimi slice, h200x4-64-cores", "h200x4-64-cores, 6 MoE layers, 8 x 1", ["h200x4-64-cores, 6 MoE layers, 1 x 8"])]


def _parts(size, sft, threads: int, tokens: float) -> dict[str, float]:
    """The shipped model's KT CPU seconds a step by part, its GPU part, and the micro-batches x MoE layers in units of
    a 16-thread pass (``layer_passes``: what ``t0`` multiplies)."""
    fitted = COSTS.model_copy(update={"kt_probe_reference": {}})
    zero = {c: 0.0 for names in _PART_CONSTANTS.values() for c in names}
    parts: dict[str, float] = {"gpu_s": kt_step_estimate(size, sft, threads, fitted, tokens).gpu_s}
    for part, names in _PART_CONSTANTS.items():
        only = fitted.model_copy(update={**zero, **{c: getattr(fitted, c) for c in names}})
        estimate = kt_step_estimate(size, sft, threads, only, tokens)
        parts[part] = estimate.kt_forward_s + estimate.kt_backward_s
    # the cost a micro-batch and MoE layer, counted in its 16-thread seconds, scales with the threads as the model's
    # read bandwidth does (as the bytes-floor part it would take over)
    bandwidth = host_rate(fitted.kt_read_gb_s, 16) / host_rate(fitted.kt_read_gb_s, threads)
    parts["layer_passes"] = sft.gradient_accumulation_steps * max(size.moe_layers, 1) * bandwidth
    return parts


def run_point(ref: str) -> dict:
    """One run: its experts a layer, threads, split, the model's parts, the measured step and KT's CPU seconds a
    step (KT's timers where the run has them, else the step less the model's GPU part)."""
    if "/" in ref:  # a kt-throughput run with KT's own timers
        folder, name = ref.split("/")
        run = json.loads((kt_out_of_sample.KT / folder / f"{name}.json").read_text())
        size = ModelSize(**run["plan"]["model"], linear_shapes={})
        sft = kt_out_of_sample.sft_of(run)
        threads, tokens = run["settings"]["kt_num_threads"], run["tokens_per_microbatch_measured"]
        timers = run["kt_timers"]["kt_moe_s_per_step"]
        step, measured = run["steady_step_s"], timers["forward"] + timers["backward"]
    else:  # a slice run: the measured step less the model's GPU part
        folder, file = next((f, r) for n, f, r in probe_reference.CHECKS if n == ref)
        point = probe_reference.host_point(folder, file)
        size, sft = probe_reference.size_and_sft(folder, file)
        threads, tokens = point["threads"], point["tokens_per_micro_batch"]
        step, measured = point["measured_step_s"], point["measured_step_s"] - point["gpu_s"]
    return {"run": ref, "experts_per_layer": size.routed_experts, "threads": threads,
            "split": f"{sft.per_device_train_batch_size} x {sft.gradient_accumulation_steps}",
            "tokens_per_micro_batch": tokens, "step_s": step, "measured_cpu_s": measured,
            **_parts(size, sft, threads, tokens)}


def cpu_s(point: dict, s: float, t0: float) -> float:
    """The model's KT CPU seconds a step with the bytes-floor part scaled by ``s`` and ``t0`` a layer pass."""
    return point["calls"] + s * point["bytes"] + point["flops"] + t0 * point["layer_passes"]


def fit(groups: list[tuple[dict, list[dict]]]) -> tuple[float, float]:
    """``s`` and ``t0`` by least squares on each split's KT CPU time over its machine's shaped run's: each ratio's
    equation ``m_r x cpu(S) - m_S x cpu(r) = 0`` is linear in (s, t0); divided by ``m_r x m_S``, relative."""
    rows, rhs = [], []
    for shaped, others in groups:
        for other in others:
            ms, mr = shaped["measured_cpu_s"], other["measured_cpu_s"]
            scale = ms * mr
            rows.append([(mr * shaped["bytes"] - ms * other["bytes"]) / scale,
                         (mr * shaped["layer_passes"] - ms * other["layer_passes"]) / scale])
            rhs.append((ms * (other["calls"] + other["flops"]) - mr * (shaped["calls"] + shaped["flops"])) / scale)
    s, t0 = kt_step_model.lstsq(rows, rhs)
    return s, t0


def gains(name: str, shaped: dict, others: list[dict], s: float, t0: float) -> list[dict]:
    """Each other split's step over the shaped run's, measured and predicted by the shipped model and the two-part one,
    with the machine's speed on KT's CPU passes taken from its shaped run (as the shaper compares splits)."""
    out = []
    for other in others:
        row = {"machine": name, "experts_per_layer": shaped["experts_per_layer"], "threads": shaped["threads"],
               "split": other["split"], "measured_gain": other["step_s"] / shaped["step_s"]}
        for label, (ss, tt) in (("shipped", (1.0, 0.0)), ("two_part", (s, t0))):
            speed = (shaped["step_s"] - shaped["gpu_s"]) / cpu_s(shaped, ss, tt)
            row[f"{label}_gain"] = (other["gpu_s"] + speed * cpu_s(other, ss, tt)) / shaped["step_s"]
            row[f"{label}_error"] = row[f"{label}_gain"] / row["measured_gain"] - 1
        out.append(row)
    return out


def main() -> int:
    fitted = [(name, run_point(s), [run_point(o) for o in others]) for name, s, others in FIT]
    checked = [(name, run_point(s), [run_point(o) for o in others]) for name, s, others in CHECK]
    s, t0 = fit([(shaped, others) for _, shaped, others in fitted])
    print(f"fitted on {', '.join(n for n, _, _ in fitted)}: bytes-floor part x{s:.3f}, "
          f"{t0 * 1e3:.1f} ms a micro-batch and MoE layer")
    rows = []
    for label, groups in (("fit", fitted), ("check", checked)):
        for name, shaped, others in groups:
            for row in gains(name, shaped, others, s, t0):
                rows.append({"set": label, **row})
    print("each split's step over its machine's shaped one's:")
    print(f"{'set':<6}{'machine':<30}{'experts':>8}{'threads':>8} {'split':<6}{'measured':>9}{'shipped':>16}"
          f"{'two-part':>17}")
    for r in rows:
        print(f"{r['set']:<6}{r['machine']:<30}{r['experts_per_layer']:>8}{r['threads']:>8} {r['split']:<6}"
              f"{r['measured_gain']:>8.2f}x{r['shipped_gain']:>8.2f}x ({r['shipped_error']:+6.1%})"
              f"{r['two_part_gain']:>8.2f}x ({r['two_part_error']:+6.1%})")
    # t0 as fitted (seconds), or scaled by the expert's size: an expert's bytes-floor part a layer pass, over the
    # Kimi-width expert's (both at 16 threads)
    def per_expert(point: dict) -> float:
        return point["bytes"] / (point["experts_per_layer"] * point["layer_passes"])

    kimi = fitted[0][1]
    other = []
    print("another expert width, KT's CPU seconds a step:")
    for ref in OTHER_WIDTH:
        p = run_point(ref)
        size_ratio = per_expert(p) / per_expert(kimi)
        row = {"run": ref, "experts_per_layer": p["experts_per_layer"], "measured_cpu_s": p["measured_cpu_s"],
               "shipped_cpu_s": cpu_s(p, 1.0, 0.0), "two_part_cpu_s": cpu_s(p, s, t0),
               "two_part_by_expert_size_cpu_s": cpu_s(p, s, t0 * size_ratio)}
        other.append(row)
        print(f"  {ref:<32} measured {row['measured_cpu_s']:5.2f} s; shipped {row['shipped_cpu_s']:5.2f} s, two-part "
              f"{row['two_part_cpu_s']:5.2f} s, two-part with t0 scaled by the expert's size "
              f"{row['two_part_by_expert_size_cpu_s']:5.2f} s")
    out = REPO / "benchmarks" / "data" / "plan-probe" / "expert-count.json"
    out.write_text(json.dumps({"bytes_floor_scale": s, "layer_pass_s": t0, "fit": [n for n, _, _ in fitted],
                               "check": [n for n, _, _ in checked], "ratios": rows, "other_width": other},
                              indent=1) + "\n")
    print(f"written: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
