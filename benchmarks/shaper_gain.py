"""The shaper's predicted gain against what was measured, by the model's experts per MoE layer.

    .venv/bin/python benchmarks/shaper_gain.py    # prints the table, writes plan-probe/shaper-gain.json

The shaper (``sft.kt_shape_batches``) splits a batch of records into fewer, larger micro-batches when the time model
predicts a faster step. Its gain is the step of another split of the same records over the step of the split it
chose, on one machine, so the machine's own speed largely cancels. Gathered from the runs that trained the same
batch of 8 chat records (127-503 tokens) both ways, each predicted with the constants ktflow ships:

- ``benchmarks/data/kt-throughput/out-of-sample-check.json`` (``benchmarks/kt_out_of_sample.py``): two Kimi-width
  fixtures, 96 experts a MoE layer (model 3, an H200 + 16-core machine) and 180 (model 1, an H100 + 16-core machine),
  each 8 x 1 (the shaper's split), 4 x 2 and 1 x 8 (as the recipe writes it); predicted as ``ktflow plan`` did;
- ``benchmarks/data/plan-probe/reference.json`` (``benchmarks/probe_reference.py``): the Kimi-K2.5 slice, 384 experts
  a MoE layer, on two H200 + 16-core machines and a 4 x H200 + 64-core host; predicted as each run's plan did.

Nothing is fitted here. The time model prices a micro-batch's token-independent work per active expert (its bytes
floors), and its constants were fitted on one expert count (180); the table shows how the gain's error moves with
the count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import probe_reference  # noqa: E402  (the runs it checks, by name, and their folders)

KT = REPO / "benchmarks" / "data" / "kt-throughput"
PROBE = REPO / "benchmarks" / "data" / "plan-probe"
# The fixtures out-of-sample-check.json names, with the file that records their experts a MoE layer.
FIXTURES = {"gpu-host/big/model": KT / "fixture-big.json",
            "gpu-host/tp/model3": KT / "out-of-sample-h200a" / "fixture3.json"}
# The split the shaper chose and the others trained beside it, by run name in out-of-sample-check.json.
SHAPED = {"shaped": ("written", "hand-4x2"), "m3-shaped": ("m3-written", "m3-hand-4x2")}


def _experts(fixture: Path) -> int:
    dims = json.loads(fixture.read_text())["dims"]
    return int(dims.get("n_routed_experts") or dims["experts"])  # the stream writer's record or throughput.py's


def gains() -> list[dict]:
    """Every (shaped, other split) pair: experts a layer, machine, threads, predicted and measured gain."""
    rows = []
    check_file = KT / "out-of-sample-check.json"
    check = json.loads(check_file.read_text())
    for machine in check["machines"]:
        runs = {r["run"]: r for r in machine["runs"]}
        for shaped_name, others in SHAPED.items():
            shaped = runs.get(shaped_name)
            if shaped is None:
                continue
            for other_name in others:
                other = runs[other_name]
                rows.append({"experts_per_layer": _experts(FIXTURES[shaped["model"]]), "machine": machine["machine"],
                             "threads": shaped["threads"], "shaped": shaped["split"], "other": other["split"],
                             "predicted_gain": other["planner_step_s"] / shaped["planner_step_s"],
                             "measured_gain": other["step_s"] / shaped["step_s"],
                             "source": f"{check_file.relative_to(REPO)}: {shaped_name}, {other_name}"})
    reference = json.loads((PROBE / "reference.json").read_text())
    checks = {c["check"]: c for c in reference["checks"]}
    folders = {name: folder for name, folder, _ in probe_reference.CHECKS}
    for gain in reference["shaper_gain"]:
        shaped = checks[gain["shaped"]]
        folder = folders[gain["shaped"]]
        rows.append({"experts_per_layer": _experts(folder / "fixture.json"), "machine": gain["shaped"].split(",")[0],
                     "threads": shaped["threads"], "shaped": probe_reference.split_of(gain["shaped"]),
                     "other": probe_reference.split_of(gain["as_written"]),
                     "predicted_gain": gain["predicted_gain"], "measured_gain": gain["measured_gain"],
                     "source": f"{(PROBE / 'reference.json').relative_to(REPO)}: {gain['shaped']}"})
    for row in rows:
        row["error"] = row["predicted_gain"] / row["measured_gain"] - 1
    return sorted(rows, key=lambda r: (r["experts_per_layer"], r["other"] != "1 x 8", r["other"], r["threads"],
                                       r["machine"]))


def main() -> int:
    rows = gains()
    print(f"{'experts':>7} {'machine':<24} {'threads':>7} {'split':<14} {'predicted':>9} {'measured':>8} {'error':>7}")
    for r in rows:
        print(f"{r['experts_per_layer']:>7} {r['machine']:<24} {r['threads']:>7} {r['other'] + ' / ' + r['shaped']:<14} "
              f"{r['predicted_gain']:>8.2f}x {r['measured_gain']:>7.2f}x {r['error']:>+7.1%}")
    out = PROBE / "shaper-gain.json"
    out.write_text(json.dumps({"gains": rows}, indent=1) + "\n")
    print(f"written: {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
