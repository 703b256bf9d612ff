"""The SFT stage: LoRA (or full) fine-tuning through LlamaFactory, with or without KTransformers.

- ``render.py``: the recipe -> LlamaFactory's training YAML, the FSDP2 config, the launch argv and
  environment (``render_sft``); the run's file names and result models.
- ``resume.py``: the deterministic run directory (``run_key``) and resuming from its last complete
  checkpoint; the trainer log's records.
- ``auto.py``: ``sft.backend: auto`` (``choose_sft_backend``), KT's micro-batch split where the recipe
  lets ktflow shape it (``resolve_batch_shape``), both as a run resolves them (``resolve_sft_recipe``),
  and refusing plain SFT of a model the GPUs cannot hold
  (``check_hf_fits_gpus``).
- ``stage.py``: the stage declared for the runner (``run_sft``), its needs (``sft_needs``), the
  published adapter (``locate_adapter``; where it goes: ``run_adapter_dir``).

The names callers use are re-exported here.
"""

from ktflow.stages.sft.auto import (
    ResolvedSft,
    SftChoice,
    check_hf_fits_gpus,
    choose_sft_backend,
    dataset_lengths,
    resolve_auto_backend,
    resolve_batch_shape,
    resolve_sft_recipe,
)
from ktflow.stages.sft.render import (
    SftPlan,
    SftResult,
    TrainerProgress,
    check_kt_model,
    decoder_layer_class,
    dump_yaml,
    render_sft,
)
from ktflow.stages.sft.resume import last_complete_checkpoint, run_dir_for, run_key
from ktflow.stages.sft.stage import locate_adapter, measure_sft, run_adapter_dir, run_sft, sft_needs

__all__ = [
    "ResolvedSft", "SftChoice", "SftPlan", "SftResult", "TrainerProgress", "check_hf_fits_gpus", "check_kt_model",
    "choose_sft_backend", "dataset_lengths", "decoder_layer_class", "dump_yaml", "last_complete_checkpoint",
    "locate_adapter", "measure_sft", "render_sft", "resolve_auto_backend", "resolve_batch_shape", "resolve_sft_recipe",
    "run_adapter_dir",
    "run_dir_for", "run_key", "run_sft", "sft_needs",
]
