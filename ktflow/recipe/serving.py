"""Serving (``serving``): the OpenAI-compatible endpoint, SGLang's names for sglang."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ktflow.recipe._base import _Strict

ServingMethod = Literal["RAWINT4", "FP8", "BF16", "AMXBF16", "AMXINT8", "AMXINT4"]
# kt_method -> what --kt-weight-path must hold.
_SERVING_WEIGHTS: dict[str, str] = {
    "RAWINT4": "the original Kimi INT4 checkpoint",
    "FP8": "the original DeepSeek FP8 checkpoint",
    "BF16": "a BF16 checkpoint",
    "AMXBF16": "a BF16 checkpoint",
    "AMXINT8": "ktflow's quantize-int8 output",
    "AMXINT4": "the merge stage's kt-kernel INT4 experts",
}
ServingMode = Literal["auto", "merged", "lora"]
# The expert formats the merge stage writes (ktflow.stages.merge): a merged model is served in one of these.
MERGED_METHODS = ("BF16", "RAWINT4", "AMXINT8", "AMXINT4")
# ... and those kt-kernel quantizes (the non-expert weights go to --model-path without the routed experts).
_KT_QUANTIZED = ("AMXINT8", "AMXINT4")


# Flags ktflow sets for sglang (or that must not be set with a KT LoRA adapter), aliases included, with the recipe
# field to use instead. serving.extra_args may not name them, nor abbreviate them: argparse accepts unique prefixes,
# and the last occurrence wins, so ``--kt-thread 4`` would silently override ``--kt-threadpool-count``.
OWNED_FLAGS: dict[str, str] = {
    "--model-path": "ktflow passes the model directory of the pipeline",
    "--model": "ktflow passes the model directory of the pipeline (--model is --model-path)",
    "--kt-weight-path": "ktflow passes the expert weights for serving.kt_method",
    "--kt-method": "set serving.kt_method",
    "--kt-cpuinfer": "set serving.kt_cpuinfer",
    "--kt-threadpool-count": "set serving.kt_threadpool_count",
    "--kt-num-gpu-experts": "set serving.kt_num_gpu_experts (0 with a KT LoRA adapter)",
    "--kt-gpu-experts-ratio": "set serving.kt_num_gpu_experts instead (it overrides that count)",
    "--kt-gpu-prefill-token-threshold": "set serving.kt_gpu_prefill_token_threshold (merged serving only)",
    "--kt-enable-dynamic-expert-update": "set serving.kt_enable_dynamic_expert_update (merged serving only)",
    "--kt-max-deferred-experts-per-token": "set serving.kt_max_deferred_experts_per_token (merged serving only)",
    "--kt-expert-placement-strategy": "set serving.kt_expert_placement_strategy",
    "--kt-lora-path": "ktflow serves the converted adapter through --lora-paths",
    "--kt-expert-lora-path": "ktflow serves the converted adapter through --lora-paths",
    "--tensor-parallel-size": "set serving.gpus",
    "--tp-size": "set serving.gpus",
    "--pipeline-parallel-size": "KT LoRA serving is tensor parallel only",
    "--pp-size": "KT LoRA serving is tensor parallel only",
    "--host": "set serving.host",
    "--port": "set serving.port",
    "--served-model-name": "set serving.served_model_name",
    "--api-key": "export the key in the variable serving.api_key_env names; a key in argv is visible in ps",
    "--admin-api-key": "a key in argv is visible to every local user in ps",
    "--enable-lora": "ktflow serves the tuned adapter merged (serving.mode: merged) or through KT's LoRA path "
                     "(serving.mode: lora)",
    "--lora-backend": "set serving.lora_backend",
    "--lora-paths": "sglang-kt serves exactly one KT adapter; set serving.adapter_name",
    "--max-running-requests": "set serving.max_running_requests",
    "--context-length": "set serving.context_length",
    "--chunked-prefill-size": "set serving.chunked_prefill_size",
    "--mem-fraction-static": "set serving.mem_fraction_static",
    "--max-total-tokens": "set serving.max_total_tokens (ktflow plan counts the KV pool from it)",
    "--attention-backend": "set serving.attention_backend",
    "--sampling-backend": "set serving.sampling_backend",
    "--grammar-backend": "set serving.grammar_backend",
    "--dtype": "set serving.dtype",
    "--disable-cuda-graph": "set serving.disable_cuda_graph",
    "--disable-radix-cache": "set serving.disable_radix_cache",
    "--config": "it reads more flags from a file ktflow does not check",
    "--help": "it prints the help and exits",
    "-h": "it prints the help and exits",
}


def owned_flag_in(extra_args: list[str]) -> tuple[str, str] | None:
    """The first ``(token, owned flag)`` of ``extra_args`` that sets, aliases or abbreviates a flag in
    :data:`OWNED_FLAGS`; None when there is none. Values (negative numbers included) are skipped."""
    for token in extra_args:
        if not token.startswith("-") or token[1:2].isdigit() or token in ("-", "--"):
            continue
        flag = token.split("=", 1)[0]
        owned = flag if flag in OWNED_FLAGS else next(
            (o for o in OWNED_FLAGS if flag.startswith("--") and len(flag) > 2 and o.startswith(flag)), None)
        if owned is not None:
            return token, owned
    return None


class ServingConfig(_Strict):
    """The OpenAI-compatible endpoint. SGLang names for sglang; LlamaFactory's api for CPU."""

    backend: Literal["sglang", "llamafactory"]
    host: str = Field("127.0.0.1", description="Bind address; anything but loopback exposes it")
    port: int | Literal["auto"] = Field(
        30000, description="TCP port; 'auto' (llamafactory backend): a free port is taken when the server starts, and "
        "the endpoint record says which (two checkouts on one host never collide)",
    )
    api_key_env: str = Field(
        "KTFLOW_API_KEY",
        pattern=r"^[A-Z_][A-Z0-9_]*$",
        description="Environment variable holding the API key (the key itself never goes in a recipe)",
    )
    served_model_name: str = Field("ktflow", pattern=r"^[\w.-]+$")
    adapter_name: str = Field("tuned", pattern=r"^[\w.-]+$")
    ready_timeout_s: int = Field(1800, gt=0)
    gpus: int = Field(1, ge=0, description="Tensor parallel size (sglang)")
    # KT SGLang fork (sglang-kt)
    kt_method: ServingMethod | None = None
    kt_cpuinfer: int | None = Field(
        None, gt=0, description="CPU inference threads (default: physical cores less 2, at least half of them: "
        "the cores left run sglang's own scheduler and tokenizer processes)",
    )
    kt_threadpool_count: int = Field(
        1, ge=1, description="NUMA thread pools; also the T the INT8 weights are quantized with"
    )
    mode: ServingMode = Field(
        "auto", description="How the tuned model is served (sglang). merged: the adapter folded into the weights by "
        "the merge stage and served with no LoRA flags, so CUDA graphs, GPU experts, expert deferral and dynamic "
        "expert placement are all available; lora: the base weights with KT's LoRA path (CUDA graphs forced off, "
        "no GPU experts); auto: merged where the merge stage can write serving.kt_method for this source (not "
        "FP8, AMXBF16), else lora. Candidates are judged through the LoRA path either way",
    )
    kt_num_gpu_experts: int = Field(
        0, ge=0, description="Routed experts of each MoE layer held on the GPUs (sglang-kt --kt-num-gpu-experts); "
        "0 with the LoRA path",
    )
    kt_gpu_prefill_token_threshold: int | None = Field(
        None, gt=0, description="Prefills of more tokens run the whole layer on the GPU (merged serving only)")
    kt_enable_dynamic_expert_update: bool = Field(
        False, description="Move the most used experts to the GPU as the server runs (merged serving only)")
    kt_max_deferred_experts_per_token: int | None = Field(
        None, ge=0, description="Experts a token may leave to the CPU to finish while the next layer runs "
        "(sglang-kt --kt-max-deferred-experts-per-token; merged serving only)",
    )
    kt_expert_placement_strategy: Literal["frequency", "front-loading", "uniform", "random"] | None = Field(
        None, description="Which experts go to the GPUs (sglang-kt --kt-expert-placement-strategy)")
    lora_backend: Literal["triton", "csgmv", "torch_native"] = "triton"
    dynamic_lora: bool = Field(
        False, description="The server loads adapters at run time (plain SGLang's /load_lora_adapter): a candidate "
        "is judged under a second adapter name on it. sglang-kt loads one adapter at startup: leave off"
    )
    max_running_requests: int = Field(4, ge=1)
    context_length: int | None = Field(None, gt=0)
    chunked_prefill_size: int | None = Field(None, gt=0)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    max_total_tokens: int | None = Field(
        None, gt=0, description="--max-total-tokens (sglang): the KV pool's size in tokens. Unset, sglang-kt gives the "
        "pool what the GPU has left (106 GB of a 141 GB H200 at mem_fraction_static 0.3, measured); set, the pool is "
        "this many tokens and `ktflow plan` counts it in the serving GPU line",
    )
    attention_backend: str | None = None
    sampling_backend: Literal["flashinfer", "pytorch"] | None = Field(
        None, description="--sampling-backend (sglang); unset: SGLang's default (flashinfer on CUDA). 'pytorch' "
        "where flashinfer's sampling kernels cannot be built (the GPU host's torch 2.11 bundle)",
    )
    grammar_backend: Literal["xgrammar", "outlines", "llguidance", "none"] | None = Field(
        None, description="--grammar-backend (sglang); 'none' serves without structured output (no grammar library)",
    )
    dtype: Literal["bfloat16", "float16", "auto"] = "bfloat16"
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    extra_args: list[str] = Field(default_factory=list, description="More launch_server flags")

    @field_validator("port", mode="before")
    @classmethod
    def _a_port_or_auto(cls, value: object) -> object:
        # One clear message instead of pydantic's one per union member.
        if value == "auto":
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"{value} is not a TCP port: must be greater than or equal to 1 (or 'auto')")
            if value > 65535:
                raise ValueError(f"{value} is not a TCP port: must be less than or equal to 65535 (or 'auto')")
            return value
        raise ValueError(f"{value!r} is not a port: give a number 1-65535, or 'auto' for a free one")

    @model_validator(mode="after")
    def _backend_rules(self) -> ServingConfig:
        kt_fields = [
            k for k in ("kt_method", "kt_cpuinfer", "kt_gpu_prefill_token_threshold", "max_total_tokens")
            if getattr(self, k) is not None
        ]
        if self.backend == "llamafactory":
            if kt_fields:
                raise ValueError(
                    f"backend 'llamafactory' does not take {', '.join(kt_fields)}; remove them "
                    "or set backend: sglang"
                )
            if self.mode != "auto":
                raise ValueError("@mode: backend 'llamafactory' merges the adapter at load itself; remove serving.mode")
            return self
        if self.port == "auto":
            raise ValueError("@port: 'auto' is for the llamafactory backend; sglang-kt serves on a fixed port: set one")
        if self.kt_method is None:
            raise ValueError("@kt_method: backend 'sglang' needs one of RAWINT4, FP8, BF16, AMXBF16, AMXINT8, AMXINT4")
        if self.gpus < 1:
            raise ValueError("@gpus: backend 'sglang' needs at least one GPU (gpus >= 1)")
        if self.mode == "merged":
            self._merged_rules()
        elif self.mode == "lora":
            self._lora_rules()
        else:
            self._auto_rules()
        if self.max_total_tokens is not None and self.context_length is not None \
                and self.max_total_tokens < self.context_length:
            raise ValueError(
                f"@max_total_tokens: {self.max_total_tokens} tokens of KV pool cannot hold one request of "
                f"context_length {self.context_length}; set it to at least context_length x max_running_requests "
                f"({self.context_length * self.max_running_requests}) or leave it unset"
            )
        owned = owned_flag_in(self.extra_args)
        if owned is not None:
            token, flag = owned
            how = ("is" if flag == token.split("=", 1)[0]
                   else f"abbreviates {flag} (argparse accepts unique prefixes), which is")
            raise ValueError(f"@extra_args: {token} {how} a flag ktflow sets or refuses (the last occurrence would "
                             f"win): {OWNED_FLAGS[flag]}")
        return self

    def _lora_rules(self) -> None:
        """The KT fork's LoRA serving rules (sglang-kt 0.7.2's kt_ep_wrapper and server_args)."""
        if self.kt_num_gpu_experts != 0:
            raise ValueError(
                f"@kt_num_gpu_experts: must be 0 when serving a LoRA adapter with KT (got "
                f"{self.kt_num_gpu_experts}); set serving.mode: merged to hold experts on the GPU"
            )
        if self.kt_gpu_prefill_token_threshold is not None:
            raise ValueError(
                "@kt_gpu_prefill_token_threshold: cannot be used with a KT LoRA adapter; remove it or set "
                "serving.mode: merged"
            )
        if self.kt_enable_dynamic_expert_update:
            raise ValueError(
                "@kt_enable_dynamic_expert_update: cannot be used with a KT LoRA adapter; set it false or set "
                "serving.mode: merged"
            )
        if self.kt_max_deferred_experts_per_token:
            raise ValueError(
                "@kt_max_deferred_experts_per_token: sglang-kt builds its LoRA expert wrapper without deferral; "
                "remove it or set serving.mode: merged"
            )
        if self.max_running_requests < 2:
            raise ValueError(
                f"@max_running_requests: must be >= 2 for KT LoRA serving (got {self.max_running_requests})"
            )
        if self.kt_method == "AMXINT4":
            raise ValueError(
                "@kt_method: AMXINT4 experts are written by the merge stage only (KT's LoRA path has no INT4 "
                "experts to read); set serving.mode: merged, or kt_method AMXINT8"
            )

    def _merged_rules(self) -> None:
        if self.kt_method not in MERGED_METHODS:
            raise ValueError(
                f"@mode: merged writes the experts as {', '.join(MERGED_METHODS)}, not {self.kt_method} (an FP8 "
                "source is merged after dequantize, as BF16 or AMXINT8/AMXINT4); set serving.kt_method, or "
                "serving.mode: lora"
            )
        if self.kt_method in _KT_QUANTIZED and self.kt_num_gpu_experts:
            raise ValueError(
                f"@kt_num_gpu_experts: {self.kt_num_gpu_experts} GPU experts are loaded from --model-path, but a "
                f"merge to {self.kt_method} keeps the routed experts in kt-kernel's CPU layout only; set "
                "kt_num_gpu_experts: 0, or kt_method RAWINT4 (Kimi INT4) or BF16, whose merged checkpoint holds them"
            )

    def _auto_rules(self) -> None:
        if self.kt_method in MERGED_METHODS:
            self._merged_rules()
        else:
            self._lora_rules()

    @property
    def resolved_mode(self) -> Literal["merged", "lora"]:
        """``mode`` with auto decided: merged where the merge stage writes ``kt_method``, else lora (llamafactory,
        which merges at load itself, is given the adapter: "lora")."""
        if self.backend != "sglang":
            return "lora"
        if self.mode != "auto":
            return self.mode
        return "merged" if self.kt_method in MERGED_METHODS else "lora"


# Physical cores the serving host keeps out of kt-kernel's thread pool by default: sglang's scheduler drives the GPU
# from a thread of its own and its tokenizer and detokenizer run as processes, and a KT pool on every core takes
# their cores (kt-kernel pins a thread a core and spins while it waits). Measured on a 16-core host serving the
# Kimi-K2.5 slice merged: 14 threads decoded 2.6x faster than 16 (docs/results/merged-serving.md). KT's own guides
# say as much: ~90 % of the physical cores, or the cores less one a GPU.
SERVE_RESERVED_CORES = 2


def kt_serving_threads(serving: ServingConfig, physical_cores: int) -> int:
    """The ``--kt-cpuinfer`` a server gets: ``serving.kt_cpuinfer``, else the host's physical cores less
    :data:`SERVE_RESERVED_CORES`, at least half of them and a thread for each of ``serving.kt_threadpool_count``
    pools."""
    if serving.kt_cpuinfer:
        return serving.kt_cpuinfer
    return max(physical_cores - SERVE_RESERVED_CORES, (physical_cores + 1) // 2, serving.kt_threadpool_count)
