"""What a merge's rounding alone costs in loss: an adapter trained to memorize, merged, both scored in float32.

The served loss of merged weights differs from `gpu_host/loss_check.py`'s reference (base + adapter in float32) by
two things at once: the merged weights are rounded to the served format (W + alpha/r B A cannot keep the part of the
update smaller than half a step of that format), and the server computes in BF16 with kt-kernel's CPU experts. This
script measures the first alone, on the CPU: it trains a rank-8 LoRA on the attention and every routed expert of one
of the GPU host's tiny fixtures (`gpu_host/make_inputs.py`) in float32 until the fixture's training records are
memorized (the regime of the GPU host's served = trained check), writes it as a converted adapter, merges it with
`ktflow merge`, and scores in float32 with `loss_check.py` the reference (base + adapter) and the merged weights
alone: BF16 for the BF16 DeepSeek-V3 fixture; BF16 and RAWINT4 (Kimi's INT4 re-encoded, scored as the BF16 it
decodes to) for the Kimi INT4 fixture, whose reference and training read its exact BF16 decoding. Nothing is
served; each difference is that merge's rounding.

The records are the GPU host's tokenization of each fixture's training data (`tokens-bf16.json` beside the
served-loss figures it explains; the Kimi INT4 fixture's in benchmarks/data/gpu-host-checks). Writes
`merge-rounding-FIXTURE.json` beside the served-loss figures. Needs PEFT and transformers: the training toolchain.

    make env train-env
    .venv-train/bin/python benchmarks/merge_rounding.py                     # BF16: ~1 min on 2 cores
    .venv-train/bin/python benchmarks/merge_rounding.py --fixture rawint4   # Kimi INT4: merged BF16 and RAWINT4
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data" / "merged-serving" / "h200-formats-and-levers"
sys.path[:0] = [str(REPO), str(REPO / "gpu_host")]  # ktflow and the harness, from this checkout


TRAINING_RECORD = "training.json"  # beside the trained adapter: its settings and losses


def train_memorizing_adapter(base: Path, start: Path, tokens: Path, out: Path, *, steps: int, lr: float,
                             seed: int) -> list[float]:
    """Train a LoRA of ``start``'s shape (attention through PEFT, from ``start``'s values; experts as a parametrized
    update of the fused expert weights, from ``start``'s A and a zero B) in float32 on every record, one full batch
    a step; write it to ``out`` (published whole) in ``start``'s layout and dtypes. Returns the loss before each step
    and, last, after the last one."""
    import loss_check
    import torch
    import torch.nn.utils.parametrize as parametrize
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    config = json.loads((start / "adapter_config.json").read_text())
    scale = float(config["lora_alpha"]) / int(config["r"])
    tensors = load_file(start / "adapter_model.safetensors")
    model, checkpoint = loss_check._load_base(base, "cpu")
    others: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = loss_check.EXPERT_KEY.match(loss_check._strip(key))
        if match:
            experts.setdefault((int(match[1]), int(match[2]), match[3]), {})[match[4]] = value
        else:
            others[loss_check._strip(key)] = value
    for layer, expert, proj in experts:  # the update below is laid out as [experts, out, in]
        if loss_check._expert_slot(model, checkpoint, layer, expert, proj)[1]:
            raise SystemExit(f"layer {layer} expert {expert} {proj} is stored transposed; this script adds [out, in]")
    lora = {key: (torch.nn.Parameter(pair["lora_A"].float().clone()),
                  torch.nn.Parameter(torch.zeros_like(pair["lora_B"], dtype=torch.float32)))
            for key, pair in experts.items()}
    count = 1 + max(e for _, e, _ in experts)

    def delta(layer: int, proj: str) -> torch.Tensor:
        return torch.stack([lora[(layer, e, proj)][1] @ lora[(layer, e, proj)][0] for e in range(count)])

    class GateUp(torch.nn.Module):
        def __init__(self, layer: int) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight + scale * torch.cat([delta(self.layer, "gate_proj"), delta(self.layer, "up_proj")], dim=1)

    class Down(GateUp):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight + scale * delta(self.layer, "down_proj")

    for layer in sorted({layer for layer, _, _ in experts}):
        module = model.get_submodule(f"model.layers.{layer}.mlp.experts")
        module.gate_up_proj.requires_grad_(False)
        module.down_proj.requires_grad_(False)
        parametrize.register_parametrization(module, "gate_up_proj", GateUp(layer))
        parametrize.register_parametrization(module, "down_proj", Down(layer))
    targets = sorted({key.rsplit(".", 2)[0].rsplit(".", 1)[-1] for key in others})
    model = get_peft_model(model, LoraConfig(r=int(config["r"]), lora_alpha=config["lora_alpha"], lora_dropout=0.0,
                                             target_modules=targets))
    set_peft_model_state_dict(model, {f"base_model.model.{key}": value for key, value in others.items()})
    records = json.loads(tokens.read_text())
    trainable = [p for name, p in model.named_parameters() if "lora_" in name] + [p for ab in lora.values() for p in ab]
    optimizer = torch.optim.Adam(trainable, lr=lr)
    losses = []
    def pass_over_records(train: bool) -> tuple[float, int]:
        """The summed token loss over every record and its label tokens; with ``train``, the gradients too."""
        total, label_tokens = 0.0, 0
        for record in records:
            logits = model(input_ids=torch.tensor([record["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(record["labels"][1:])
            mask = labels != -100
            loss = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum")
            if train:
                loss.backward()
            total, label_tokens = total + loss.item(), label_tokens + int(mask.sum())
        return total, label_tokens

    for _ in range(steps):
        optimizer.zero_grad()
        total, label_tokens = pass_over_records(train=True)
        for p in trainable:
            if p.grad is not None:
                p.grad /= label_tokens
        optimizer.step()
        losses.append(total / label_tokens)
    with torch.no_grad():  # after the last step, as trained (float32; the adapter below stores experts in BF16)
        total, label_tokens = pass_over_records(train=False)
    losses.append(total / label_tokens)
    state = get_peft_model_state_dict(model)
    trained = {}
    for key, value in tensors.items():
        match = loss_check.EXPERT_KEY.match(loss_check._strip(key))
        if match:
            a, b = lora[(int(match[1]), int(match[2]), match[3])]
            got = a if match[4] == "lora_A" else b
        else:
            got = state[f"base_model.model.{loss_check._strip(key)}"]
        trained[key] = got.detach().to(value.dtype).contiguous()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(trained, staging / "adapter_model.safetensors", metadata={"format": "pt"})
    (staging / TRAINING_RECORD).write_text(json.dumps({"steps": steps, "lr": lr, "seed": seed, "losses": losses}))
    for path in start.iterdir():
        if path.name not in ("adapter_model.safetensors", TRAINING_RECORD):
            (staging / path.name).write_bytes(path.read_bytes())
    staging.rename(out)
    return losses


def score(base: Path, adapter: Path, tokens: Path, variant: str) -> dict:
    """``loss_check.py loss`` in this interpreter (float32, transformers + PEFT)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "loss.json"
        done = subprocess.run([sys.executable, str(REPO / "gpu_host" / "loss_check.py"), "loss", str(base),
                               str(adapter), str(tokens), "--variant", variant, "--json", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"loss_check.py {variant} on {base} exited {done.returncode}: {done.stderr[-500:]}")
        return json.loads(out.read_text())


FIXTURES = {  # the GPU host's served = trained fixtures: their folder, the merges to score, the records' tokens
    "bf16": ("dsv3-bf16", ("BF16",), DATA / "tokens-bf16.json"),
    "rawint4": ("kimi-k25-int4", ("BF16", "RAWINT4"),
                REPO / "benchmarks" / "data" / "gpu-host-checks" / "tokens-rawint4.json"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", choices=tuple(FIXTURES), default="bf16")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "merge-rounding")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from merged_serving import random_converted_adapter

    from ktflow.stages.dequantize import dequantize_checkpoint
    from ktflow.stages.merge import merge_adapter

    folder, methods, tokens = FIXTURES[args.fixture]
    source = args.work / "inputs" / folder
    if not (source / "config.json").is_file():
        # the fixtures come from ktflow's own environment (the Kimi INT4 one needs compressed-tensors)
        done = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "gpu_host" / "make_inputs.py"),
                               str(args.work / "inputs")], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"gpu_host/make_inputs.py exited {done.returncode} (run `make env` first): "
                             f"{done.stderr[-500:]}")
    work = args.work / args.fixture
    # what the reference and training read: the BF16 weights (a Kimi INT4 source decoded exactly, as the GPU host's
    # reference for its LoRA path does)
    base = source if args.fixture == "bf16" else work / "bf16-base"
    if not (base / "config.json").is_file():
        dequantize_checkpoint(source, base, fsync=False)
    start = random_converted_adapter(source, work / f"start-seed{args.seed}", seed=args.seed)
    run = f"{args.steps}-lr{args.lr:g}-seed{args.seed}"  # what each cached folder was made with
    trained = work / f"trained-{run}"
    if not (trained / "adapter_model.safetensors").is_file():
        train_memorizing_adapter(base, start, tokens, trained, steps=args.steps, lr=args.lr, seed=args.seed)
    losses = json.loads((trained / TRAINING_RECORD).read_text())["losses"]
    reference = score(base, trained, tokens, "full")
    no_experts = score(base, trained, tokens, "no-experts")
    merges = {}
    for method in methods:
        merged = work / f"merged-{method.lower()}-{run}"
        if not (merged / "config.json").is_file():
            merge_adapter(source, trained, merged, method=method, fsync=False)
        scored = merged
        if method == "RAWINT4":  # scored as the BF16 its INT4 decodes to, exactly
            scored = work / f"merged-{method.lower()}-{run}-bf16"
            if not (scored / "config.json").is_file():
                dequantize_checkpoint(merged, scored, fsync=False)
        loss = score(scored, trained, tokens, "base")["loss"]
        merges[method] = {"loss": loss, "difference": loss - reference["loss"],
                          "relative": (loss - reference["loss"]) / reference["loss"]}
    doc = {"fixture": f"{folder} (gpu_host/make_inputs.py)", "tokens": str(tokens.relative_to(REPO)),
           "records": reference["records"], "label_tokens": reference["label_tokens"], "steps": args.steps,
           "lr": args.lr, "seed": args.seed,
           "training_loss_first_and_after": [losses[0], losses[-1]],
           "reference_loss": reference["loss"], "reference_without_expert_lora": no_experts["loss"],
           "merged_scored_in_float32": merges}
    out = DATA / f"merge-rounding-{args.fixture}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{folder}: reference (base + adapter, float32) {reference['loss']:.6f}; without its expert LoRA "
          f"{no_experts['loss']:.4f}")
    for method, got in merges.items():
        print(f"  merged {method}, scored in float32: {got['loss']:.6f}   difference {got['difference']:+.6f} "
              f"({got['relative']:+.2%})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
