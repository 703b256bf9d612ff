"""Fit ktflow's KT step-time and memory model on the measured runs in benchmarks/data/kt-throughput.

    .venv/bin/python benchmarks/kt_step_model.py            # fit, print the table, write fit.json
    .venv/bin/python benchmarks/kt_step_model.py --no-write # fit and print only

Reads ``summary.json`` (the runs), each run's JSON (its ``--set`` overrides of gpu_host/big-kt-rawint4.yaml)
and ``*.kt_profile.json`` (kt-kernel's own timers), ``host.json`` (the host's read bandwidth and BF16 matmul
rate by thread count) and ``fixture-big.json`` / ``fixture2.json`` (the two model shapes). The model is
:func:`ktflow.planning.costs.kt_step_estimate` (time) and :func:`ktflow.planning.sizing.estimate_kt_sft_memory`
(GPU memory, RSS): both are linear in their fitted constants, so each constant's regressor is the model
itself evaluated with that constant at 1 and the others at 0, and the fit is weighted least squares with
non-negative constants (residuals relative to the measured figure), in plain Python.

- KT's forward and backward (kt-kernel's timers per optimizer step) are fitted separately, each as a
  multiple of the bytes floor and of the FLOP floor, after subtracting the call cost measured in the same
  timers (wrapper time outside the NUMA compute, median over the fit's runs).
- The rest of the step (measured step - KT's forward - backward) as a cost per optimizer step, per
  micro-batch, and the non-expert GPU matmuls.
- GPU memory: the activation bytes per token, layer and hidden unit, and the no-offload extra.
- RSS: the bytes retained per token, MoE layer and routed intermediate unit (the rest of the RSS formula
  is calibration.json's, not refitted).

Held out, never used by the fit (chosen before any fit was run): ``s2-base`` (the second model shape),
``b1-c1024`` (one 1,024-token sample against base's four of 256: the one equal-tokens shape comparison)
and ``mb512`` (512 tokens, inside the fitted range). The fit keeps the extremes (128 and 4,096 tokens),
the accumulation run and the thread runs, which the constants cannot be identified without.

BF16 experts (no run here has them): the token-independent part is counted either per parameter as
RAWINT4's or per stored byte (2 B a parameter), and a per-token factor relative to RAWINT4's is fitted on
calibration.json's V2-Lite BF16 profile (KT's forward and backward timers); the hypothesis whose worst
residual on the BF16 legs is smaller ships. Those legs are then no out-of-sample check of BF16.

Printed: every run's predicted vs measured step, GPU memory and RSS with the residual, in-sample and
held out; and the BF16 legs under both hypotheses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ktflow.fixtures.stream import BIGGER_THAN_GPU, MoeDims, plan_shards  # noqa: E402
from ktflow.planning.costs import KT_BYTES_PER_PARAM, CostModel, kt_step_estimate  # noqa: E402
from ktflow.planning.sizing import KtMemoryModel, ModelSize, _size_of, estimate_kt_sft_memory  # noqa: E402
from ktflow.recipe import ModelFacts, load_recipe  # noqa: E402

DATA = REPO / "benchmarks/data/kt-throughput"
RECIPE = REPO / "gpu_host/big-kt-rawint4.yaml"
HELD_OUT = ("s2-base", "b1-c1024", "mb512")
TIME_CONSTANTS = ("kt_forward_bytes_floors", "kt_forward_flop_floors", "kt_backward_bytes_floors",
                  "kt_backward_flop_floors", "kt_optimizer_step_s", "kt_gpu_base_s", "kt_matmul_flops_per_s")
MEMORY_CONSTANTS = ("gpu_layer_activation_bytes", "gpu_no_offload_extra_bytes", "rss_retained_bytes")
MiB, GiB = 1 << 20, 1 << 30
SIGNIFICANT = 4  # digits the shipped constants keep


def significant(value: float, digits: int = SIGNIFICANT) -> float:
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


# --------------------------------------------------------------------------- least squares


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is square)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            raise ValueError("singular system: a regressor is zero on every run")
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares by the normal equations on unit-norm columns (a few columns, well conditioned)."""
    k = len(rows[0])
    norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(k)]
    scaled = [[r[j] / norms[j] for j in range(k)] for r in rows]
    ata = [[sum(r[i] * r[j] for r in scaled) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * t for r, t in zip(scaled, y)) for i in range(k)]
    return [c / n for c, n in zip(_solve(ata, aty), norms)]


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares by trying every set of free columns (there are at most a few)."""
    k = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for size in range(k, 0, -1):
        for free in itertools.combinations(range(k), size):
            try:
                sub = lstsq([[r[j] for j in free] for r in rows], y)
            except ValueError:
                continue
            if min(sub) < 0:
                continue
            coef = [0.0] * k
            for j, c in zip(free, sub):
                coef[j] = c
            sse = sum((sum(c * x for c, x in zip(coef, r)) - t) ** 2 for r, t in zip(rows, y))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, coef)
    assert best is not None
    return best[1]


def weighted_fit(regressors: list[list[float]], targets: list[float], scale: list[float]) -> list[float]:
    """Non-negative constants minimizing sum(((prediction - target) / scale)^2)."""
    return nnls([[x / s for x in row] for row, s in zip(regressors, scale)], [t / s for t, s in zip(targets, scale)])


# --------------------------------------------------------------------------- the data


def _fixture_size(dims: MoeDims, name: str, *, parameters: int | None = None, other_bytes: int | None = None,
                  expert_bytes: int) -> ModelSize:
    """The fixture checkpoint's size from its planned tensors (ktflow.fixtures.stream), plus the BF16
    vision stand-in the kimi-k2.5 writer adds (from the measured parameter count or non-expert bytes)."""
    tensors = [(t.name, t.dtype, t.shape, t.nbytes) for shard in plan_shards(dims, vocab_size=402, pad_id=0)
               for t in shard]
    config = {"hidden_size": dims.hidden, "num_hidden_layers": dims.layers, "vocab_size": 402,
              "n_routed_experts": dims.experts, "num_experts_per_tok": dims.experts_per_tok}
    size = _size_of(name, config, tensors)
    assert size.expert_stored_bytes == expert_bytes, (name, size.expert_stored_bytes, expert_bytes)
    if parameters is not None:
        extra = parameters - size.parameters
    else:
        assert other_bytes is not None
        extra = (other_bytes - (size.stored_bytes - size.expert_stored_bytes)) // 2
    return size.model_copy(update={"parameters": size.parameters + extra, "stored_bytes": size.stored_bytes + 2 * extra})


def model_sizes(data: Path = DATA) -> dict[int, ModelSize]:
    """Model 1 (fixture-big.json) and model 2 (fixture2.json) as the planner sizes them."""
    summary = json.loads((data / "summary.json").read_text())
    big = json.loads((data / "fixture-big.json").read_text())
    second = json.loads((data / "fixture2.json").read_text())
    bytes1 = next(r["routed_expert_bytes"] for r in summary["runs"] if r["moe_layers"] == BIGGER_THAN_GPU.layers - 1)
    return {
        1: _fixture_size(BIGGER_THAN_GPU, "model 1 (fixture-big.json)", parameters=big["parameters"],
                         expert_bytes=bytes1),
        2: _fixture_size(MoeDims(**second["dims"]), "model 2 (fixture2.json)",
                         other_bytes=second["model_facts"]["other_bytes"],
                         expert_bytes=second["model_facts"]["routed_expert_bytes"]),
    }


def host_curves(data: Path = DATA) -> dict[str, dict[int, float]]:
    """Read GB/s and 512-row BF16 matmul TFLOP/s by thread count, medians (host.json)."""
    host = json.loads((data / "host.json").read_text())
    read = {int(t): v["read_gb_s_median"] for t, v in host["memory_bandwidth"]["by_threads"].items()}
    matmul = {r["threads"]: r["tflops_median"] for r in host["bf16_matmul"]["rows"]
              if (r["m"], r["k"], r["n"]) == (512, 7168, 2048)}
    return {"kt_read_gb_s": dict(sorted(read.items())), "kt_matmul_tflops": dict(sorted(matmul.items()))}


def _call_costs(profile: dict[str, Any]) -> tuple[float, float]:
    """kt-kernel's wrapper time outside its NUMA compute, per forward and backward call (median over layers)."""
    layers = profile["profile"]["layers"].values()

    def per_call(stage: str) -> float:
        return statistics.median(
            (v[f"wrapper.tp.{stage}.total.total_ns"] - v[f"wrapper.tp.{stage}.numa_compute.total_ns"])
            / v[f"tp.0.{stage}.total.calls"] for v in layers) / 1e9

    return per_call("forward"), per_call("backward")


