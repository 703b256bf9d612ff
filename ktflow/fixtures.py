"""Faithful stand-ins for the giant checkpoints ktflow handles, for tests, demos and benchmarks.

:func:`make_fixture` writes a random MoE with the real checkpoints' tensor names, dtypes,
config layout, sharding and companion tensors, plus a trained byte-level BPE tokenizer with a
ChatML template (see :data:`FixtureKind`):

- four tiny DeepSeek-V3-architecture kinds in the on-disk formats ktflow reads (``bf16``,
  ``kimi-k2.5``, ``kimi-k2``, ``deepseek-v3``). Quantized bytes are produced by compressed-tensors
  itself (the reference library), not by ktflow's own decoder, so tests that decode them compare
  two independent codes. These four quantize the same BF16 weights for a given ``seed``, so a
  decoded quantized fixture can be compared with the ``bf16`` fixture of that seed;
- ``deepseek-v2-lite``: a BF16 MoE with DeepSeek-V2-Lite's structure, tiny or (``full_size``) at
  its real dimensions (15.7B parameters, 31 GB), for benchmarks that need the real model's cost
  without downloading it;
- ``kimi-k2.5`` at ``size="bigger-than-gpu"``: the tiny kimi-k2.5 layout at Kimi's widths with
  57.1B parameters (114 GB in BF16, more than an 80 GB GPU holds; 34.4 GB as INT4), streamed one
  layer per shard by :mod:`ktflow.fixture_stream` (its INT4 experts are drawn directly in
  compressed-tensors' packed layout, which tests check against compressed-tensors itself).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from safetensors.torch import save_file

from ktflow.errors import InvalidInputError
from ktflow.fixture_stream import (
    BIGGER_THAN_GPU,
    MoeDims,
    deepseek_v3_config,
    given_tensors,
    parameter_count,
    plan_shards,
    write_shards,
)
from ktflow.store import check_free_space

FixtureKind = Literal["kimi-k2.5", "kimi-k2", "deepseek-v3", "bf16", "deepseek-v2-lite"]
FIXTURE_KINDS: tuple[str, ...] = get_args(FixtureKind)
FixtureSize = Literal["tiny", "bigger-than-gpu"]
FIXTURE_SIZES: tuple[str, ...] = get_args(FixtureSize)
# The dimensions of each streamed size (every size but "tiny", whose dimensions are the spec's own).
STREAMED_SIZES: dict[str, MoeDims] = {"bigger-than-gpu": BIGGER_THAN_GPU}

INT4_GROUP_SIZE = 32
FP8_BLOCK = 128
# Every weight's input dim is one of hidden, moe_intermediate, 3 * moe_intermediate or an MLA
# rank of 128, so a multiple of 128 fits FP8 blocks, INT4 groups of 32 and kt-kernel INT8
# (hidden and moe_intermediate / T multiples of 64 for T = 1, 2).
DIM_MULTIPLE = 128
# Disk the full-size deepseek-v2-lite fixture needs: 31.4 GB of shards plus its 2-layer template.
_FULL_SIZE_BYTES = 34_000_000_000

CODE_DIR = Path(__file__).parent / "_fixture_code"
# Remote code shipped with each kind (file names as in the real checkpoints where they exist).
_REMOTE_CODE: dict[str, tuple[str, ...]] = {
    "kimi-k2.5": ("configuration_kimi_k25.py", "modeling_kimi_k25.py"),
    "kimi-k2": ("configuration_deepseek.py", "modeling_deepseek.py"),
}
_AUTO_MAP: dict[str, dict[str, str]] = {
    "kimi-k2.5": {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    },
    "kimi-k2": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
}
# The ignore list of the real Kimi INT4 configs; K2.5 adds the vision modules.
_KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
_VISION_IGNORE = ["re:.*vision_tower.*", "re:.*mm_projector.*"]

ROUTED_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# DeepSeek-V3 FP8 covers every Linear of attention, dense MLP, shared and routed experts; the
# router (mlp.gate), embeddings, norms and lm_head stay in BF16.
FP8_LINEAR_WEIGHT = re.compile(
    r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TOKENIZER_VOCAB = 640
# Fixed training text: the BPE merges (and so the vocab size) depend only on this.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model is still a model.
user: How do I fine-tune a mixture of experts model on one workstation?
assistant: Convert the weights to BF16, train a LoRA adapter, then serve it with SGLang.
system: You are a helpful assistant. Answer briefly and cite the file you read.
Experts live on the CPU while attention runs on the GPU; the router picks two experts per token.
Quantization maps each group of 32 weights to four-bit integers and one scale per group.
The checkpoint has shards, an index, a config, a tokenizer and a chat template.
def forward(self, hidden_states): return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
for layer in range(61): print(f"layer {layer} has 384 experts and one shared expert")
Numbers: 0 1 2 3 4 5 6 7 8 9 10 32 64 128 256 512 1024 2048 4096 7168 18432 163840.
Punctuation: ( ) [ ] { } < > = + - * / % , . ; : ! ? ' " _ | # @ & ^ ~ `
Training loss went down from 2.31 to 1.07 after six steps; the adapter was saved.
Please summarize the following text in one sentence, then list three key points.
Thank you! You're welcome. Is there anything else I can help you with today?
"""


