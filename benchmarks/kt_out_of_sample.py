"""KT runs never used by the step-time fit, against the model ktflow ships (issue #28, items 1-3).

    .venv/bin/python benchmarks/kt_out_of_sample.py             # print the tables, write the check
    .venv/bin/python benchmarks/kt_out_of_sample.py --no-write  # print only

Reads one folder of benchmarks/data/kt-throughput per device machine (:data:`MACHINES`): the runs of
``gpu_host/throughput.py`` made on that machine after the fit (each ``NAME.json`` holds the run's
settings, what it measured from outside, kt-kernel's timers and ``plan``: ``ktflow plan --json`` of the
same recipe, run on that host after the run) and ``host.json`` (or ``host-quick.json``: the machine's
read bandwidth and BF16 matmul rate). Nothing here is fitted: every prediction uses the constants in
``ktflow.planning.costs`` as shipped. Writes benchmarks/data/kt-throughput/out-of-sample-check.json.

Per run, four predictions of the step against the measured one:

- ``planner``: what ``ktflow plan`` printed on the host (tokens a micro-batch estimated from the dataset,
  the reference host's rates);
- ``tokens``: the same model given the tokens the trainer measured (padding included), so that the
  model's error is told apart from the token estimate's;
- ``this host``: as ``tokens``, with the reference host's bandwidth and matmul curves scaled to this
  machine's 16-thread medians: what a microbenchmark of the machine would explain;
- ``calibrated``: as ``tokens``, scaled as the planner scales it once a host has run KT
  (``ktflow.planning.host_speed.pick_calibration``): the median measured-to-predicted ratio of up to three
  other runs on the same machine with the same expert format, threads and NUMA pools, nearest in tokens a
  micro-batch. Beside it, the worst of calibrating by any one such run alone.

Then, per machine where they were run: the same effective batch of 8 split three ways (item 3: the split
``sft.kt_shape_batches`` chose, the recipe as written, and one by hand; same records in the same order:
the real tokens of a step are the 1 x 8 run's ``total_tokens`` deltas, which carry no padding), with the
loss of each step; the KT settings swept against a base run; and each run's step as a multiple of the
two floors at that machine's rates (active experts' bytes x passes / read bandwidth, expert FLOPs /
matmul rate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ktflow.planning.costs import COSTS, CostModel, kt_expert_format, kt_pools, kt_step_estimate  # noqa: E402
from ktflow.planning.host_speed import KtStepRecord, model_digest, pick_calibration  # noqa: E402
from ktflow.planning.sizing import ModelSize  # noqa: E402
from ktflow.recipe import load_recipe  # noqa: E402

KT = REPO / "benchmarks/data/kt-throughput"
CHECK = KT / "out-of-sample-check.json"
# The reference host's 16-thread medians the shipped curves hold (kt-throughput/host.json).
REFERENCE_READ_GB_S, REFERENCE_MATMUL_TFLOPS = COSTS.kt_read_gb_s[16], COSTS.kt_matmul_tflops[16]
MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Machine:
    """One device machine's runs: where they are, and which of them compare with which."""

    name: str
    folder: str  # under benchmarks/data/kt-throughput
    splits: tuple[str, str, str] | None  # one effective batch of 8: as written (1 x 8), shaped, by hand
    sweeps: dict[str, dict[str, str]]  # base run -> {run: the one setting it changes}

    @property
    def path(self) -> Path:
        return KT / self.folder


MACHINES = (
    Machine("H100 #2", "out-of-sample", ("written", "shaped", "hand-4x2"),
            {"v2l-base": {"v2l-shareb": "kt_share_backward_bb: true", "v2l-recompute": "kt_cpu_activation: recompute",
                          "v2l-cache2": "kt_max_cache_depth: 2"}}),
    Machine("H200 A", "out-of-sample-h200a", ("m3-written", "m3-shaped", "m3-hand-4x2"),
            {"m3-b": {"m3-tp2": "kt_tp_enabled: true, 2 pools of 8 threads", "m3-t8": "kt_num_threads: 8"}}),
    Machine("H200 B", "out-of-sample-h200b", None,
            {"m1-base": {"m1-t4": "kt_num_threads: 4"},
             "v2l-base": {"v2l-t4": "kt_num_threads: 4", "v2l-t8": "kt_num_threads: 8", "v2l-t12": "kt_num_threads: 12",
                          "v2l-tp2": "kt_tp_enabled: true, 2 pools of 8 threads"}}),
    Machine("H200 D", "out-of-sample-h200d", None,
            {"v2l-base": {"v2l-t8": "kt_num_threads: 8", "v2l-t12": "kt_num_threads: 12"},
             "m3-b": {"m3-t12": "kt_num_threads: 12"}}),
)
_NOT_RUNS = ("host", "host-quick", "chat-data", "check", "fixture3")