def load_runs(data: Path = DATA) -> list[dict[str, Any]]:
    """Every run of summary.json with its model size, its SftConfig and its measured call costs."""
    sizes = model_sizes(data)
    runs = []
    for run in json.loads((data / "summary.json").read_text())["runs"]:
        detail = json.loads((data / f"{run['name']}.json").read_text())
        sets = [s for s in detail["sets"] if s.startswith("sft.")]
        sft = load_recipe(RECIPE, sets).sft
        assert sft.per_device_train_batch_size * sft.cutoff_len == run["tokens_per_microbatch"], run["name"]
        size = sizes[1 if run["moe_layers"] == sizes[1].moe_layers else 2]
        forward_call, backward_call = _call_costs(json.loads((data / f"{run['name']}.kt_profile.json").read_text()))
        runs.append({"name": run["name"], "held_out": run["name"] in HELD_OUT, "size": size, "sft": sft,
                     "threads": run["kt_num_threads"], "tokens": run["tokens_per_microbatch"],
                     "micro_batches": run["microbatches_per_step"], "step": run["steady_step_s"],
                     "forward": run["kt_forward_s_per_step"], "backward": run["kt_backward_s_per_step"],
                     "gpu_mib": run["peak_gpu_mib_over_idle"], "rss_gib": run["peak_host_rss_gib"],
                     "forward_call": forward_call, "backward_call": backward_call,
                     "model": 1 if size is sizes[1] else 2})
    return runs