class FixtureSpec(BaseModel):
    """What to generate: a format and the model's (tiny) dimensions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FixtureKind
    layers: int = 3
    experts: int = 8
    hidden: int = 256
    moe_intermediate: int = 128
    seed: int = 0
    lm_head_std: float | None = Field(
        None, gt=0, description="Init std of lm_head (None: the model's own, 0.02). At 0.02 no token can get a "
        "clear margin on a random model, and LoRA cannot fix that without lm_head in its targets, which makes "
        "PEFT save lm_head whole (SGLang ignores it): a model meant to be taught, like the demo's, uses 0.2.")

    architecture: Literal["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"] = Field(
        "DeepseekV2ForCausalLM", description="deepseek-v2-lite only: the model class. DeepseekV3ForCausalLM keeps "
        "every dimension but routes the DeepSeek-V3 way (sigmoid scores with a correction bias, one group): "
        "kt-kernel 0.7.2 trains that class, while its DeepseekV2 path expects a gate returning "
        "(topk_ids, topk_weights), which neither transformers' DeepseekV2 nor DeepSeek's remote code has.")
    full_size: bool = Field(
        False, description="deepseek-v2-lite only: DeepSeek-V2-Lite's real dimensions (27 layers, 64 routed + 2 "
        "shared experts, 6 active, hidden 2048, MoE intermediate 1408, MLA kv_lora_rank 512, vocab 102400; "
        "15.7B parameters, 31 GB) instead of layers/experts/hidden/moe_intermediate.")
    size: FixtureSize = Field(
        "tiny", description="kimi-k2.5 only: 'bigger-than-gpu' writes fixture_stream.BIGGER_THAN_GPU's dimensions "
        "(Kimi's widths, 8 layers of 180 routed experts: 57.1B parameters, 114 GB in BF16, 34.4 GB on disk), "
        "streamed one layer per shard, instead of layers/experts/hidden/moe_intermediate.")

    @field_validator("kind", mode="before")
    @classmethod
    def _known_kind(cls, value: object) -> object:
        if value not in FIXTURE_KINDS:
            raise InvalidInputError(f"--kind {value}", "unknown fixture kind.",
                                    f"use one of {', '.join(FIXTURE_KINDS)}.")
        return value

    @field_validator("layers")
    @classmethod
    def _enough_layers(cls, value: int) -> int:
        if value < 2:
            raise InvalidInputError(
                f"--layers {value}", "a fixture needs at least 2 layers (layer 0 is dense, the rest are MoE).",
                "use --layers 2 or more.",
            )
        return value

    @field_validator("experts")
    @classmethod
    def _enough_experts(cls, value: int) -> int:
        if value < 2:
            raise InvalidInputError(
                f"--experts {value}", "a fixture needs at least 2 routed experts (2 are active per token).",
                "use --experts 2 or more.",
            )
        return value

    @field_validator("hidden", "moe_intermediate")
    @classmethod
    def _aligned(cls, value: int, info: ValidationInfo) -> int:
        if value <= 0 or value % DIM_MULTIPLE:
            option = "--" + info.field_name.replace("_", "-")
            raise InvalidInputError(
                f"{option} {value}",
                f"must be a positive multiple of {DIM_MULTIPLE}: FP8 blocks are 128 wide, INT4 groups 32, "
                "and kt-kernel INT8 needs hidden and moe_intermediate/T to be multiples of 64 for T=1,2.",
                f"use e.g. {option} {max(DIM_MULTIPLE, -(-value // DIM_MULTIPLE) * DIM_MULTIPLE)}.",
            )
        return value

    @model_validator(mode="after")
    def _full_size_rules(self) -> FixtureSpec:
        if self.architecture != "DeepseekV2ForCausalLM" and self.kind != "deepseek-v2-lite":
            raise InvalidInputError(f"--architecture {self.architecture} with {self.kind}",
                                    "only deepseek-v2-lite has a choice of architecture.",
                                    "drop --architecture, or use the deepseek-v2-lite kind.")
        if self.size != "tiny" and self.kind != "kimi-k2.5":
            raise InvalidInputError(f"--size {self.size} with {self.kind}", f"only kimi-k2.5 has a {self.size} form.",
                                    "drop --size, or use the kimi-k2.5 kind.")
        if self.full_size and self.kind != "deepseek-v2-lite":
            raise InvalidInputError(f"--full-size with {self.kind}", "only deepseek-v2-lite has a full-size form.",
                                    "drop --full-size, or use the deepseek-v2-lite kind.")
        if self.full_size:
            self._refuse_tiny_dims("--full-size", "DeepSeek-V2-Lite's own dimensions")
        elif self.size != "tiny":
            self._refuse_tiny_dims(f"--size {self.size}", "its own dimensions (ktflow.fixture_stream.BIGGER_THAN_GPU)")
        return self

    def _refuse_tiny_dims(self, option: str, whose: str) -> None:
        """A sized form has its own dimensions: refuse the tiny dimension options beside it."""
        tiny_dims = {name: getattr(self, name) for name in ("layers", "experts", "hidden", "moe_intermediate")
                     if getattr(self, name) != type(self).model_fields[name].default}
        if tiny_dims:
            options = ", ".join(f"--{n.replace('_', '-')} {v}" for n, v in tiny_dims.items())
            raise InvalidInputError(options, f"{option} uses {whose}.", f"drop {options}, or drop {option}.")

    @property
    def streamed(self) -> bool:
        """Whether this checkpoint is written by :mod:`ktflow.fixture_stream` (too big for memory)."""
        return self.size != "tiny"


def tiny_dims(spec: FixtureSpec) -> MoeDims:
    """The dimensions of a tiny fixture: the spec's sizes, 2 attention heads, MLA ranks of 128, top-2."""
    return MoeDims(layers=spec.layers, experts=spec.experts, experts_per_tok=2, hidden=spec.hidden,
                   moe_intermediate=spec.moe_intermediate, intermediate=3 * spec.moe_intermediate, heads=2,
                   # every input dim is a multiple of 128; kv_a_proj_with_mqa has 128 + 32 = 160 and q_b_proj
                   # 2 * (64 + 32) = 192 output rows, so FP8 gets partial edge blocks.
                   q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


def fixture_dims(spec: FixtureSpec) -> MoeDims:
    """The DeepSeek-V3-architecture dimensions ``spec`` describes (not deepseek-v2-lite's)."""
    return STREAMED_SIZES[spec.size] if spec.streamed else tiny_dims(spec)


ProgressCallback = Callable[[int, int], None]
"""``progress(done, total)``: shards written so far, of ``total``."""


def make_fixture(
    spec: FixtureSpec, out_dir: str | Path, *, progress: ProgressCallback | None = None, dims: MoeDims | None = None,
) -> Path:
    """Generate the checkpoint ``spec`` describes in ``out_dir`` and return ``out_dir``.

    Built in a temporary sibling directory and renamed into place at the end, so ``out_dir``
    is either complete or absent.

    Args:
        progress: called after each shard is written (the large sizes take a minute or more).
        dims: a streamed size's dimensions instead of its own (a reduced rehearsal of the same
            writer: tests, the GPU host's quick check); only with ``spec.streamed``.

    Raises:
        InvalidInputError: ``out_dir`` exists and is not an empty directory.
        HostRequirementError: too little free disk for a full-size or streamed fixture.
        ValueError: ``dims`` with a tiny spec.
    """
    out_dir = Path(out_dir)
    if dims is not None and not spec.streamed:
        raise ValueError(f"dims are for the streamed sizes ({', '.join(STREAMED_SIZES)}), not size {spec.size}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidInputError(
            str(out_dir), "already exists and is not an empty directory; refusing to overwrite it.",
            "pick a new output directory or delete this one.",
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if spec.full_size:
        check_free_space(out_dir, _FULL_SIZE_BYTES, what="the full-size deepseek-v2-lite fixture", files=40)
    if spec.streamed:
        dims = dims or fixture_dims(spec)
        check_free_space(out_dir, streamed_bytes(dims), what=f"the {spec.size} {spec.kind} fixture",
                         files=dims.layers + 16)
    build_dir = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    build_dir.mkdir()
    try:
        if spec.kind == "deepseek-v2-lite":
            _build_deepseek_v2_lite(spec, build_dir, progress)
        elif spec.streamed:
            _build_streamed(spec, dims or fixture_dims(spec), build_dir, progress)
        else:
            _build(spec, build_dir)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
        build_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    return out_dir


def streamed_bytes(dims: MoeDims) -> int:
    """Tensor bytes of a streamed kimi-k2.5 fixture (the tokenizer's vocabulary bounded by its
    trainer's target), for the free-disk preflight: known before anything is generated."""
    shards = plan_shards(dims, vocab_size=_TOKENIZER_VOCAB, pad_id=0)
    vision = sum(p.numel() for p in _vision_modules(dims.hidden).values()) * 2  # BF16
    return sum(t.nbytes for shard in shards for t in shard) + vision


def streamed_parameters(dims: MoeDims, vocab_size: int = _TOKENIZER_VOCAB) -> int:
    """Parameters of a streamed kimi-k2.5 fixture (vision stand-in included), from its plan alone."""
    shards = plan_shards(dims, vocab_size=vocab_size, pad_id=0)
    return parameter_count(shards) + sum(p.numel() for p in _vision_modules(dims.hidden).values())


def _save_tokenizer(build_dir: Path) -> tuple[int, int, int]:
    """Write the fixture tokenizer; return its (vocabulary size, eos id, pad id)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_trained_bpe(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=(CODE_DIR / "chat_template.jinja").read_text(),
        model_max_length=4096,
    )
    tokenizer.save_pretrained(build_dir)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return len(tokenizer), eos_id, pad_id


def _build(spec: FixtureSpec, build_dir: Path) -> None:
    vocab_size, eos_id, pad_id = _save_tokenizer(build_dir)

    text_config, tensors = _bf16_model(spec, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id,
                                       scratch=build_dir / ".scratch")
    quantization_config: dict | None = None
    if spec.kind in ("kimi-k2.5", "kimi-k2"):
        tensors = _pack_routed_experts_int4(tensors)
        quantization_config = _int4_quantization_config(vision=spec.kind == "kimi-k2.5")
    elif spec.kind == "deepseek-v3":
        tensors = _quantize_linears_fp8(tensors)
        quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}

    if spec.kind == "kimi-k2.5":
        tensors = {f"language_model.{name}": t for name, t in tensors.items()}
        tensors.update(_vision_tensors(spec.hidden, spec.seed))
        config = _kimi_k25_config(text_config, hidden=spec.hidden, eos_id=eos_id, pad_id=pad_id)
    else:
        config = dict(text_config)
        if spec.kind == "kimi-k2":
            config.update(model_type="kimi_k2", auto_map=_AUTO_MAP["kimi-k2"])
        if quantization_config is not None:
            config["quantization_config"] = quantization_config

    _write_model_files(spec, build_dir, config, eos_id=eos_id, pad_id=pad_id)
    _write_shards(tensors, build_dir, num_layers=spec.layers,
                  split_companion=spec.kind in ("kimi-k2.5", "kimi-k2"))


def _kimi_k25_config(text_config: dict, *, hidden: int, eos_id: int, pad_id: int) -> dict:
    """Kimi-K2.5's config.json around a DeepSeek-V3 ``text_config``, which holds the INT4
    ``quantization_config`` (nested, as the real checkpoint has it)."""
    text_config = dict(text_config)
    text_config.pop("architectures", None)
    text_config["quantization_config"] = _int4_quantization_config(vision=True)
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": _AUTO_MAP["kimi-k2.5"],
        "model_type": "kimi_k25",
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "text_config": text_config,
        "vision_config": _vision_config(hidden),
    }


def _write_model_files(spec: FixtureSpec, build_dir: Path, config: dict, *, eos_id: int, pad_id: int) -> None:
    """config.json, generation_config.json and the kind's remote code (the tokenizer is written first)."""
    _write_json(build_dir / "config.json", config)
    _write_json(build_dir / "generation_config.json",
                {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False})
    for name in _REMOTE_CODE.get(spec.kind, ()):
        shutil.copyfile(CODE_DIR / name, build_dir / name)


def streamed_config(dims: MoeDims, *, vocab_size: int, eos_id: int, pad_id: int, scratch: Path) -> dict:
    """The config.json of a streamed kimi-k2.5 fixture: what the tiny one has, at ``dims``.

    The text config is what ``save_pretrained`` of a BF16 ``DeepseekV3ForCausalLM`` writes,
    without making the model (the config saves itself through ``scratch``, which is removed).
    """
    config = deepseek_v3_config(dims, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.dtype = torch.bfloat16
    config.save_pretrained(scratch)
    text_config = json.loads((scratch / "config.json").read_text())
    shutil.rmtree(scratch)
    return _kimi_k25_config(text_config, hidden=dims.hidden, eos_id=eos_id, pad_id=pad_id)


def _build_streamed(spec: FixtureSpec, dims: MoeDims, build_dir: Path, progress: ProgressCallback | None) -> None:
    """The kimi-k2.5 layout at ``dims``, one layer per shard, never more than a few tensor pieces per
    worker in memory (:mod:`ktflow.fixture_stream`); the config is transformers' own for ``dims``."""
    vocab_size, eos_id, pad_id = _save_tokenizer(build_dir)
    config = streamed_config(dims, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id, scratch=build_dir / ".scratch")
    _write_model_files(spec, build_dir, config, eos_id=eos_id, pad_id=pad_id)

    shards = plan_shards(dims, vocab_size=vocab_size, pad_id=pad_id, lm_head_std=spec.lm_head_std)
    vision = _vision_tensors(dims.hidden, spec.seed)
    shards[0] = sorted(shards[0] + given_tensors(vision), key=lambda t: t.name)  # with the embeddings, as the tiny one
    weight_map = write_shards(shards, build_dir, seed=spec.seed, given=vision, progress=progress)
    _write_json(build_dir / "model.safetensors.index.json", {
        "metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard)},
        "weight_map": dict(sorted(weight_map.items())),
    })


@functools.cache
def _trained_bpe_json() -> str:
    """A byte-level BPE trained on the built-in corpus (deterministic), as tokenizer JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.splitlines(), trainer)
    return bpe.to_str()


def _trained_bpe():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_bpe_json())  # a fresh object: callers may mutate it


def _bf16_model(
    spec: FixtureSpec, *, vocab_size: int, eos_id: int, pad_id: int, scratch: Path
) -> tuple[dict, dict[str, torch.Tensor]]:
    """A seeded random DeepseekV3ForCausalLM: its config dict and its BF16 tensors as saved on disk.

    transformers fuses experts in memory and splits them per expert when saving, so the
    tensors are read back from ``save_pretrained`` to get the real checkpoint names.
    """
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    config = deepseek_v3_config(tiny_dims(spec), vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = DeepseekV3ForCausalLM(config)
        biases = {
            f"model.layers.{layer}.mlp.gate.e_score_correction_bias": 0.01 * torch.randn(spec.experts)
            for layer in range(1, spec.layers)
        }
        if spec.lm_head_std is not None:
            torch.nn.init.normal_(model.lm_head.weight, std=spec.lm_head_std)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a tiny model needs no "Writing model shards" bar
    model.to(torch.bfloat16).save_pretrained(scratch)
    tensors = {}
    for shard in sorted(scratch.glob("*.safetensors")):
        tensors.update(load_file(shard))
    text_config = json.loads((scratch / "config.json").read_text())
    shutil.rmtree(scratch)
    tensors.update(biases)  # real checkpoints keep the routing bias in float32
    return text_config, tensors


# DeepSeek-V2-Lite's published dimensions (deepseek-ai/DeepSeek-V2-Lite, config.json).
_V2_LITE_DIMS: dict[str, int] = {
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
}


def _deepseek_v2_lite_config(spec: FixtureSpec, *, vocab_size: int, eos_id: int, pad_id: int):
    """DeepSeek-V2-Lite's structure (no q LoRA, 2 shared experts, top-6 routing without
    normalization, YaRN RoPE) at its real dimensions (``full_size``) or at the spec's tiny ones, in
    ``spec.architecture``'s config class (V2: greedy softmax routing; V3: sigmoid, one group)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    if spec.full_size:
        dims = dict(_V2_LITE_DIMS)
    else:
        dims = {"vocab_size": vocab_size, "hidden_size": spec.hidden, "intermediate_size": 3 * spec.moe_intermediate,
                "moe_intermediate_size": spec.moe_intermediate, "num_hidden_layers": spec.layers,
                "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": spec.experts,
                "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
    if spec.architecture == "DeepseekV3ForCausalLM":
        config_class, routing = DeepseekV3Config, {"num_nextn_predict_layers": 0}
    else:
        config_class, routing = DeepseekV2Config, {"topk_method": "greedy"}
    return config_class(
        **dims,
        **routing,
        q_lora_rank=None,
        n_shared_experts=2,
        num_experts_per_tok=min(6, dims["n_routed_experts"]),
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )


def _build_deepseek_v2_lite(spec: FixtureSpec, build_dir: Path, progress: ProgressCallback | None) -> None:
    """A random BF16 ``spec.architecture`` model, one shard per layer, streamed.

    The full-size model (31 GB) is never held whole: transformers builds and saves a 2-layer
    model of the same width (the dense layer 0 and MoE layer 1, plus embeddings, norm and
    lm_head), which gives the real on-disk names, shapes and init; every later MoE layer repeats
    layer 1's tensors with fresh values, each from its own seeded generator, on all cores, one
    layer at a time. A tensor transformers initializes to a constant (norms: 1, V3's routing
    correction bias: 0) keeps that constant; the rest are N(0, initializer_range).
    """
    vocab_size, eos_id, pad_id = _save_tokenizer(build_dir)
    config = _deepseek_v2_lite_config(spec, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id)
    template = _two_layer_template(spec, config, build_dir)
    _write_json(build_dir / "generation_config.json",
                {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False})
    num_layers = config.num_hidden_layers
    weight_map: dict[str, str] = {}
    total = 0
    for index, members in enumerate(_v2_lite_layer_shards(spec, template, num_layers, config.initializer_range)):
        shard_name = f"model-{index + 1:05d}-of-{num_layers:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in sorted(members.items())}, build_dir / shard_name,
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, shard_name))
        total += sum(t.numel() * t.element_size() for t in members.values())
        if progress is not None:
            progress(index + 1, num_layers)
    _write_json(build_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _two_layer_template(spec: FixtureSpec, config: Any, build_dir: Path) -> dict[str, torch.Tensor]:
    """transformers' own 2-layer save of the model's width (its tensors); writes the full config."""
    from safetensors.torch import load_file
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    model_class = DeepseekV3ForCausalLM if spec.architecture == "DeepseekV3ForCausalLM" else DeepseekV2ForCausalLM
    template_config = config.__class__(**{**config.to_dict(), "num_hidden_layers": 2})
    scratch = build_dir / ".scratch"
    hf_logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_class(template_config)
        if spec.lm_head_std is not None:
            torch.nn.init.normal_(model.lm_head.weight, std=spec.lm_head_std)
        model.to(torch.bfloat16).save_pretrained(scratch)
    del model
    template: dict[str, torch.Tensor] = {}
    for shard in sorted(scratch.glob("*.safetensors")):
        template.update(load_file(shard))
    saved_config = json.loads((scratch / "config.json").read_text())
    shutil.rmtree(scratch)
    saved_config["num_hidden_layers"] = config.num_hidden_layers
    _write_json(build_dir / "config.json", saved_config)
    return template


def _fresh_like(seed: int, std: float, name: str, like: torch.Tensor) -> torch.Tensor:
    """``like``'s constant, or new N(0, std) values from a generator seeded by ``seed`` and ``name``."""
    if bool((like == like.flatten()[0]).all()):
        return like.clone()
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest) >> 1)  # 63 bits: a valid seed
    return torch.randn(like.shape, generator=generator).mul_(std).to(like.dtype)


