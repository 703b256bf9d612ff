"""Kimi-K2.5 INT4 -> BF16: ktflow's streaming dequantizer against compressed-tensors and the disk.

Command (from the repository root):

    .venv/bin/python benchmarks/dequant.py
    # options: [--experts 12] [--workers N] [--workdir DIR] [--keep] [--repeat 3] [--json PATH]

What it does:
1. Builds, in a fresh directory under ``--workdir`` (default ``.ktflow/bench/``; removed unless
   ``--keep``), a Kimi-K2.5-layout INT4 checkpoint: the routed experts of MoE layer 1 with Kimi's real
   shapes (gate/up [2048, 7168], down [7168, 2048]) packed by compressed-tensors' own ``pack_to_int32``
   (int4 in [-7, 7], bf16 scale = absmax/7 per group of 32, int32 ``weight_shape``), a few pass-through
   tensors (bf16 attention and router weights, the fp32 ``e_score_correction_bias``), 4 shards (one
   ``weight_scale`` in another shard than its ``weight_packed``, as in real Kimi shards), an index and a
   nested ``text_config`` with Kimi's dims that ``ktflow.formats.checkpoint.inspect_checkpoint`` accepts.
   12 experts (default) = 1.06 GB of BF16 output.
2. Runs, each in its own subprocess (peak RSS = that child's ``ru_maxrss`` from ``os.wait4``), in order:
   a. compressed-tensors ``convert_checkpoint`` (CPU, ``max_workers=1``, as tests/conftest.py), no fsync;
   b. ktflow ``dequantize_checkpoint(workers=W, fsync=False)``;
   c. the same with ``fsync=True`` (each shard fsynced before it is published);
   d. a plain sequential write of the same number of bytes (64 MiB chunks of one preallocated random
      buffer) into the same directory, with fsync at the end (the physical limit), then without fsync.
   Before every run: ``sync`` (no dirty pages of the previous run left to write back), the earlier
   outputs' cached pages dropped with ``posix_fadvise(DONTNEED)`` (unprivileged; the global page cache is
   NOT dropped), and the input read once in full, so every conversion starts with a warm input.
   Wall time is the conversion call alone, measured in the child (interpreter and imports excluded).
   a-d are repeated ``--repeat`` times (default 3; small boxes are noisy): the table gives the median
   wall time with its range, and the largest peak RSS.
3. Compares b's output with a's tensor by tensor (names, dtypes, shapes, raw bytes); exits 1 on any
   difference.
4. Prints host, table and the tracked ratios: ours(no fsync)/compressed-tensors throughput (target >= 5x),
   ours(fsync) wall / plain write+fsync wall (target <= 1.3), peak RSS of ours (target <= 1 GB). With (a)
   it prints plain write (no fsync, its fastest run) / compressed-tensors and ours / that plain write. d is
   one stream: on 2 cores it is the ceiling for any converter (both cores are busy either way); on many
   cores, writers on several files at once go past it (measured: 16-core Xeon, ours 9.8 GB/s vs d 4.2).
   The box may be shared: each row also gives the child's CPU seconds (much less sensitive to other
   processes than wall time) and how many CPUs other processes kept busy during its runs (from
   ``/proc/stat``, the child's own CPU time subtracted; kernel writeback threads count as others); a
   warning is printed when that was significant.
Units are decimal (MB = 1e6 bytes, GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ChildRun, evict, host_info, parent_peak_rss, report, run_child, warm  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HIDDEN, MOE_INTER, GROUP, N_SHARDS = 7168, 2048, 32, 4
PREFIX = "language_model.model.layers.1"
PROJ_SHAPES = {"gate": (MOE_INTER, HIDDEN), "up": (MOE_INTER, HIDDEN), "down": (HIDDEN, MOE_INTER)}
TARGETS = {"speedup_vs_ct": 5.0, "fsync_vs_plain": 1.3, "peak_rss_bytes": 1e9}
BUSY = 0.2  # CPUs kept busy by other processes during a run above which the figures are flagged as contended
LABELS = {"ct": "a. compressed-tensors convert_checkpoint", "ours": "b. ktflow dequantize, no fsync",
          "ours-fsync": "c. ktflow dequantize, fsync", "plain-fsync": "d. plain sequential write + fsync",
          "plain": "d. plain sequential write, no fsync"}
QUANT = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": GROUP, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}},
    "format": "pack-quantized", "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def kimi_config(experts: int) -> dict[str, Any]:
    """Kimi-K2.5's config.json with Kimi's dims; 2 layers (dense 0, MoE 1) and ``experts`` routed experts."""
    text = {"model_type": "deepseek_v3", "dtype": "bfloat16", "hidden_size": HIDDEN, "intermediate_size": 18432,
            "moe_intermediate_size": MOE_INTER, "num_hidden_layers": 2, "first_k_dense_replace": 1,
            "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": min(8, experts),
            "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "vocab_size": 163840,
            "tie_word_embeddings": False, "quantization_config": QUANT}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "dtype": "bfloat16",
            "text_config": text, "vision_config": {"model_type": "kimi_k25_vision", "text_hidden_size": HIDDEN}}


# --------------------------------------------------------------------------- child jobs


def job_build(src: Path, experts: int) -> dict[str, Any]:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    src.mkdir(parents=True, exist_ok=True)
    n_shards = min(N_SHARDS, experts)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n_shards)]
    for e in range(experts):
        for proj, (rows, cols) in PROJ_SHAPES.items():
            w = torch.randn(rows, cols // GROUP, GROUP, generator=gen)
            scale = (w.abs().amax(-1) / 7).to(torch.bfloat16)
            q = torch.round(w / scale.float().unsqueeze(-1)).clamp_(-7, 7).to(torch.int8).view(rows, cols)
            base = f"{PREFIX}.mlp.experts.{e}.{proj}_proj.weight"
            shard = shards[e * n_shards // experts]
            shard[base + "_packed"] = pack_to_int32(q, 4)
            shard[base + "_scale"] = scale
            shard[base + "_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
    if n_shards > 1:  # a companion in another shard than its weight_packed, as in real Kimi shards
        name = f"{PREFIX}.mlp.experts.0.down_proj.weight_scale"
        shards[1][name] = shards[0].pop(name)
    shards[0].update({
        f"{PREFIX}.self_attn.q_a_proj.weight": torch.randn(1536, HIDDEN, generator=gen).to(torch.bfloat16),
        f"{PREFIX}.self_attn.kv_a_proj_with_mqa.weight": torch.randn(576, HIDDEN, generator=gen).to(torch.bfloat16),
        f"{PREFIX}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        f"{PREFIX}.mlp.gate.weight": torch.randn(experts, HIDDEN, generator=gen).to(torch.bfloat16),
        f"{PREFIX}.mlp.gate.e_score_correction_bias": torch.randn(experts, generator=gen),  # fp32, stays fp32
    })
    weight_map: dict[str, str] = {}
    total = 0
    for i, members in enumerate(shards):
        shard_name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(members, src / shard_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, shard_name))
        total += sum(t.numel() * t.element_size() for t in members.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (src / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (src / "config.json").write_text(json.dumps(kimi_config(experts), indent=2))
    from ktflow.formats.checkpoint import inspect_checkpoint

    info = inspect_checkpoint(src)
    return {"format": info.format, "tensors": info.num_tensors, "input_bytes": info.tensor_bytes}


def job_convert(kind: str, src: Path, dst: Path, workers: int | None) -> dict[str, Any]:
    if kind == "ct":
        import torch
        from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, convert_checkpoint

        c0, t0 = time.process_time(), time.perf_counter()
        convert_checkpoint(src, dst, converter=CompressedTensorsDequantizer(src, dtype=torch.bfloat16),
                           max_workers=1, device="cpu")
        return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    from ktflow.stages.dequantize import _physical_cores, dequantize_checkpoint

    c0, t0 = time.process_time(), time.perf_counter()
    result = dequantize_checkpoint(src, dst, workers=workers, fsync=kind == "ours-fsync")
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "workers": workers or _physical_cores(), "bytes": result.bytes_written}


def job_plain(path: Path, nbytes: int, fsync: bool) -> dict[str, Any]:
    chunk = memoryview(os.urandom(64 << 20))  # preallocated before the clock starts
    c0, t0 = time.process_time(), time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def job_compare(ref: Path, ours: Path) -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    maps = [json.loads((d / "model.safetensors.index.json").read_text())["weight_map"] for d in (ref, ours)]
    diffs = [f"only in {d.name}: {n}" for d, m, o in ((ref, maps[0], maps[1]), (ours, maps[1], maps[0]))
             for n in sorted(set(m) - set(o))]
    for name in sorted(set(maps[0]) & set(maps[1])):
        with safe_open(ref / maps[0][name], "pt") as fa, safe_open(ours / maps[1][name], "pt") as fb:
            a, b = fa.get_tensor(name), fb.get_tensor(name)
        if a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(f"{name}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}")
        elif not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            diffs.append(f"{name}: bytes differ")
    return {"compared": len(set(maps[0]) & set(maps[1])), "diffs": diffs}


def child_main(args: argparse.Namespace) -> None:
    run = Path(args.workdir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child == "build":
        report(job_build(run / "src", args.experts))
    elif args.child in ("ct", "ours", "ours-fsync"):
        report(job_convert(args.child, run / "src", run / f"out-{args.child}", args.workers))
    elif args.child.startswith("plain"):
        report(job_plain(run / "plain.bin", args.nbytes, fsync=args.child == "plain-fsync"))
    elif args.child == "idle":
        import ktflow.stages.dequantize  # noqa: F401  (the import cost that every ktflow run's RSS includes)
    elif args.child == "compare":
        report(job_compare(run / "out-ct", run / "out-ours"))


# --------------------------------------------------------------------------- orchestration (no torch here)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=12, help="routed experts (12 = 1.06 GB BF16 out)")
    p.add_argument("--workers", type=int, default=None, help="ktflow workers (default: its own, physical cores)")
    p.add_argument("--workdir", type=Path, default=REPO / ".ktflow" / "bench", help="a fresh run dir is made in it")
    p.add_argument("--keep", action="store_true", help="keep the run dir (checkpoint and outputs)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of a-d; wall = median (default 3)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child_main(args)
        return 0

    args.workdir.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="dequant-", dir=args.workdir))
    me, common = str(Path(__file__).resolve()), ["--workdir", str(run), "--experts", str(args.experts)]
    if args.workers:
        common += ["--workers", str(args.workers)]

    def child(job: str, *extra: str) -> ChildRun:
        r = run_child([me, "--child", job, *common, *extra], run / f"{job}.log")
        if r.returncode != 0:
            print(f"{job} failed (exit {r.returncode}); last output:\n" + r.log.read_text()[-3000:], file=sys.stderr)
            raise SystemExit(1)
        return r

    try:
        host = host_info(["torch", "compressed-tensors", "safetensors"])
        print(f"host: {host['cpu']}, {host['physical_cores']} physical / {host['logical_cores']} logical cores, "
              f"{host['memory_gb']} GB RAM, Linux {host['kernel']}, Python {host['python']}, "
              + ", ".join(f"{k} {v}" for k, v in host["packages"].items()))
        built = child("build")
        src = run / "src"
        print(f"input: {run}/src, {built.result['format']}, {built.result['tensors']} tensors, "
              f"{built.result['input_bytes'] / 1e9:.3f} GB, built in {built.wall:.1f} s")
        nbytes = 0
        samples: dict[str, list[ChildRun]] = {job: [] for job in LABELS}
        for rep in range(args.repeat):
            for job in ("ct", "ours", "ours-fsync"):
                shutil.rmtree(run / f"out-{job}", ignore_errors=True)  # else ours returns its cached artifact
                evict([run / f"out-{j}" for j in ("ct", "ours", "ours-fsync")])
                warm([src])
                samples[job].append(child(job))
                if job == "ours" and rep == 0:
                    cmp = child("compare").result
                    if cmp["diffs"]:
                        print(f"FAIL: ktflow's output differs from compressed-tensors' in {len(cmp['diffs'])} of "
                              f"{cmp['compared']} tensors:\n  " + "\n  ".join(cmp["diffs"][:20]))
                        return 1
                    print(f"bit-exact: all {cmp['compared']} tensors of ktflow's output equal compressed-tensors' "
                          "(names, dtypes, shapes, bytes)")
            nbytes = samples["ours"][0].result["bytes"]
            for job in ("plain-fsync", "plain"):
                evict([run / f"out-{j}" for j in ("ct", "ours", "ours-fsync")])
                samples[job].append(child(job, "--nbytes", str(nbytes)))
                (run / "plain.bin").unlink()
        idle = child("idle")

        figures: dict[str, dict[str, float]] = {}
        for job, rs in samples.items():
            secs = sorted(r.result["seconds"] for r in rs)
            figures[job] = {"seconds": statistics.median(secs), "min_s": secs[0], "max_s": secs[-1],
                            "peak_rss_mb": max(r.peak_rss for r in rs) / 1e6,
                            "gb_per_s": nbytes / 1e9 / statistics.median(secs),
                            "cpu_s": statistics.median(r.result["cpu_seconds"] for r in rs),
                            "others_busy": statistics.median(r.others_busy for r in rs)}
        workers = samples["ours"][0].result["workers"]
        print(f"\nBF16 output: {nbytes / 1e9:.3f} GB ({args.experts} experts); ktflow workers = {workers}; "
              f"{args.repeat} repetition(s): wall = median [min-max], RSS = max; before each run: sync, earlier "
              "outputs evicted, input read once (warm)")
        print("CPU s = CPU seconds of the child (all threads) in the timed call, median; others = CPUs kept busy "
              "by other processes on the box during its runs, median")
        print(f"{'run':42} {'wall s':>6} {'[min - max]':>13} {'peak RSS MB':>12} {'GB/s':>6} {'CPU s':>6} {'others':>6}")
        for job, f in figures.items():
            print(f"{LABELS[job]:42} {f['seconds']:6.2f} [{f['min_s']:5.2f} -{f['max_s']:5.2f}] "
                  f"{f['peak_rss_mb']:12.0f} {f['gb_per_s']:6.3f} {f['cpu_s']:6.2f} {f['others_busy']:6.2f}")
        ratios = {
            "speedup_vs_ct": figures["ct"]["seconds"] / figures["ours"]["seconds"],
            "fsync_vs_plain": figures["ours-fsync"]["seconds"] / figures["plain-fsync"]["seconds"],
            "peak_rss_bytes": 1e6 * max(figures["ours"]["peak_rss_mb"], figures["ours-fsync"]["peak_rss_mb"]),
            # context for (a): one plain write stream of the same bytes, its fastest run (a slow one is
            # other load). On 2 cores no converter beats it; on many cores parallel writers can.
            "plain_vs_ct": figures["ct"]["seconds"] / figures["plain"]["min_s"],
            "ours_vs_plain": figures["plain"]["min_s"] / figures["ours"]["seconds"],
        }
        ok = {"speedup_vs_ct": ratios["speedup_vs_ct"] >= TARGETS["speedup_vs_ct"],
              "fsync_vs_plain": ratios["fsync_vs_plain"] <= TARGETS["fsync_vs_plain"],
              "peak_rss_bytes": ratios["peak_rss_bytes"] <= TARGETS["peak_rss_bytes"]}
        mark = {True: "ok", False: "MISSED"}
        print(f"\n(a) ours (no fsync) / compressed-tensors throughput: {ratios['speedup_vs_ct']:6.2f}x   "
              f"target >= {TARGETS['speedup_vs_ct']:.0f}x   {mark[ok['speedup_vs_ct']]}")
        print(f"    plain write (one stream, no fsync, fastest run) / compressed-tensors: {ratios['plain_vs_ct']:6.2f}x "
              "(a ceiling on 2 cores; parallel writers on several files can pass it on many cores)")
        print(f"    ours (no fsync) / plain write (no fsync, fastest run) throughput:  {ratios['ours_vs_plain']:6.2f}")
        print(f"(b) ours (fsync) wall / plain write+fsync wall:      {ratios['fsync_vs_plain']:6.2f}    "
              f"target <= {TARGETS['fsync_vs_plain']}   {mark[ok['fsync_vs_plain']]}")
        print(f"(c) peak RSS of ours:                                {ratios['peak_rss_bytes'] / 1e6:6.0f} MB "
              f"target <= {TARGETS['peak_rss_bytes'] / 1e6:.0f} MB {mark[ok['peak_rss_bytes']]}")
        print(f"(RSS context: python + torch + ktflow imports alone peak at {idle.peak_rss / 1e6:.0f} MB; "
              f"the orchestrating parent, a floor under every child figure, at {parent_peak_rss() / 1e6:.0f} MB)")
        busiest = max(f["others_busy"] for f in figures.values())
        if busiest > BUSY:
            print(f"WARNING: other processes kept up to {busiest:.2f} of the {host['logical_cores']} CPUs busy during "
                  "these runs: wall times are inflated and noisy; rerun when the box is idle, or compare CPU s")
        if args.json:
            args.json.write_text(json.dumps({"host": host, "experts": args.experts, "bf16_bytes": nbytes,
                                             "workers": workers, "repeat": args.repeat,
                                             "runs": figures,
                                             "ratios": ratios, "targets": TARGETS, "met": ok}, indent=2) + "\n")
        return 0
    finally:
        if args.keep:
            print(f"kept {run}")
        else:
            shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