# --------------------------------------------------------------------------- the fit


def _time_model(curves: dict[str, dict[int, float]], **constants: float) -> CostModel:
    """A CostModel with the host's curves and only ``constants`` among the fitted ones (others 0)."""
    zero = {name: 0.0 for name in TIME_CONSTANTS if name != "kt_matmul_flops_per_s"}
    zero.update(kt_forward_call_s=0.0, kt_backward_call_s=0.0, kt_matmul_flops_per_s=math.inf)
    return CostModel(**curves, **{**zero, **constants})


def _estimate(run: dict[str, Any], costs: CostModel):
    return kt_step_estimate(run["size"], run["sft"], run["threads"], costs, run["tokens"])


def fit_time(runs: list[dict[str, Any]], curves: dict[str, dict[int, float]]) -> dict[str, float]:
    """The time constants, fitted on ``runs`` (rounded to SIGNIFICANT digits)."""
    calls = {"kt_forward_call_s": significant(statistics.median(r["forward_call"] for r in runs)),
             "kt_backward_call_s": significant(statistics.median(r["backward_call"] for r in runs))}
    scale = [r["step"] for r in runs]
    fitted: dict[str, float] = dict(calls)
    for part, names in (("forward", ("kt_forward_bytes_floors", "kt_forward_flop_floors")),
                        ("backward", ("kt_backward_bytes_floors", "kt_backward_flop_floors"))):
        attr = f"kt_{part}_s"
        fixed = [getattr(_estimate(r, _time_model(curves, **calls)), attr) for r in runs]
        regressors = [[getattr(_estimate(r, _time_model(curves, **{n: 1.0})), attr) for n in names] for r in runs]
        coef = weighted_fit(regressors, [r[part] - f for r, f in zip(runs, fixed)], scale)
        fitted.update({n: significant(c) for n, c in zip(names, coef)})
    rest = [r["step"] - r["forward"] - r["backward"] for r in runs]
    units = ({"kt_optimizer_step_s": 1.0}, {"kt_gpu_base_s": 1.0}, {"kt_matmul_flops_per_s": 1.0})
    regressors = [[_estimate(r, _time_model(curves, **u)).gpu_s for u in units] for r in runs]
    optimizer, base, inverse_rate = weighted_fit(regressors, rest, scale)
    fitted.update(kt_optimizer_step_s=significant(optimizer), kt_gpu_base_s=significant(base),
                  kt_matmul_flops_per_s=significant(1 / inverse_rate) if inverse_rate > 0 else math.inf)
    return fitted