def _v2_lite_layer_shards(spec: FixtureSpec, template: dict[str, torch.Tensor], num_layers: int,
                          std: float) -> Iterator[dict[str, torch.Tensor]]:
    """One shard's tensors a layer: embeddings + layer 0, then each MoE layer (norm and lm_head last)."""
    moe_layer = {name: t for name, t in template.items() if ".layers.1." in name}
    last = ("model.norm.weight", "lm_head.weight")
    yield {n: t for n, t in template.items() if ".layers." not in n and not n.endswith(last)} | {
        n: t for n, t in template.items() if ".layers.0." in n}
    fresh = functools.partial(_fresh_like, spec.seed, std)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for layer in range(1, num_layers):
            if layer == 1:
                members = dict(moe_layer)
            else:
                names = [n.replace(".layers.1.", f".layers.{layer}.") for n in moe_layer]
                members = dict(zip(names, pool.map(fresh, names, moe_layer.values())))
            if layer == num_layers - 1:
                members |= {n: t for n, t in template.items() if n.endswith(last)}
            yield members


def _pack_routed_experts_int4(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace each routed expert ``X.weight`` by Kimi's ``X.weight_packed/_scale/_shape``."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                 group_size=INT4_GROUP_SIZE),
    )
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not ROUTED_EXPERT_WEIGHT.search(name):
            out[name] = tensor
            continue
        weight = tensor.float()
        rows, cols = weight.shape
        absmax = weight.view(rows, cols // INT4_GROUP_SIZE, INT4_GROUP_SIZE).abs().amax(-1)
        # Real Kimi data uses the grid [-7, 7] (scale = absmax / 7); compressed-tensors' min-max
        # qparams would give absmax / 7.5 and use -8. So the scale is computed the Kimi way, and
        # compressed-tensors quantizes (fp32 division, round half even) and packs.
        scale = (absmax / 7).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.float()}, scheme)
        module = name.removesuffix(".weight")
        out[f"{module}.weight_packed"] = packed["weight_packed"]
        out[f"{module}.weight_scale"] = scale
        out[f"{module}.weight_shape"] = packed["weight_shape"].to(torch.int32)  # Kimi ships int32
    return out