def load(data: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """A machine folder's runs by name, and its host figures (the full measurement where there is one)."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(data.glob("*.json"))
            if "." not in p.stem and p.stem not in _NOT_RUNS}
    host = data / "host.json" if (data / "host.json").is_file() else data / "host-quick.json"
    return runs, json.loads(host.read_text())


def host_rates(host: dict[str, Any]) -> tuple[float, float]:
    """Read GB/s and BF16 matmul TFLOP/s (the 512 x 7168 @ 7168 x 2048 expert shape) at 16 threads, medians."""
    read = host["memory_bandwidth"]["by_threads"]["16"]["read_gb_s_median"]
    matmul = next(r["tflops_median"] for r in host["bf16_matmul"]["rows"]
                  if (r["threads"], r["m"], r["k"], r["n"]) == (16, 512, 7168, 2048))
    return read, matmul


def this_host(host: dict[str, Any]) -> CostModel:
    """The shipped model with its rate curves scaled to ``host``'s 16-thread medians."""
    read, matmul = host_rates(host)
    return COSTS.model_copy(update={
        "kt_read_gb_s": {t: v * read / REFERENCE_READ_GB_S for t, v in COSTS.kt_read_gb_s.items()},
        "kt_matmul_tflops": {t: v * matmul / REFERENCE_MATMUL_TFLOPS for t, v in COSTS.kt_matmul_tflops.items()}})


def _sft_stage(run: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in run["plan"]["stages"] if s["stage"] == "sft")


def sft_of(run: dict[str, Any]):
    """The run's SFT settings as trained (a shaped run: the split it trained)."""
    settings = run["settings"]
    sets = [s for s in run["sets"] if s.startswith("sft.")] + [
        f"sft.per_device_train_batch_size={settings['per_device_train_batch_size']}",
        f"sft.gradient_accumulation_steps={settings['gradient_accumulation_steps']}"]
    return load_recipe(REPO / run["recipe"], sets).sft


def _estimate(run: dict[str, Any], costs: CostModel):
    """The model's step for ``run``, given the tokens a micro-batch carried as the trainer counted them."""
    size = ModelSize(**run["plan"]["model"], linear_shapes={})
    return kt_step_estimate(size, sft_of(run), run["settings"]["kt_num_threads"], costs,
                            run["tokens_per_microbatch_measured"])


def _record(run: dict[str, Any], predicted: float, group: tuple[str, int, int]) -> KtStepRecord:
    """The run as the SFT stage records it for ``ktflow.planning.host_speed`` (``group``: its
    :func:`calibration_group`)."""
    fmt, threads, pools = group
    return KtStepRecord(host="this machine", expert_format=fmt, threads=threads, pools=pools,
                        measured_step_s=run["steady_step_s"], predicted_step_s=predicted,
                        steps=len(run["step_intervals_s"]), tokens_per_micro_batch=run["tokens_per_microbatch_measured"],
                        expert_bytes=_expert_bytes(run), model=model_digest())


def _expert_bytes(run: dict[str, Any]) -> int:
    return ModelSize(**run["plan"]["model"], linear_shapes={}).expert_stored_bytes


def calibration_group(run: dict[str, Any]) -> tuple[str, int, int]:
    """What a host's measured speed is kept by (``KtStepRecord.matches``): expert format, threads, pools."""
    sft = sft_of(run)
    return kt_expert_format(sft), run["settings"]["kt_num_threads"], kt_pools(sft)


def _residual(predicted: float, measured: float) -> float:
    return round(predicted / measured - 1, 4)


def predictions(runs: dict[str, dict[str, Any]], host: dict[str, Any]) -> list[dict[str, Any]]:
    local = this_host(host)
    read, matmul = host_rates(host)
    shipped = {name: _estimate(run, COSTS).step_s for name, run in runs.items()}
    groups = {name: calibration_group(run) for name, run in runs.items()}
    rows = []
    for name, run in runs.items():
        stage, step = _sft_stage(run), run["steady_step_s"]
        scaled = _estimate(run, local)
        kt = run["kt_timers"]["kt_moe_s_per_step"]
        # calibrated by each other run of the same format, threads and pools on this machine
        peers = {other: shipped[name] * runs[other]["steady_step_s"] / shipped[other]
                 for other in runs if other != name and groups[other] == groups[name]}
        worst_peer = max(peers, key=lambda o: abs(peers[o] / step - 1)) if peers else None
        speed = pick_calibration([(runs[o]["stamp"], o, _record(runs[o], shipped[o], groups[o])) for o in peers],
                                 run["tokens_per_microbatch_measured"], _expert_bytes(run))
        rows.append({
            "run": name, "model": run["plan"]["model"]["path"].split("/build/", 1)[-1],
            "expert_format": groups[name][0], "threads": groups[name][1], "pools": groups[name][2],
            "split": f"{run['settings']['per_device_train_batch_size']} x {run['settings']['gradient_accumulation_steps']}",
            "cutoff_len": run["settings"]["cutoff_len"], "tokens_per_micro_batch": run["tokens_per_microbatch_measured"],
            "planner_tokens_per_micro_batch": _planner_tokens(stage),
            "step_s": step, "step_spread_s": run["steady_step_spread_s"],
            "kt_forward_s": kt["forward"], "kt_backward_s": kt["backward"], "kt_repack_wait_s": kt["backward_repack_wait"],
            "planner_step_s": round(stage["step_seconds"], 2), "planner_residual": _residual(stage["step_seconds"], step),
            "tokens_step_s": round(shipped[name], 2), "tokens_residual": _residual(shipped[name], step),
            "this_host_step_s": round(scaled.step_s, 2), "this_host_residual": _residual(scaled.step_s, step),
            "measured_over_predicted": round(step / shipped[name], 4),
            "calibrated_by": speed.runs if speed else [], "calibrated_factor": speed.factor if speed else None,
            "calibrated_step_s": round(shipped[name] * speed.factor, 2) if speed else None,
            "calibrated_residual": _residual(shipped[name] * speed.factor, step) if speed else None,
            "peers": sorted(peers), "calibrated_worst_by": worst_peer,
            "calibrated_worst_residual": _residual(peers[worst_peer], step) if worst_peer else None,
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


def shaping(runs: dict[str, dict[str, Any]], names: tuple[str, str, str]) -> dict[str, Any]:
    """Item 3: one effective batch of 8 records split three ways (``names``: as written, shaped, by hand),
    same records in the same order."""
    written_name, shaped_name, _ = names
    written = runs[written_name]
    real = _per_step(written["tokens_logged"])  # 1 x 8: no padding
    first, last = written["steady_steps"]
    steady_real = statistics.mean(real[first - 1:last])
    rows = {}
    for name in names:
        run = runs[name]
        rows[name] = {"split": f"{run['settings']['per_device_train_batch_size']} x "
                               f"{run['settings']['gradient_accumulation_steps']}",
                      "step_s": run["steady_step_s"], "real_tokens_per_s": round(steady_real / run["steady_step_s"], 1),
                      "padded_tokens_per_step": _per_step(run["tokens_logged"]),
                      "gpu_mib": run["peak_gpu_mib"], "rss_gib": run["peak_host_rss_gib"], "losses": run["losses"],
                      "chosen_by": "; ".join(run.get("batch_shape") or []) or "the recipe (--set)"}
    base = rows[written_name]
    for row in rows.values():
        row["speedup_vs_written"] = round(base["step_s"] / row["step_s"], 3)
        row["max_loss_diff_vs_written"] = round(max(abs(a - b) for a, b in zip(row["losses"], base["losses"])), 4)
    fastest = min(rows, key=lambda n: rows[n]["step_s"])
    return {"written": written_name, "shaped": shaped_name, "real_tokens_per_step": real,
            "steady_real_tokens_per_step": steady_real, "runs": rows, "fastest": fastest,
            "shaped_vs_fastest": round(rows[fastest]["step_s"] / rows[shaped_name]["step_s"], 3)}


def sweep(runs: dict[str, dict[str, Any]], sweeps: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    rows = []
    for base_name, changed in sweeps.items():
        base = runs[base_name]
        for name, setting in changed.items():
            run = runs[name]
            kt, kt0 = run["kt_timers"]["kt_moe_s_per_step"], base["kt_timers"]["kt_moe_s_per_step"]
            rows.append({"run": name, "base": base_name, "setting": setting, "step_s": run["steady_step_s"],
                         "base_step_s": base["steady_step_s"],
                         "step_ratio": round(run["steady_step_s"] / base["steady_step_s"], 3),
                         "rss_gib": run["peak_host_rss_gib"], "base_rss_gib": base["peak_host_rss_gib"],
                         "rss_ratio": round(run["peak_host_rss_gib"] / base["peak_host_rss_gib"], 3),
                         "gpu_mib": run["peak_gpu_mib"], "base_gpu_mib": base["peak_gpu_mib"],
                         "kt_forward_s": [kt["forward"], kt0["forward"]], "kt_backward_s": [kt["backward"], kt0["backward"]],
                         "kt_repack_wait_s": [kt["backward_repack_wait"], kt0["backward_repack_wait"]],
                         "losses": [run["losses"], base["losses"]]})
    return rows


_RESIDUALS = ("planner_residual", "tokens_residual", "this_host_residual", "calibrated_residual",
              "calibrated_worst_residual", "gpu_residual", "rss_residual")


def _worst(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    return {key: max((round(abs(r[key]), 4) for r in rows if r[key] is not None), default=None) for key in _RESIDUALS}


def check_machine(machine: Machine) -> dict[str, Any]:
    runs, host = load(machine.path)
    rows = predictions(runs, host)
    read, matmul = host_rates(host)
    return {"machine": machine.name, "folder": machine.folder,
            "host": {"gpu": host.get("gpu"), "cpu_model": host.get("cpu_model"), "read_gb_s_16": read,
                     "matmul_tflops_16": matmul, "reference_read_gb_s_16": REFERENCE_READ_GB_S,
                     "reference_matmul_tflops_16": REFERENCE_MATMUL_TFLOPS},
            "runs": rows, "worst": _worst(rows),
            "shaping": shaping(runs, machine.splits) if machine.splits else None,
            "sweep": sweep(runs, machine.sweeps)}


def check(machines: tuple[Machine, ...] = MACHINES) -> dict[str, Any]:
    result = [check_machine(m) for m in machines]
    ratios = [r["measured_over_predicted"] for m in result for r in m["runs"]]
    return {"machines": result, "worst": _worst([r for m in result for r in m["runs"]]),
            "measured_over_predicted": {"min": min(ratios), "max": max(ratios)}}


def markdown(result: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1%}"

    lines = ["| machine | run | experts | threads x pools | split x cutoff | tokens / micro-batch (planner) | step s | "
             "planner | with measured tokens | at this host's rates | calibrated on this host | from one run (worst) | "
             "GPU MiB (planner) | RSS GiB (planner) | step / bytes floor | step / FLOP floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["machines"]:
        for r in m["runs"]:
            calibrated = (f"{r['calibrated_step_s']} ({pct(r['calibrated_residual'])}; by {', '.join(r['calibrated_by'])}) "
                          f"| {pct(r['calibrated_worst_residual'])} ({r['calibrated_worst_by']})"
                          if r["calibrated_by"] else "no run to calibrate by | -")
            lines.append(
                f"| {m['machine']} | {r['run']} | {r['expert_format']} | {r['threads']} x {r['pools']} | {r['split']} x "
                f"{r['cutoff_len']} | {r['tokens_per_micro_batch']:,.0f} ({r['planner_tokens_per_micro_batch']:,.0f}) | "
                f"{r['step_s']} | {r['planner_step_s']} ({pct(r['planner_residual'])}) | {r['tokens_step_s']} "
                f"({pct(r['tokens_residual'])}) | {r['this_host_step_s']} ({pct(r['this_host_residual'])}) | {calibrated} | "
                f"{r['gpu_mib']:,} ({pct(r['gpu_residual'])}) | {r['rss_gib']} ({pct(r['rss_residual'])}) | "
                f"{r['step_over_bytes_floor']} | {r['step_over_flop_floor']} |")
    lines += ["", "| machine | split (effective batch 8) | chosen by | step s | real tokens/s | x written | GPU MiB | "
              "RSS GiB | loss steps 1-3 | max loss diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["machines"]:
        shaping = m["shaping"]
        if shaping is None:
            continue
        for name, r in shaping["runs"].items():
            chosen = ("ktflow (sft.kt_shape_batches)" if r["chosen_by"].startswith("sft batch shape")
                      else "the recipe as written" if name == shaping["written"] else "by hand")
            lines.append(f"| {m['machine']} | {r['split']} ({name}) | {chosen} | {r['step_s']} | {r['real_tokens_per_s']} | "
                         f"{r['speedup_vs_written']} | {r['gpu_mib']:,} | {r['rss_gib']} | "
                         f"{', '.join(f'{x:.3f}' for x in r['losses'])} | {r['max_loss_diff_vs_written']} |")
    lines += ["", "| machine | setting (against its base run) | step s (base) | x | RSS GiB (base) | x | "
              "KT fwd / bwd / repack wait s |", "|---|---|---|---|---|---|---|"]
    for m in result["machines"]:
        for r in m["sweep"]:
            lines.append(f"| {m['machine']} | {r['setting']} ({r['base']}) | {r['step_s']} ({r['base_step_s']}) | "
                         f"{r['step_ratio']} | {r['rss_gib']} ({r['base_rss_gib']}) | {r['rss_ratio']} | "
                         f"{r['kt_forward_s'][0]} / {r['kt_backward_s'][0]} / {r['kt_repack_wait_s'][0]} (base "
                         f"{r['kt_forward_s'][1]} / {r['kt_backward_s'][1]} / {r['kt_repack_wait_s'][1]}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    result = check()
    print(markdown(result))
    print("worst |residual|:", json.dumps(result["worst"]))
    print("measured / predicted (with measured tokens):", json.dumps(result["measured_over_predicted"]))
    if not args.no_write:
        CHECK.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
