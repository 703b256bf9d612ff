"""KT 0.7 recipes checked by the real tools: LlamaFactory-kt's own argument parser accepts what
`ktflow sft --dry-run` renders, kt-kernel's own KTConfig accepts the resulting KT settings, and
every KT rule ktflow enforces is one kt-kernel enforces too (same violation, both reject it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ktflow.errors import RecipeError
from ktflow.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
KT_PYTHON = REPO / ".venv-kt-train" / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not KT_PYTHON.exists(), reason="KT training toolchain not installed (make kt-train-env)"),
]
KT_RECIPES = ["kimi-k2.5-rawint4.yaml", "kimi-k2.5-bf16-int8.yaml", "deepseek-v3-fp8.yaml", "qwen3-30b-a3b-bf16.yaml"]

# Runs in the KT toolchain: parse each config with LlamaFactory-kt, then validate the KT config
# it derives with kt-kernel's KTConfig. This CPU box has no GPU, so transformers' "bf16 needs a
# GPU" check is answered yes: what is under test is the arguments, not this host.
_CHECK = r"""
import json, sys, tempfile
import transformers.training_args as ta
ta.is_torch_bf16_gpu_available = lambda: True
from llamafactory.hparams import get_train_args
from kt_kernel.sft.config import KTConfig
results = []
for cfg in json.loads(sys.stdin.read()):
    cfg["output_dir"] = tempfile.mkdtemp() + "/out"
    try:
        model, data, training, finetuning, generating = get_train_args(cfg)
        kt = dict(training.hf_kt_config._kt_config)
        KTConfig.from_object(kt)
        results.append({"ok": True, "kt": kt})
    except BaseException as exc:
        results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
print("RESULTS " + json.dumps(results))
"""


def render(name: str, *overrides: str) -> dict:
    argv = [sys.executable, "-m", "ktflow.cli", "sft", f"recipes/{name}", "--dry-run", "--json"]
    for override in overrides:
        argv += ["--set", override]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["train_config"]


def check_in_kt_toolchain(configs: list[dict]) -> list[dict]:
    done = subprocess.run([str(KT_PYTHON), "-c", _CHECK], input=json.dumps(configs), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def test_every_kt_recipe_passes_llamafactory_kt_and_kt_kernel() -> None:
    results = check_in_kt_toolchain([render(name) for name in KT_RECIPES])
    for name, result in zip(KT_RECIPES, results):
        assert result["ok"], (name, result.get("error"))
        recipe = load_recipe(REPO / "recipes" / name)
        assert result["kt"]["kt_lora_rank"] == recipe.sft.lora_rank  # derived by LlamaFactory, not by us
        assert result["kt"]["kt_backend"] == recipe.sft.kt_config.kt_backend


# (ktflow override that must be refused, the same change applied to a valid rendered config,
#  a fragment of kt-kernel's / LlamaFactory-kt's own message for it)
RAW, FP8 = "kimi-k2.5-rawint4.yaml", "deepseek-v3-fp8.yaml"
RULES = [
    (RAW, "sft.lora_rank=16", {"lora_rank": 16}, "requires kt_lora_rank=8"),
    (RAW, "sft.lora_dropout=0.1", {"lora_dropout": 0.1}, "requires kt_lora_dropout=0"),
    (RAW, "sft.kt_config.kt_threadpool_count=4", {"kt_config.kt_threadpool_count": 4}, "TP1/TP2 only"),
    (RAW, "sft.kt_config.kt_num_gpu_experts=2", {"kt_config.kt_num_gpu_experts": 2}, "kt_num_gpu_experts=0"),
    (RAW, "sft.kt_config.kt_share_backward_bb=true", {"kt_config.kt_share_backward_bb": True},
     "kt_share_backward_bb must be false"),
    (RAW, "sft.kt_config.kt_force_fused_expert_lora=false", {"kt_config.kt_force_fused_expert_lora": False},
     "kt_force_fused_expert_lora=true"),
    (RAW, "sft.kt_config.kt_weight_lifecycle=ephemeral", {"kt_config.kt_weight_lifecycle": "ephemeral"},
     "kt_weight_lifecycle"),
    (RAW, "sft.kt_config.kt_backend=FP8", {"kt_config.kt_backend": "FP8"}, "conflicts with kt_backend"),
    (RAW, "sft.gradient_checkpointing=true", {"gradient_checkpointing": True}, "gradient_checkpointing"),
    (FP8, "sft.kt_config.kt_num_gpu_experts=1", {"kt_config.kt_num_gpu_experts": 1},
     "FP8 SFT requires kt_num_gpu_experts=0"),
    (FP8, "sft.kt_config.kt_share_backward_bb=false", {"kt_config.kt_share_backward_bb": False},
     "FP8 SFT requires kt_share_backward_bb=true"),
]


@pytest.fixture(scope="module")
def real_tool_verdicts() -> dict[str, dict]:
    """Each RULES mutation applied to the valid RAWINT4 render, judged by the real tools (one run)."""
    bases = {name: render(name) for name in {rule[0] for rule in RULES}}
    configs = []
    for name, _, mutation, _ in RULES:
        cfg = json.loads(json.dumps(bases[name]))
        for key, value in mutation.items():
            if key.startswith("kt_config."):
                cfg["kt_config"][key.removeprefix("kt_config.")] = value
            else:
                cfg[key] = value
        configs.append(cfg)
    return {rule[0] + rule[1]: verdict for rule, verdict in zip(RULES, check_in_kt_toolchain(configs))}


@pytest.mark.parametrize(("recipe", "override", "mutation", "tool_message"), RULES, ids=[f"{r[0]}:{r[1]}" for r in RULES])
def test_each_ktflow_rule_is_a_rule_of_the_real_tools(
    recipe: str, override: str, mutation: dict, tool_message: str, real_tool_verdicts: dict[str, dict]
) -> None:
    with pytest.raises(RecipeError):
        load_recipe(REPO / "recipes" / recipe, [override])
    verdict = real_tool_verdicts[recipe + override]
    assert not verdict["ok"], f"the real tools accepted {mutation}"
    assert tool_message in verdict["error"], verdict["error"]