def _quantize_linears_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace each Linear ``X.weight`` by float8_e4m3fn ``X.weight`` + fp32 ``X.weight_scale_inv``."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                            block_structure=[FP8_BLOCK, FP8_BLOCK])
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        out[name] = tensor
        if not FP8_LINEAR_WEIGHT.search(name):
            continue
        weight = tensor.float()
        padded = maybe_pad_tensor_for_block_quant(weight, (FP8_BLOCK, FP8_BLOCK))
        blocks = padded.view(padded.shape[0] // FP8_BLOCK, FP8_BLOCK, padded.shape[1] // FP8_BLOCK, FP8_BLOCK)
        # absmax / 448 per block, as DeepSeek's scale_inv; zero padding never raises an absmax.
        scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
        out[name] = quantize(weight, scale, None, args, dtype=torch.float8_e4m3fn)
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale.float().contiguous()
    return out


def _vision_config(hidden: int) -> dict:
    return {"model_type": "kimi_k25_vision", "patch_size": 14, "in_channels": 3, "hidden_size": 64,
            "text_hidden_size": hidden}


def _vision_modules(hidden: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    """The vision stand-in's parameters by checkpoint name: seeded, or (``seed`` None) on the meta
    device, for counting without allocating."""
    from ktflow._fixture_code.configuration_kimi_k25 import KimiK25VisionConfig
    from ktflow._fixture_code.modeling_kimi_k25 import KimiK25MultiModalProjector, KimiK25VisionTower

    vision_config = KimiK25VisionConfig(**_vision_config(hidden))
    with torch.random.fork_rng(devices=[]), torch.device("meta" if seed is None else "cpu"):
        torch.manual_seed(0 if seed is None else seed + 1)  # independent of the text weights
        modules = {"vision_tower": KimiK25VisionTower(vision_config),
                   "mm_projector": KimiK25MultiModalProjector(vision_config)}
    return {f"{prefix}.{name}": t.detach() for prefix, module in modules.items()
            for name, t in module.state_dict().items()}


def _vision_tensors(hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """BF16 weights of the vision stand-in modules the shipped remote code defines."""
    return {name: t.to(torch.bfloat16).contiguous() for name, t in _vision_modules(hidden, seed).items()}


def _int4_quantization_config(*, vision: bool) -> dict:
    """The compressed-tensors block of Kimi K2 / K2.5's config (pack-quantized INT4, group 32)."""
    weights = {
        "actorder": None, "block_structure": None, "dynamic": False, "group_size": INT4_GROUP_SIZE,
        "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
        "symmetric": True, "type": "int",
    }
    return {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                      "targets": ["Linear"], "weights": weights}},
        "format": "pack-quantized",
        "ignore": _KIMI_IGNORE + (_VISION_IGNORE if vision else []),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _write_shards(tensors: dict[str, torch.Tensor], out_dir: Path, *, num_layers: int, split_companion: bool) -> None:
    """One shard per layer (embeddings and vision in the first, final norm and lm_head in the
    last) plus ``model.safetensors.index.json``.

    With ``split_companion``, the ``weight_scale`` of the first routed expert's ``gate_proj``
    goes to the next shard, away from its ``weight_packed``, as happens in real Kimi shards.
    """
    def shard_of(name: str) -> int:
        match = re.search(r"\.layers\.(\d+)\.", name)
        if match:
            return int(match.group(1))
        return num_layers - 1 if name.endswith(("model.norm.weight", "lm_head.weight")) else 0

    placement = {name: shard_of(name) for name in tensors}
    if split_companion:
        moved = next(n for n in sorted(tensors) if n.endswith(".mlp.experts.0.gate_proj.weight_scale"))
        placement[moved] = (placement[moved] + 1) % num_layers
    shard_names = [f"model-{i + 1:05d}-of-{num_layers:05d}.safetensors" for i in range(num_layers)]
    for index, shard_name in enumerate(shard_names):
        members = {n: tensors[n].contiguous() for n in sorted(tensors) if placement[n] == index}
        save_file(members, out_dir / shard_name, metadata={"format": "pt"})
    _write_json(out_dir / "model.safetensors.index.json", {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {name: shard_names[placement[name]] for name in sorted(tensors)},
    })


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
