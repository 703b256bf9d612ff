"""Estimate the KT probe's reference (CostModel.kt_probe_reference) from hosts that have both a probe and a KT
run, and check each estimate on the host not used to make it.

The probe (ktflow.planning.host_probe) times kt-kernel's SFT expert kernels on a host and divides by what the time
model predicts for them: its *ratio*. The plan scales KT's CPU passes on a host by ``ratio / reference``, where the
reference is that ratio on a machine the time model fits exactly. No such machine was probed, so the reference is
estimated from hosts with a KT run: there the CPU passes needed a factor ``f = (measured step - GPU part) / CPU
part`` to match the measured step, so a machine with factor 1 would have probed ``ratio / f``.

Inputs: ``benchmarks/data/plan-probe/HOST/sft.json`` (``gpu_host/run.sh merged-fixture merged-adapter``: the
Kimi-K2.5 slice, one MoE layer, 5 KT RAWINT4 steps, ``ktflow plan``'s prediction with the probe saved before the
run). The prediction's CPU and GPU parts are recomputed with ktflow's own time model (checked against the recorded
step). The reference is the mean of the hosts' estimates; each host's prediction with the *other* host's estimate is
the out-of-sample check. Then the runs planned with the shipped reference and never used to estimate it
(:data:`CHECKS`): each one's step with its own probe and without, and the shaper's gain where one machine trained the
same batch both ways (:data:`GAIN_PAIRS`), against what they measured.

    .venv/bin/python benchmarks/probe_reference.py    # prints the table, writes plan-probe/reference.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ktflow.planning.costs import COSTS, kt_step_estimate  # noqa: E402
from ktflow.planning.host_probe import kt_sft_method  # noqa: E402
from ktflow.planning.sizing import ModelSize  # noqa: E402
from ktflow.recipe import SftConfig, load_recipe  # noqa: E402

DATA = REPO / "benchmarks" / "data" / "plan-probe"
RECIPE = REPO / "gpu_host" / "slice-kt-rawint4.yaml"
_PROBE = re.compile(r"forward ([\d.]+) ms .*?backward ([\d.]+) ms.*?: ([\d.]+)x the model's ([\d.]+) ms")
_TOKENS = re.compile(r"([\d,]+) tokens a micro-batch")
_THREADS = re.compile(r"KT step [\d.]+ s \((\d+) threads")
_SCALED = re.compile(r"KT's CPU passes x([\d.]+)")  # a plan the probe already scaled (a reference was shipped)


def size_and_sft(folder: Path, run: str = "sft.json") -> tuple[ModelSize, SftConfig]:
    """The slice a run trained (its depth, from the recorded dims) and the recipe's SFT settings with the batch split
    it trained."""
    sft_doc = json.loads((folder / run).read_text())
    batch = sft_doc["adapter"]["manifest_extra"]["batch"]  # the batch shape the run trained with
    dims = sft_doc["model"]["dims"]
    layers = dims["num_hidden_layers"] - 1  # layer 0 is dense
    experts = layers * dims["n_routed_experts"] * 3 * dims["hidden_size"] * dims["moe_intermediate_size"]
    size = ModelSize(path=str(folder), parameters=sft_doc["model"]["parameters"], hidden_size=dims["hidden_size"],
                     num_layers=dims["num_hidden_layers"], vocab_size=dims["vocab_size"], linear_shapes={},
                     expert_parameters=experts, moe_layers=layers, routed_experts=dims["n_routed_experts"],
                     experts_per_token=dims["num_experts_per_tok"])
    sft = load_recipe(RECIPE).sft.model_copy(update={
        "per_device_train_batch_size": batch["per_device_train_batch_size"],
        "gradient_accumulation_steps": batch["gradient_accumulation_steps"]})
    return size, sft


def host_point(folder: Path, run: str = "sft.json") -> dict:
    """One host's probe, prediction and measured step (``folder/run``), the prediction split into its CPU and GPU
    parts."""
    sft_doc = json.loads((folder / run).read_text())
    predicted = sft_doc["predicted"]
    basis = predicted["time_basis"]
    probe = _PROBE.search(basis)
    if probe is None:
        raise SystemExit(f"{folder}: the recorded plan has no measured KT probe")
    forward_ms, backward_ms, _, model_ms = (float(g) for g in probe.groups())
    threads = int(_THREADS.search(basis).group(1))
    tokens = int(_TOKENS.search(basis).group(1).replace(",", ""))
    size, sft = size_and_sft(folder, run)
    fitted = COSTS.model_copy(update={"kt_probe_reference": {}})
    estimate = kt_step_estimate(size, sft, threads, fitted, tokens)
    cpu = estimate.kt_forward_s + estimate.kt_backward_s
    scaled = _SCALED.search(basis)
    planned = estimate.gpu_s + cpu * (float(scaled.group(1)) if scaled else 1.0)  # what the run's plan said
    if abs(planned / predicted["step_s"] - 1) > 5e-3:
        raise SystemExit(f"{folder / run}: the time model now predicts {planned:.3f} s, the run's plan said "
                         f"{predicted['step_s']:.3f} s: the constants changed since; refit from runs planned with them")
    measured = sft_doc["steady_step_s"]
    factor = (measured - estimate.gpu_s) / cpu
    ratio = (forward_ms + backward_ms) / model_ms
    machine = next(m for m in (folder / "machine.txt", folder.parent / "machine.txt") if m.is_file())
    return {"host": folder.name, "run": run, "machine": machine.read_text().splitlines()[0],
            "method": kt_sft_method(sft), "threads": threads, "tokens_per_micro_batch": tokens,
            "probe_ms": forward_ms + backward_ms, "probe_model_ms": model_ms, "probe_ratio": ratio,
            "predicted_step_s": estimate.step_s, "cpu_s": cpu, "gpu_s": estimate.gpu_s,
            "measured_step_s": measured, "steady_step_spread_s": sft_doc.get("steady_step_spread_s"),
            "cpu_factor": factor, "reference_estimate": ratio / factor}


def step_at(point: dict, ratio: float, reference: float) -> float:
    """``point``'s step with its CPU passes scaled by a probe's ``ratio`` over ``reference``."""
    return point["gpu_s"] + point["cpu_s"] * ratio / reference


def reference_of(points: list[dict]) -> float:
    """The reference the hosts estimate together: the mean of theirs."""
    return statistics.fmean(p["reference_estimate"] for p in points)


def out_of_sample(points: list[dict]) -> list[dict]:
    """Each host's step predicted with the reference the *other* hosts estimate, against what it measured."""
    checks = []
    for p in points:
        reference = reference_of([q for q in points if q is not p])
        scaled = step_at(p, p["probe_ratio"], reference)
        checks.append({"host": p["host"], "reference_from_others": reference, "predicted_as_fitted_s": p["predicted_step_s"],
                       "predicted_with_probe_s": scaled, "measured_s": p["measured_step_s"],
                       "error_as_fitted": p["predicted_step_s"] / p["measured_step_s"] - 1,
                       "error_with_probe": scaled / p["measured_step_s"] - 1})
    return checks


