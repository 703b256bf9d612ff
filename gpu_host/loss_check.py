#!/usr/bin/env python3
"""Proof that what is served is what was trained: the loss of base + converted adapter.

Two steps, in two environments:

``tokens RUN_DIR OUT.json`` (KT training toolchain): LlamaFactory's own data pipeline turns
the run's prepared records into ``input_ids``/``labels`` exactly as training saw them (the run's
``train.yaml``, its KT keys removed: tokenization does not depend on KT).

``loss BASE ADAPTER TOKENS.json [--variant V] [--json OUT]`` (the host's own transformers +
PEFT, nothing from the KT stack): loads the BF16 base in float32, applies the converted
(SGLang-format) adapter and computes the mean token loss over the records.

- Non-expert LoRA goes through PEFT (``get_peft_model`` + ``set_peft_model_state_dict``) and
  every key must land on a LoRA parameter (a key PEFT does not load is an error, not a warning).
- Routed-expert LoRA (``model.layers.L.mlp.experts.E.{gate,up,down}_proj.lora_{A,B}``): where
  transformers keeps experts as 3-D fused parameters (transformers 5: ``gate_up_proj`` and
  ``down_proj``), PEFT has no per-expert module to put it on, so it is merged into the weight as
  a merging server (LlamaFactory's HF engine) does: ``W += lora_alpha / r * B @ A``, in float32.
  The place of each expert's weight inside the fused parameter is found by comparing with the
  checkpoint's own per-expert tensor, not assumed.

Variants: ``full`` (the adapter), ``base`` (no adapter), ``no-experts`` (expert LoRA dropped),
``transposed`` (each expert delta applied as ``(A^T B^T)`` reshaped: the layout bug of reading
``[in, r]`` as ``[r, in]``; only where shapes allow, else the run says it cannot apply it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

EXPERT_KEY = re.compile(r"^(?:.*?)layers\.(\d+)\.mlp\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj)\.(lora_A|lora_B)\.weight$")
PREFIXES = ("base_model.model.", "language_model.")


# --------------------------------------------------------------------------- tokens (KT env)


def cmd_tokens(args: argparse.Namespace) -> int:
    # one GPU at most: LlamaFactory refuses a non-distributed process that sees several ("Please launch
    # distributed training"), and tokenizing needs none
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    import yaml
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    cfg = yaml.safe_load((Path(args.run_dir) / "train.yaml").read_text())
    for key in list(cfg):
        if key == "use_kt" or key.startswith("kt_"):
            cfg.pop(key)
    cfg["output_dir"] = tempfile.mkdtemp(prefix="tokens-")
    cfg.pop("max_steps", None)
    model_args, data_args, training_args, _, _ = get_train_args(cfg)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    records = [{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in module["train_dataset"]]
    Path(args.out).write_text(json.dumps(records))
    print(f"{len(records)} records, {sum(sum(1 for x in r['labels'] if x != -100) for r in records)} label tokens")
    return 0


# --------------------------------------------------------------------------- loss (host env)


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


def _load_base(base: Path, device: str):
    """A DeepseekV3ForCausalLM (plain transformers) in float32 with the base's weights.

    A Kimi-K2.5 checkpoint keeps the text model under ``language_model.`` beside vision
    modules: the text model is built from ``text_config`` and loaded from those tensors.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    raw = json.loads((base / "config.json").read_text())
    if "text_config" in raw:
        text = dict(raw["text_config"])
        text.pop("quantization_config", None)
        text.pop("model_type", None)
        text.pop("architectures", None)
        config = DeepseekV3Config(**text)
        state = {}
        for shard in sorted(base.glob("*.safetensors")):
            for k, v in load_file(shard).items():
                if k.startswith("language_model."):
                    state[k[len("language_model."):]] = v
        model = DeepseekV3ForCausalLM(config)
        # transformers 5 fuses experts at load time; from a state dict, load through from_pretrained
        with tempfile.TemporaryDirectory() as tmp:
            from safetensors.torch import save_file

            config.save_pretrained(tmp)
            save_file({k: v.contiguous() for k, v in state.items()}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        checkpoint = state
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        checkpoint = {}
        for shard in sorted(base.glob("*.safetensors")):
            checkpoint.update(load_file(shard))
    del AutoConfig
    return model.to(device).eval(), checkpoint


def _expert_slot(model, checkpoint: dict, layer: int, expert: int, proj: str):
    """The float32 view of expert ``expert``'s ``proj`` weight inside ``model`` and whether it is
    stored transposed, found by matching the checkpoint's per-expert tensor."""
    import torch

    experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
    ref = checkpoint[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"].float()
    out_dim, in_dim = ref.shape
    if isinstance(experts, torch.nn.ModuleList):
        return getattr(experts[expert], proj).weight.data, False
    candidates = []
    if proj in ("gate_proj", "up_proj") and hasattr(experts, "gate_up_proj"):
        p = experts.gate_up_proj.data[expert]
        half = 0 if proj == "gate_proj" else 1
        if p.shape[0] == 2 * out_dim and p.shape[1] == in_dim:
            candidates.append((p[half * out_dim:(half + 1) * out_dim], False))
        if p.shape[1] == 2 * out_dim and p.shape[0] == in_dim:
            candidates.append((p[:, half * out_dim:(half + 1) * out_dim], True))
    elif proj == "down_proj" and hasattr(experts, "down_proj"):
        p = experts.down_proj.data[expert]
        if tuple(p.shape) == (out_dim, in_dim):
            candidates.append((p, False))
        if tuple(p.shape) == (in_dim, out_dim):
            candidates.append((p, True))
    for view, transposed in candidates:
        got = view.T if transposed else view
        if torch.equal(got.cpu(), ref):
            return view, transposed
    raise SystemExit(f"cannot locate layer {layer} expert {expert} {proj} inside {type(experts).__name__}")


def cmd_loss(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import load_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, checkpoint = _load_base(Path(args.base), device)
    report: dict = {"variant": args.variant, "device": device}
    if args.variant != "base":
        adapter = Path(args.adapter)
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        scale = float(cfg["lora_alpha"]) / int(cfg["r"])
        tensors = load_file(adapter / "adapter_model.safetensors")
        experts: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}
        others: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            m = EXPERT_KEY.match(_strip(key))
            if m:
                experts.setdefault((int(m.group(1)), int(m.group(2)), m.group(3)), {})[m.group(4)] = value
            else:
                others[_strip(key)] = value
        report.update(lora_alpha=cfg["lora_alpha"], r=cfg["r"], expert_tensors=2 * len(experts),
                      non_expert_tensors=len(others))
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        targets = sorted({k.rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in others})
        model = get_peft_model(model, LoraConfig(r=int(cfg["r"]), lora_alpha=cfg["lora_alpha"], lora_dropout=0.0,
                                                 target_modules=targets))
        wanted = {f"base_model.model.{k}" for k in others}
        loaded = set_peft_model_state_dict(model, {f"base_model.model.{k}": v for k, v in others.items()})
        unexpected = sorted(getattr(loaded, "unexpected_keys", []) or [])
        lora_params = {n.replace(".default", "") for n, _ in model.named_parameters() if "lora_" in n}
        missing_on_model = sorted(k for k in wanted if k not in lora_params)
        untouched = sorted(p for p in lora_params if p not in wanted)
        report.update(peft_loaded=len(wanted) - len(unexpected), peft_unexpected=unexpected[:5],
                      peft_untouched_lora_params=len(untouched))
        if unexpected or missing_on_model:
            raise SystemExit(f"PEFT did not load every non-expert LoRA key: unexpected {unexpected[:5]}, "
                             f"missing {missing_on_model[:5]}")
        merged = 0
        if args.variant in ("full", "transposed"):
            inner = model.get_base_model()
            with torch.no_grad():
                for (layer, expert, proj), pair in sorted(experts.items()):
                    a, b = pair["lora_A"].float().to(device), pair["lora_B"].float().to(device)
                    delta = scale * (b @ a)  # [out, in]
                    if args.variant == "transposed":
                        flat = (a.T @ b.T).reshape(-1)  # [in, out] read as [out, in]
                        delta = scale * flat.reshape(delta.shape)
                    view, transposed = _expert_slot(inner, checkpoint, layer, expert, proj)
                    view += delta.T if transposed else delta
                    merged += 1
        report["expert_modules_merged"] = merged
    records = json.loads(Path(args.tokens).read_text())
    total, tokens, per_record = 0.0, 0, []
    with torch.no_grad():
        for r in records:
            ids = torch.tensor([r["input_ids"]], device=device)
            labels = torch.tensor([r["labels"]], device=device)
            logits = model(input_ids=ids).logits.float()
            shift_logits, shift_labels = logits[0, :-1], labels[0, 1:]
            mask = shift_labels != -100
            loss = torch.nn.functional.cross_entropy(shift_logits[mask], shift_labels[mask], reduction="sum").item()
            n = int(mask.sum())
            total += loss
            tokens += n
            per_record.append(loss / n)
    report.update(records=len(records), label_tokens=tokens, loss=total / tokens,
                  loss_mean_of_records=sum(per_record) / len(per_record))
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if math.isfinite(report["loss"]) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("tokens")
    p.add_argument("run_dir")
    p.add_argument("out")
    p.set_defaults(func=cmd_tokens)
    p = sub.add_parser("loss")
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("tokens")
    p.add_argument("--variant", choices=("full", "base", "no-experts", "transposed"), default="full")
    p.add_argument("--json")
    p.set_defaults(func=cmd_loss)
    args = ap.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
