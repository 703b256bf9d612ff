"""KT runs never used by the step-time fit, against the model ktflow ships (issue #28, items 1-3).

    .venv/bin/python benchmarks/kt_out_of_sample.py             # print the tables, write check.json
    .venv/bin/python benchmarks/kt_out_of_sample.py --no-write  # print only

Reads docs/benchmarks/kt-throughput/out-of-sample/: the runs of ``gpu_host/throughput.py`` made on one
warm H100 machine after the fit (each ``NAME.json`` holds the run's settings, what it measured from
outside, kt-kernel's timers and ``plan``: ``ktflow plan --json`` of the same recipe, run on that host
after the run) and ``host-quick.json`` (that machine's read bandwidth and BF16 matmul rate at 16 threads).
Nothing here is fitted: every prediction uses the constants in ``ktflow.planning.costs`` as shipped.

Per run, three predictions of the step against the measured one:

- ``planner``: what ``ktflow plan`` printed on the host (tokens a micro-batch estimated from the dataset,
  the reference host's rates);
- ``tokens``: the same model given the tokens the trainer measured (padding included), so that the
  model's error is told apart from the token estimate's;
- ``this host``: as ``tokens``, with the reference host's bandwidth and matmul curves scaled to this
  machine's 16-thread medians (host-quick.json): the model's error apart from the machine's speed.

Then: the same effective batch of 8 split three ways (item 3: the split ``sft.kt_shape_batches`` chose,
the recipe as written, and one by hand; same records in the same order: the real tokens of a step are
the 1 x 8 run's ``total_tokens`` deltas, which carry no padding), with the loss of each step; the KT
settings sweep against its base run; and each run's step as a multiple of the two floors at this
machine's rates (the model's accounting: active experts' bytes x passes / read bandwidth, expert FLOPs
/ matmul rate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ktflow.planning.costs import COSTS, CostModel, kt_step_estimate  # noqa: E402
from ktflow.planning.sizing import ModelSize  # noqa: E402
from ktflow.recipe import load_recipe  # noqa: E402

DATA = REPO / "docs/benchmarks/kt-throughput/out-of-sample"
# The reference host's 16-thread medians the shipped curves hold (kt-throughput/host.json).
REFERENCE_READ_GB_S, REFERENCE_MATMUL_TFLOPS = COSTS.kt_read_gb_s[16], COSTS.kt_matmul_tflops[16]
SPLITS = ("written", "shaped", "hand-4x2")  # one effective batch of 8 records, three splits
SWEEP_BASE = "v2l-base"
SWEEP = {"v2l-shareb": "kt_share_backward_bb: true", "v2l-recompute": "kt_cpu_activation: recompute",
         "v2l-cache2": "kt_max_cache_depth: 2"}
MiB, GiB = 1 << 20, 1 << 30


def load(data: Path = DATA) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(data.glob("*.json"))
            if "." not in p.stem and p.stem not in ("host-quick", "chat-data", "check")}
    return runs, json.loads((data / "host-quick.json").read_text())


def this_host(host: dict[str, Any]) -> CostModel:
    """The shipped model with its rate curves scaled to ``host``'s 16-thread medians."""
    read = host["memory_bandwidth"]["by_threads"]["16"]["read_gb_s_median"]
    matmul = next(r["tflops_median"] for r in host["bf16_matmul"]["rows"] if r["threads"] == 16)
    return COSTS.model_copy(update={
        "kt_read_gb_s": {t: v * read / REFERENCE_READ_GB_S for t, v in COSTS.kt_read_gb_s.items()},
        "kt_matmul_tflops": {t: v * matmul / REFERENCE_MATMUL_TFLOPS for t, v in COSTS.kt_matmul_tflops.items()}})


def _sft_stage(run: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in run["plan"]["stages"] if s["stage"] == "sft")


def _estimate(run: dict[str, Any], costs: CostModel):
    """The model's step for ``run``, given the tokens a micro-batch carried as the trainer counted them."""
    settings = run["settings"]
    sets = [s for s in run["sets"] if s.startswith("sft.")] + [
        f"sft.per_device_train_batch_size={settings['per_device_train_batch_size']}",
        f"sft.gradient_accumulation_steps={settings['gradient_accumulation_steps']}"]
    sft = load_recipe(REPO / run["recipe"], sets).sft
    size = ModelSize(**run["plan"]["model"], linear_shapes={})
    return kt_step_estimate(size, sft, settings["kt_num_threads"], costs, run["tokens_per_microbatch_measured"])


def _residual(predicted: float, measured: float) -> float:
    return round(predicted / measured - 1, 4)