# Runs planned with the shipped reference and not used to estimate it: (name, folder, run file). Three more machines
# of the kinds above (H200 + 16 cores: -b at one MoE layer, -c and -d at three; the 64-core host again, at six) and,
# on -c, -d and the 64-core host, the same batch of 8 as the recipe writes it (1 x 8) beside the shaper's split
# (8 x 1): the shaper's gain; on -d also the splits between (4 x 2, 2 x 4).
_C, _D = DATA / "checks" / "h200-16-cores-c", DATA / "checks" / "h200-16-cores-d"
_SLICE64 = REPO / "benchmarks/data/kimi-slice/h200x4-64-cores/moe6"
CHECKS: list[tuple[str, Path, str]] = [
    ("h200-16-cores-b, 1 MoE layer, 8 x 1", DATA / "checks" / "h200-16-cores-b", "sft.json"),
    ("h200-16-cores-c, 3 MoE layers, 8 x 1", _C, "sft.json"),
    ("h200-16-cores-c, 3 MoE layers, 1 x 8", _C, "sft-written.json"),
    ("h200-16-cores-d, 3 MoE layers, 8 x 1", _D, "sft.json"),
    ("h200-16-cores-d, 3 MoE layers, 4 x 2", _D, "sft-4x2.json"),
    ("h200-16-cores-d, 3 MoE layers, 2 x 4", _D, "sft-2x4.json"),
    ("h200-16-cores-d, 3 MoE layers, 1 x 8", _D, "sft-written.json"),
    ("h200x4-64-cores, 6 MoE layers, 8 x 1", _SLICE64, "sft.json"),
    ("h200x4-64-cores, 6 MoE layers, 1 x 8", _SLICE64, "sft-written.json"),
]
# The shaper's gain: (the split it chose, another split of the same batch) on one machine, by CHECKS name; the batch
# as written (1 x 8) first on each machine, then the splits between.
GAIN_PAIRS: list[tuple[str, str]] = [
    ("h200-16-cores-c, 3 MoE layers, 8 x 1", "h200-16-cores-c, 3 MoE layers, 1 x 8"),
    ("h200-16-cores-d, 3 MoE layers, 8 x 1", "h200-16-cores-d, 3 MoE layers, 1 x 8"),
    ("h200x4-64-cores, 6 MoE layers, 8 x 1", "h200x4-64-cores, 6 MoE layers, 1 x 8"),
    ("h200-16-cores-d, 3 MoE layers, 8 x 1", "h200-16-cores-d, 3 MoE layers, 4 x 2"),
    ("h200-16-cores-d, 3 MoE layers, 8 x 1", "h200-16-cores-d, 3 MoE layers, 2 x 4"),
]