def _memory(run: dict[str, Any], **constants: float):
    model = KtMemoryModel(**{**{n: 0 for n in MEMORY_CONSTANTS}, **constants})
    return estimate_kt_sft_memory(run["size"], run["sft"], model)


def fit_memory(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The memory constants, fitted on the ``runs`` that measured them (rounded)."""
    gpu_runs = [r for r in runs if r["gpu_mib"] is not None]
    measured = [r["gpu_mib"] * MiB for r in gpu_runs]
    fixed = [_memory(r).gpu_bytes for r in gpu_runs]
    regressors = [[_memory(r, gpu_layer_activation_bytes=1).gpu_bytes - f,
                   _memory(r, gpu_no_offload_extra_bytes=1).gpu_bytes - f] for r, f in zip(gpu_runs, fixed)]
    per_token, extra = weighted_fit(regressors, [m - f for m, f in zip(measured, fixed)], measured)
    rss_runs = [r for r in runs if r["rss_gib"] is not None]
    measured = [r["rss_gib"] * GiB for r in rss_runs]
    fixed = [_memory(r).rss_bytes for r in rss_runs]
    regressors = [[_memory(r, rss_retained_bytes=1e6).rss_bytes / 1e6 - f / 1e6] for r, f in zip(rss_runs, fixed)]
    [retained] = weighted_fit(regressors, [m - f for m, f in zip(measured, fixed)], measured)
    return {"gpu_layer_activation_bytes": significant(per_token),
            "gpu_no_offload_extra_bytes": int(significant(extra / MiB, 3)) * MiB,
            "rss_retained_bytes": significant(retained)}


def fit(data: Path = DATA) -> dict[str, Any]:
    """Fit on the runs not held out; predict every run with the rounded constants."""
    runs = load_runs(data)
    curves = host_curves(data)
    sample = [r for r in runs if not r["held_out"]]
    time_constants = fit_time(sample, curves)
    memory_constants = fit_memory(sample)
    rawint4 = {"kt_pass_bytes_per_param": {"rawint4": KT_BYTES_PER_PARAM["rawint4"]},
               "kt_flop_factor_by_format": {"rawint4": 1.0}}
    bf16 = fit_bf16(CostModel(**curves, **time_constants, **rawint4))
    time_constants.update({k: bf16[k] for k in rawint4})
    costs = CostModel(**curves, **time_constants)
    memory = KtMemoryModel(**memory_constants)
    table = []
    for run in runs:
        est = _estimate(run, costs)
        mem = estimate_kt_sft_memory(run["size"], run["sft"], memory)
        row: dict[str, Any] = {
            "run": run["name"], "set": "held out" if run["held_out"] else "fit", "model": run["model"],
            "tokens_per_micro_batch": run["tokens"], "micro_batches": run["micro_batches"], "threads": run["threads"],
            "step_s": [round(est.step_s, 2), run["step"]], "kt_forward_s": [round(est.kt_forward_s, 2), run["forward"]],
            "kt_backward_s": [round(est.kt_backward_s, 2), run["backward"]],
            "rest_s": [round(est.gpu_s, 2), round(run["step"] - run["forward"] - run["backward"], 2)],
            "step_over_bytes_floor": round(run["step"] / est.bytes_floor_s, 1),
            "step_over_flop_floor": round(run["step"] / est.flop_floor_s, 1),
            "gpu_mib": [round(mem.gpu_bytes / MiB), run["gpu_mib"]],
            "rss_gib": [round(mem.rss_bytes / GiB, 2), run["rss_gib"]],
        }
        for key in ("step_s", "gpu_mib", "rss_gib"):
            predicted, actual = row[key]
            row[f"{key.rsplit('_', 1)[0]}_residual"] = None if actual is None else round(predicted / actual - 1, 4)
        table.append(row)

    def worst(figure: str, which: str) -> float | None:
        values = [abs(r[f"{figure}_residual"]) for r in table if r["set"] == which and r[f"{figure}_residual"] is not None]
        return round(max(values), 4) if values else None

    return {
        "model": "ktflow.planning.costs.kt_step_estimate / ktflow.planning.sizing.estimate_kt_sft_memory",
        "script": "benchmarks/kt_step_model.py",
        "held_out": list(HELD_OUT),
        "fitted_on": [r["name"] for r in sample],
        "host_curves": {k: {str(t): v for t, v in c.items()} for k, c in curves.items()},
        "time_constants": time_constants,
        "memory_constants": memory_constants,
        "runs": table,
        "worst_abs_residual": {which: {f: worst(f, which) for f in ("step", "gpu", "rss")}
                               for which in ("fit", "held out")},
        "bf16": bf16,
    }


BF16_LEGS = {  # calibration.json's BF16-expert KT legs and the overrides of benchmarks/recipes/v2-lite-kt.yaml they ran
    "v2lite-kt-default": [], "v2lite-kt-default-repeat-h100b": [], "v2lite-kt-default-profile-h100b": [],
    "v2lite-kt-tuned": ["sft.kt_config.kt_share_backward_bb=false", "sft.kt_cpu_activation=retain"],
}
BF16_PROFILE = "v2lite-kt-default-profile-h100b"
BF16_HYPOTHESES = {"per parameter, as RAWINT4": KT_BYTES_PER_PARAM["rawint4"], "per stored byte": KT_BYTES_PER_PARAM["bf16"]}


def _bf16_legs() -> list[dict[str, Any]]:
    calibration = json.loads((REPO / "benchmarks/data/calibration.json").read_text())
    legs = []
    for leg in calibration["legs"]:
        if leg["id"] not in BF16_LEGS:
            continue
        sft = load_recipe(REPO / "benchmarks/recipes/v2-lite-kt.yaml", BF16_LEGS[leg["id"]]).sft
        m = leg["model"]
        size = ModelSize(path=m["model_id"], linear_shapes={}, **ModelFacts(
            parameters=m["total_parameters"], expert_parameters=m["expert_parameters"],
            stored_bytes=m["checkpoint_bytes_on_disk"], expert_stored_bytes=m["expert_bytes_as_stored"],
            num_layers=m["num_layers"], moe_layers=m["moe_layers"], hidden_size=m["hidden_size"],
            vocab_size=m["vocab_size"], routed_experts=m["routed_experts"],
            experts_per_token=m["experts_per_token"]).model_dump())
        legs.append({"name": leg["id"], "size": size, "sft": sft, "threads": leg["host"]["cpu_physical_cores"],
                     "tokens": leg["tokens"]["tokens_per_optimizer_step"] / sft.gradient_accumulation_steps,
                     "step": leg["measured"]["steady_step_s"], "timers": leg["measured"].get("kt_timers_per_step")})
    return legs


def fit_bf16(costs: CostModel) -> dict[str, Any]:
    """BF16 experts, which no kt-throughput run has: for each way of counting their token-independent part
    (per parameter as RAWINT4, or per stored byte), the per-token factor that fits the V2-Lite BF16 profile's
    KT forward and backward (+ its repack wait), and every BF16 leg predicted with it. Ships the hypothesis
    with the smaller worst residual."""
    legs = _bf16_legs()
    profile = next(leg for leg in legs if leg["name"] == BF16_PROFILE)
    timers = profile["timers"]
    targets = [timers["kt_moe_forward_s"], timers["kt_moe_backward_s"] + timers["kt_moe_backward_repack_wait_s"]]
    hypotheses = {}
    for name, pass_bytes in BF16_HYPOTHESES.items():
        base = costs.model_copy(update={"kt_pass_bytes_per_param": {**costs.kt_pass_bytes_per_param, "bf16": pass_bytes}})

        def with_factor(factor: float, model: CostModel = base) -> CostModel:
            return model.model_copy(update={"kt_flop_factor_by_format": {**model.kt_flop_factor_by_format, "bf16": factor}})

        zero, unit = _estimate(profile, with_factor(0.0)), _estimate(profile, with_factor(1.0))
        fixed = [zero.kt_forward_s, zero.kt_backward_s]
        regressors = [[unit.kt_forward_s - zero.kt_forward_s], [unit.kt_backward_s - zero.kt_backward_s]]
        [factor] = weighted_fit(regressors, [t - f for t, f in zip(targets, fixed)], [profile["step"]] * 2)
        model = with_factor(significant(factor))
        rows = []
        for leg in legs:
            predicted = _estimate(leg, model).step_s
            rows.append({"leg": leg["name"], "step_s": [round(predicted, 2), leg["step"]],
                         "residual": round(predicted / leg["step"] - 1, 4)})
        hypotheses[name] = {"bf16_pass_bytes_per_param": pass_bytes, "bf16_flop_factor": significant(factor),
                            "legs": rows, "worst_abs_residual": max(abs(r["residual"]) for r in rows)}
    chosen = min(hypotheses, key=lambda h: hypotheses[h]["worst_abs_residual"])
    return {"fitted_on": f"{BF16_PROFILE}'s kt_timers_per_step (calibration.json)", "chosen": chosen,
            "kt_pass_bytes_per_param": {"rawint4": KT_BYTES_PER_PARAM["rawint4"],
                                        "bf16": hypotheses[chosen]["bf16_pass_bytes_per_param"]},
            "kt_flop_factor_by_format": {"rawint4": 1.0, "bf16": hypotheses[chosen]["bf16_flop_factor"]},
            "hypotheses": hypotheses}


# --------------------------------------------------------------------------- output


def markdown(result: dict[str, Any]) -> str:
    """The table README shows: every run, predicted vs measured."""
    lines = ["| run | set | tokens / micro-batch x micro-batches | threads | step s: predicted / measured (residual) "
             "| peak GPU MiB | peak RSS GiB |", "|---|---|---|---|---|---|---|"]

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        predicted, actual = row[key]
        if actual is None:
            return f"{predicted:{fmt}} / not recorded"
        return f"{predicted:{fmt}} / {actual:{fmt}} ({row[key.rsplit('_', 1)[0] + '_residual']:+.1%})"

    for row in sorted(result["runs"], key=lambda r: (r["set"] != "fit", r["model"], r["tokens_per_micro_batch"],
                                                     r["micro_batches"], -r["threads"])):
        lines.append(f"| {row['run']} | {row['set']} | {row['tokens_per_micro_batch']:,.0f} x {row['micro_batches']} "
                     f"| {row['threads']} | {cell(row, 'step_s', '.2f')} | {cell(row, 'gpu_mib', ',.0f')} "
                     f"| {cell(row, 'rss_gib', '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave fit.json as it is")
    args = parser.parse_args(argv)
    result = fit()
    print(json.dumps({k: result[k] for k in ("time_constants", "memory_constants", "worst_abs_residual")}, indent=1))
    print(markdown(result))
    bf16 = result["bf16"]
    for name, hypothesis in bf16["hypotheses"].items():
        legs = ", ".join(f"{r['leg']} {r['step_s'][0]} / {r['step_s'][1]} s ({r['residual']:+.1%})"
                         for r in hypothesis["legs"])
        mark = " (shipped)" if name == bf16["chosen"] else ""
        print(f"BF16 experts counted {name}{mark}: per-token factor {hypothesis['bf16_flop_factor']}; {legs}")
    if not args.no_write:
        (DATA / "fit.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {DATA / 'fit.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