def predictions(runs: dict[str, dict[str, Any]], host: dict[str, Any]) -> list[dict[str, Any]]:
    local = this_host(host)
    rows = []
    for name, run in runs.items():
        stage, step = _sft_stage(run), run["steady_step_s"]
        shipped, scaled = _estimate(run, COSTS), _estimate(run, local)
        kt = run["kt_timers"]["kt_moe_s_per_step"]
        rows.append({
            "run": name, "model": run["plan"]["model"]["path"].split("/build/", 1)[-1],
            "expert_format": run["train_config"]["kt_config"]["kt_expert_weight_format"],
            "split": f"{run['settings']['per_device_train_batch_size']} x {run['settings']['gradient_accumulation_steps']}",
            "cutoff_len": run["settings"]["cutoff_len"], "tokens_per_micro_batch": run["tokens_per_microbatch_measured"],
            "planner_tokens_per_micro_batch": _planner_tokens(stage),
            "step_s": step, "step_spread_s": run["steady_step_spread_s"],
            "kt_forward_s": kt["forward"], "kt_backward_s": kt["backward"], "kt_repack_wait_s": kt["backward_repack_wait"],
            "planner_step_s": round(stage["step_seconds"], 2), "planner_residual": _residual(stage["step_seconds"], step),
            "tokens_step_s": round(shipped.step_s, 2), "tokens_residual": _residual(shipped.step_s, step),
            "this_host_step_s": round(scaled.step_s, 2), "this_host_residual": _residual(scaled.step_s, step),
            "gpu_mib": run["peak_gpu_mib"], "planner_gpu_mib": round(stage["gpu_bytes"] / MiB),
            "gpu_residual": _residual(stage["gpu_bytes"] / MiB, run["peak_gpu_mib"]),
            "rss_gib": run["peak_host_rss_gib"], "planner_rss_gib": round(stage["ram_bytes"] / GiB, 2),
            "rss_residual": _residual(stage["ram_bytes"] / GiB, run["peak_host_rss_gib"]),
            "step_over_bytes_floor": round(step / scaled.bytes_floor_s, 1),
            "step_over_flop_floor": round(step / scaled.flop_floor_s, 1),
            "load_s": run["load_s"],
        })
    return rows


def _planner_tokens(stage: dict[str, Any]) -> float:
    """Tokens a micro-batch as the planner's line states them ("... s, N tokens a micro-batch: ...")."""
    words = stage["time_basis"].split(" tokens a micro-batch")[0].split()
    return float(words[-1].replace(",", ""))


def _per_step(cumulative: list[int]) -> list[int]:
    """Each step's tokens from the trainer log's running ``total_tokens``."""
    return [b - a for a, b in zip([0, *cumulative], cumulative)]