def split_of(check: str) -> str:
    """The batch split a CHECKS name ends in ("8 x 1")."""
    return check.rsplit(", ", 1)[1]


def checked(reference: float) -> tuple[list[dict], list[dict]]:
    """CHECKS predicted with ``reference`` (each with its own probe) and without the probe, against what they measured;
    and each GAIN_PAIRS pair's gain (the as-written step over the shaped one), predicted under the shaped run's probe
    and measured."""
    rows = {}
    for name, folder, run in CHECKS:
        p = host_point(folder, run)
        with_probe = step_at(p, p["probe_ratio"], reference)
        rows[name] = {"check": name, **p, "predicted_with_probe_s": with_probe,
                      "error_with_probe": with_probe / p["measured_step_s"] - 1,
                      "error_without_probe": p["predicted_step_s"] / p["measured_step_s"] - 1}
    gains = []
    for shaped_name, written_name in GAIN_PAIRS:
        shaped, written = rows[shaped_name], rows[written_name]
        predicted = (step_at(written, shaped["probe_ratio"], reference)
                     / step_at(shaped, shaped["probe_ratio"], reference))
        measured = written["measured_step_s"] / shaped["measured_step_s"]
        gains.append({"shaped": shaped_name, "as_written": written_name, "predicted_gain": predicted,
                      "measured_gain": measured, "error": predicted / measured - 1})
    return list(rows.values()), gains


def main() -> int:
    points = [host_point(folder) for folder in sorted(p for p in DATA.iterdir() if (p / "sft.json").is_file())]
    if len(points) < 2:
        raise SystemExit("at least two hosts are needed: one to estimate from, one to check on")
    print(f"{'host':<18} {'threads':>7} {'probe/model':>11} {'predicted':>9} {'measured':>8} {'CPU factor':>10} "
          f"{'reference':>9}")
    for p in points:
        print(f"{p['host']:<18} {p['threads']:>7} {p['probe_ratio']:>11.3f} {p['predicted_step_s']:>8.2f}s "
              f"{p['measured_step_s']:>7.2f}s {p['cpu_factor']:>10.3f} {p['reference_estimate']:>9.3f}")
    checks = out_of_sample(points)
    print("\nout of sample (each host with the reference estimated from the others):")
    for c in checks:
        print(f"  {c['host']:<18} reference {c['reference_from_others']:.3f}: predicted {c['predicted_with_probe_s']:.2f} s "
              f"({c['error_with_probe']:+.1%}) against {c['measured_s']:.2f} s measured; as fitted "
              f"{c['predicted_as_fitted_s']:.2f} s ({c['error_as_fitted']:+.1%})")
    reference = reference_of(points)
    method = points[0]["method"]
    print(f"\nkt_probe_reference[{method!r}] = {reference:.3f} (mean of {len(points)} hosts)")
    shipped = COSTS.kt_probe_reference.get(method, reference)
    runs, gains = checked(shipped)
    print(f"\nruns not used to estimate it, planned with the shipped reference {shipped:.3f}:")
    for r in runs:
        print(f"  {r['check']:<40} probe/model {r['probe_ratio']:.3f}: predicted {r['predicted_with_probe_s']:6.2f} s "
              f"({r['error_with_probe']:+.1%}), without the probe {r['predicted_step_s']:6.2f} s "
              f"({r['error_without_probe']:+.1%}), measured {r['measured_step_s']:.2f} s")
    for g in gains:
        print(f"  the shaper's gain ({g['as_written']} over {split_of(g['shaped'])}): predicted "
              f"{g['predicted_gain']:.2f}x, measured {g['measured_gain']:.2f}x ({g['error']:+.1%})")
    out = DATA / "reference.json"
    out.write_text(json.dumps({"method": method, "reference": round(reference, 3), "hosts": points,
                               "out_of_sample": checks, "checks": runs, "shaper_gain": gains}, indent=1) + "\n")
    print(f"written: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