def shaping(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Item 3: one effective batch of 8 records split three ways, same records in the same order."""
    written = runs["written"]
    real = _per_step(written["tokens_logged"])  # 1 x 8: no padding
    first, last = written["steady_steps"]
    steady_real = statistics.mean(real[first - 1:last])
    rows = {}
    for name in SPLITS:
        run = runs[name]
        rows[name] = {"split": f"{run['settings']['per_device_train_batch_size']} x "
                               f"{run['settings']['gradient_accumulation_steps']}",
                      "step_s": run["steady_step_s"], "real_tokens_per_s": round(steady_real / run["steady_step_s"], 1),
                      "padded_tokens_per_step": _per_step(run["tokens_logged"]),
                      "gpu_mib": run["peak_gpu_mib"], "rss_gib": run["peak_host_rss_gib"], "losses": run["losses"],
                      "chosen_by": "; ".join(run.get("batch_shape") or []) or "the recipe (--set)"}
    base = rows["written"]
    for row in rows.values():
        row["speedup_vs_written"] = round(base["step_s"] / row["step_s"], 3)
        row["max_loss_diff_vs_written"] = round(max(abs(a - b) for a, b in zip(row["losses"], base["losses"])), 4)
    fastest = min(rows, key=lambda n: rows[n]["step_s"])
    return {"real_tokens_per_step": real, "steady_real_tokens_per_step": steady_real, "runs": rows,
            "fastest": fastest, "shaped_vs_fastest": round(rows[fastest]["step_s"] / rows["shaped"]["step_s"], 3)}


def sweep(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    base = runs[SWEEP_BASE]
    rows = []
    for name, setting in SWEEP.items():
        run = runs[name]
        kt, kt0 = run["kt_timers"]["kt_moe_s_per_step"], base["kt_timers"]["kt_moe_s_per_step"]
        rows.append({"run": name, "setting": setting, "step_s": run["steady_step_s"], "base_step_s": base["steady_step_s"],
                     "step_ratio": round(run["steady_step_s"] / base["steady_step_s"], 3),
                     "rss_gib": run["peak_host_rss_gib"], "base_rss_gib": base["peak_host_rss_gib"],
                     "rss_ratio": round(run["peak_host_rss_gib"] / base["peak_host_rss_gib"], 3),
                     "gpu_mib": run["peak_gpu_mib"], "base_gpu_mib": base["peak_gpu_mib"],
                     "kt_forward_s": [kt["forward"], kt0["forward"]], "kt_backward_s": [kt["backward"], kt0["backward"]],
                     "kt_repack_wait_s": [kt["backward_repack_wait"], kt0["backward_repack_wait"]],
                     "losses": [run["losses"], base["losses"]]})
    return rows


def check(data: Path = DATA) -> dict[str, Any]:
    runs, host = load(data)
    rows = predictions(runs, host)
    worst = {key: round(max(abs(r[key]) for r in rows), 4)
             for key in ("planner_residual", "tokens_residual", "this_host_residual", "gpu_residual", "rss_residual")}
    return {"host": {"cpu_model": host.get("cpu_model"),
                     "read_gb_s_16": host["memory_bandwidth"]["by_threads"]["16"]["read_gb_s_median"],
                     "matmul_tflops_16": next(r["tflops_median"] for r in host["bf16_matmul"]["rows"]),
                     "reference_read_gb_s_16": REFERENCE_READ_GB_S, "reference_matmul_tflops_16": REFERENCE_MATMUL_TFLOPS},
            "runs": rows, "worst": worst, "shaping": shaping(runs), "sweep": sweep(runs)}


def markdown(result: dict[str, Any]) -> str:
    def pct(x: float) -> str:
        return f"{x:+.1%}"

    lines = ["| run | experts | split x cutoff | tokens / micro-batch (planner) | step s | planner | with measured "
             "tokens | at this host's rates | GPU MiB (planner) | RSS GiB (planner) | step / bytes floor | "
             "step / FLOP floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(
            f"| {r['run']} | {r['expert_format']} | {r['split']} x {r['cutoff_len']} | {r['tokens_per_micro_batch']:,.0f} "
            f"({r['planner_tokens_per_micro_batch']:,.0f}) | {r['step_s']} | {r['planner_step_s']} "
            f"({pct(r['planner_residual'])}) | {r['tokens_step_s']} ({pct(r['tokens_residual'])}) | "
            f"{r['this_host_step_s']} ({pct(r['this_host_residual'])}) | {r['gpu_mib']:,} ({pct(r['gpu_residual'])}) | "
            f"{r['rss_gib']} ({pct(r['rss_residual'])}) | {r['step_over_bytes_floor']} | {r['step_over_flop_floor']} |")
    shaping = result["shaping"]
    lines += ["", "| split (effective batch 8) | chosen by | step s | real tokens/s | x written | GPU MiB | RSS GiB | "
              "loss steps 1-3 | max loss diff |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in shaping["runs"].items():
        chosen = ("ktflow (sft.kt_shape_batches)" if r["chosen_by"].startswith("sft batch shape")
                  else "the recipe as written" if name == "written" else "by hand")
        lines.append(f"| {r['split']} ({name}) | {chosen} | {r['step_s']} | {r['real_tokens_per_s']} | "
                     f"{r['speedup_vs_written']} | {r['gpu_mib']:,} | {r['rss_gib']} | "
                     f"{', '.join(f'{x:.3f}' for x in r['losses'])} | {r['max_loss_diff_vs_written']} |")
    lines += ["", "| setting (V2-Lite BF16, 4 x 256) | step s (base) | x | RSS GiB (base) | x | "
              "KT fwd / bwd / repack wait s |",
              "|---|---|---|---|---|---|"]
    for r in result["sweep"]:
        lines.append(f"| {r['setting']} | {r['step_s']} ({r['base_step_s']}) | {r['step_ratio']} | {r['rss_gib']} "
                     f"({r['base_rss_gib']}) | {r['rss_ratio']} | {r['kt_forward_s'][0]} / {r['kt_backward_s'][0]} / "
                     f"{r['kt_repack_wait_s'][0]} (base {r['kt_forward_s'][1]} / {r['kt_backward_s'][1]} / "
                     f"{r['kt_repack_wait_s'][1]}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    result = check(args.data)
    print(markdown(result))
    print("worst |residual|:", json.dumps(result["worst"]))
    if not args.no_write:
        (args.data / "check.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
