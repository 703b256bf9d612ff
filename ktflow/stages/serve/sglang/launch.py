"""sglang-kt's launch command: ``sglang.launch_server`` of sglang-kt 0.7.2 (KT's SGLang fork).

:func:`render_sglang_launch` turns a recipe and the stage inputs into the exact argv and extra
environment of one sglang-kt server: the KT CPU-expert flags, the one KT LoRA adapter
(``--enable-lora --lora-backend B --lora-paths NAME=DIR``) and the OpenAI-compatible endpoint.
It starts nothing, but refuses (``InvalidInputError``, before anything launches) every
combination that would fail or misbehave at startup, tens of minutes into loading a model:

- ``--kt-weight-path`` must hold what ``--kt-method`` reads: the original checkpoint for
  ``RAWINT4`` (Kimi INT4) and ``FP8`` (DeepSeek-V3 block FP8), a BF16 checkpoint for
  ``BF16``/``AMXBF16`` (checked with :func:`ktflow.formats.checkpoint.inspect_checkpoint`), and for
  ``AMXINT8`` a quantize-int8 output whose manifest says it was quantized with the same
  ``--kt-threadpool-count`` T (the INT8 layout depends on T), in kt-kernel's ``.kt`` layout when
  the adapter carries an expert LoRA (the serve stage writes it: :mod:`ktflow.stages.serve.sglang.inputs`);
- ``--kt-cpuinfer`` at most the host's physical cores (and at least T: kt-kernel gives each of
  the T pools ``cpuinfer // T`` threads), the tensor parallel size at most the host's GPUs;
- the adapter is a converted one (:func:`ktflow.formats.adapter.check_servable_adapter`).

The KT LoRA rules and the flags ``serving.extra_args`` may not set are the recipe's
(:class:`ktflow.recipe.ServingConfig`, which validates every change): a recipe that breaks them never
reaches this module.

The API key. sglang-kt's ServerArgs reads the key only from ``--api-key`` (no environment
variable, no key file; ``--config FILE.yaml`` could carry it, but that is a second copy of the
secret on disk). A flag value is readable by every local user in ``ps``/``/proc/PID/cmdline``,
so the key never goes in argv. Instead argv[1:3] is ``-c LAUNCHER``: a few lines that run in the
server's own Python, pop the key from the environment variable ``serving.api_key_env`` (the
child inherits it from the caller's environment; this module never reads or holds its value),
put ``--api-key=KEY`` into the in-process ``sys.argv`` (``/proc/PID/cmdline`` keeps the
original argv), mask the key in what the main process writes through ``sys.stdout``/``sys.stderr``
(where its logging goes: sglang-kt logs ``server_args=ServerArgs(... api_key='...')`` at INFO on
startup), and then run
``sglang.launch_server`` exactly as ``python -m`` does. ``argv[3:]`` is therefore the plain
launch_server command line, and ``SglangLaunch`` (argv, env, repr, JSON) holds only the
variable's name. sglang-kt itself still keeps the key in memory and returns it from its own
``/server_info`` endpoint to callers that present the key.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel, Field

from ktflow.errors import HostRequirementError, InvalidInputError
from ktflow.formats.adapter import check_servable_adapter, has_expert_lora
from ktflow.formats.checkpoint import inspect_checkpoint, load_config
from ktflow.formats.kt_layout import MERGED_KT_DIR, has_kt_layout
from ktflow.host.hardware import HostInfo
from ktflow.recipe import INT4_FORMATS, Recipe
from ktflow.recipe.serving import kt_serving_threads
from ktflow.resources import MERGE_STAGE, QUANTIZE_INT8_STAGE
from ktflow.stages.serve.sglang.inputs import KT_LAYOUT_STAGE
from ktflow.store import StageManifest, read_manifest

LAUNCH_MODULE = "sglang.launch_server"
LORA_CACHE_ENV = "SGLANG_KT_LORA_CACHE_DIR"  # where sglang-kt splits a merged KT adapter (default /tmp)
# What every sglang-kt server needs in its environment (in every rendered launch, so `ktflow serve --dry-run` shows
# it; a recipe's toolchains.serve.env wins). sglang-kt 0.7.2's get_config() defaults to
# SGLANG_APPLY_CONFIG_BACKUP=auto, which replaces the config.json of ANY DeepSeek-family checkpoint (model_type
# deepseek*, or an architecture naming DeepSeek: DeepSeek-V3, Kimi K2/K2.5) with a packaged DeepSeek-V4 config
# (config_backup_small/large.json: 4096 hidden, 256 experts, NSA indexer): the server then builds another model
# than the one trained (seen on the GPU host: the NSA Indexer of the packaged config failed on a
# missing deep_gemm). "none" reads the checkpoint's own config.
SERVER_ENV_DEFAULTS: dict[str, str] = {"SGLANG_APPLY_CONFIG_BACKUP": "none"}

# What --kt-weight-path must be, per --kt-method (checkpoint format from inspect_checkpoint).
_NATIVE_FORMATS: dict[str, frozenset[str]] = {
    "RAWINT4": frozenset(INT4_FORMATS),
    "FP8": frozenset({"deepseek-v3-fp8"}),
    "BF16": frozenset({"bf16"}),
    "AMXBF16": frozenset({"bf16"}),
}

# Runs in the server's Python as `python -c LAUNCHER <launch_server args>`; {env} is the variable's
# NAME. The key is popped (schedulers and compilers sglang spawns do not inherit it), passed as
# one `--api-key=KEY` token (a key starting with '-' still parses), and masked in stdout/stderr.
_LAUNCHER = """\
import os, runpy, sys
key = os.environ.pop({env!r}, "")
if not key:
    sys.exit("ktflow: the API key variable {env} is unset or empty in the server's environment")
class _Redacted:
    def __init__(self, stream, secret): self._stream, self._secret = stream, secret
    def write(self, text):
        return self._stream.write(text.replace(self._secret, "***") if isinstance(text, str) else text)
    def __getattr__(self, name): return getattr(self._stream, name)
sys.stdout, sys.stderr = _Redacted(sys.stdout, key), _Redacted(sys.stderr, key)
sys.argv.insert(1, "--api-key=" + key)
del key
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


class SglangLaunch(BaseModel):
    """One sglang-kt server: run ``argv`` with ``{**os.environ, **env}``.

    ``argv[3:]`` is the ``sglang.launch_server`` command line. The API key is never in it: with
    ``api_key_env`` set, ``argv[1:3]`` is ``["-c", LAUNCHER]``, which reads the key from that
    environment variable inside the server (the caller's environment must hold it); with
    ``api_key_env`` None (only on a loopback host without a key) it is ``["-m",
    "sglang.launch_server"]`` and the endpoint takes no key.
    """

    argv: list[str]
    env: dict[str, str] = Field(description="Extra environment variables (no secrets)")
    int8_threadpool_count: int | None = Field(
        description="T the AMXINT8 weights were quantized with (= --kt-threadpool-count); None for other methods"
    )
    api_key_env: str | None = Field(description="The variable the server reads its API key from; None: no key")

    @property
    def launch_args(self) -> list[str]:
        """The ``sglang.launch_server`` arguments (what its own parser sees, minus the key)."""
        return self.argv[3:]


def launcher_code(api_key_env: str, module: str = LAUNCH_MODULE) -> str:
    """The ``-c`` program that passes the key from ``api_key_env`` to ``module`` in-process."""
    return _LAUNCHER.format(env=api_key_env, module=module)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def render_sglang_launch(
    recipe: Recipe, *, model_dir: Path, kt_weight_dir: Path, adapter_dir: Path | None, serve_python: Path, host: HostInfo,
    api_key_env_present: bool = True, lora_cache_dir: Path | None = None, check_files: bool = True,
    port: int | str | None = None,
) -> SglangLaunch:
    """Render the sglang-kt launch for ``recipe``'s serving section, after checking it can work.

    Args:
        model_dir: ``--model-path``: the checkpoint sglang loads the non-expert (GPU) weights from.
        kt_weight_dir: ``--kt-weight-path``: the original INT4/FP8 checkpoint (RAWINT4/FP8), a BF16
            checkpoint (BF16/AMXBF16) or the quantize-int8 output (AMXINT8).
        adapter_dir: the converted LoRA adapter (convert-lora's output), served as
            ``serving.adapter_name`` (requests select it with ``"model": "<served>:<adapter>"``);
            None: the base model alone, without ``--enable-lora`` (what an evaluation compares
            against: sglang-kt refuses base requests on a server whose expert LoRA is loaded).
        serve_python: the serving toolchain's python (sglang-kt, kt-kernel 0.7.2, torch 2.9.1).
        host: the serving host (physical cores, GPUs).
        api_key_env_present: whether the variable ``serving.api_key_env`` is set (non-empty) in
            the environment the server will be started from. The caller checks; this function
            never reads the key. Without it the server runs without a key, which is refused
            unless ``serving.host`` is a loopback address.
        check_files: check the weight and adapter directories (off for ``--dry-run`` before they
            exist: the AMXINT8 T is then the recipe's own).
        lora_cache_dir: where sglang-kt writes the expert/non-expert split of the merged adapter
            (``SGLANG_KT_LORA_CACHE_DIR``; ~10 GiB for Kimi K2.5 r=8). Default: sglang-kt's,
            ``$TMPDIR/sglang_kt_lora_cache_$USER``.
        port: ``--port`` (default ``serving.port``): a second server beside production (a candidate's)
            takes a free one. Two sglang-kt servers on one host share no other port (tokenizer,
            scheduler and detokenizer talk over IPC sockets; the NCCL port is picked free at start).

    Raises:
        InvalidInputError: the weights do not fit ``serving.kt_method`` (or the AMXINT8 weights were
            quantized with another ``kt_threadpool_count``), or the adapter is not a converted one.
        HostRequirementError: ``kt_cpuinfer`` above the physical cores (or below T), more tensor
            parallel ranks than GPUs, or no API key for a non-loopback bind address.
        CheckpointError: a checkpoint directory is missing or malformed.
    """
    serving = recipe.serving
    if serving.backend != "sglang" or serving.kt_method is None:
        raise InvalidInputError(
            "serving.backend", f"is '{serving.backend}' (kt_method {serving.kt_method}); the sglang-kt launch needs "
            "backend sglang with a kt_method.", "set serving.backend: sglang and serving.kt_method",
        )
    cpuinfer = _check_host(recipe, host, api_key_env_present)
    model_dir, kt_weight_dir = Path(model_dir).absolute(), Path(kt_weight_dir).absolute()
    adapter_dir = Path(adapter_dir).absolute() if adapter_dir is not None else None
    if check_files:
        _check_model_dir(model_dir)
        int8_t = _check_kt_weights(recipe, kt_weight_dir)
        if adapter_dir is not None:
            check_servable_adapter(adapter_dir)
            _check_expert_lora_layout(recipe, kt_weight_dir, adapter_dir)
    else:
        int8_t = serving.kt_threadpool_count if serving.kt_method == "AMXINT8" else None
    args = _launch_args(recipe, model_dir=model_dir, kt_weight_dir=kt_weight_dir, adapter_dir=adapter_dir,
                        cpuinfer=cpuinfer, port=serving.port if port is None else port)
    python = str(Path(serve_python).absolute())  # not resolved: a venv's python is a symlink to the base
    if api_key_env_present:
        head, key_env = [python, "-c", launcher_code(serving.api_key_env)], serving.api_key_env
    else:
        head, key_env = [python, "-m", LAUNCH_MODULE], None
    env = {"PYTHONUNBUFFERED": "1", **SERVER_ENV_DEFAULTS, **recipe.toolchains.serve.env}
    if lora_cache_dir is not None:
        env[LORA_CACHE_ENV] = str(Path(lora_cache_dir).absolute())
    return SglangLaunch(argv=head + args, env=env, int8_threadpool_count=int8_t, api_key_env=key_env)


def _launch_args(recipe: Recipe, *, model_dir: Path, kt_weight_dir: Path, adapter_dir: Path | None, cpuinfer: int,
                 port: int | str) -> list[str]:
    """``sglang.launch_server``'s own command line (after the interpreter and the launcher)."""
    serving = recipe.serving
    assert serving.kt_method is not None
    args = [
        "--model-path", str(model_dir),
        "--kt-weight-path", str(kt_weight_dir),
        "--kt-method", served_kt_method(serving.kt_method, adapter_dir),
        "--kt-cpuinfer", str(cpuinfer),
        "--kt-threadpool-count", str(serving.kt_threadpool_count),
        # KT's LoRA path holds no expert on the GPU (sglang-kt refuses it with an expert LoRA)
        "--kt-num-gpu-experts", "0" if adapter_dir is not None else str(serving.kt_num_gpu_experts),
        "--tensor-parallel-size", str(serving.gpus),
        "--host", serving.host,
        "--port", str(port),
        "--served-model-name", serving.served_model_name,
    ]
    running = serving.max_running_requests
    if adapter_dir is not None:
        args += ["--enable-lora", "--lora-backend", serving.lora_backend,
                 "--lora-paths", f"{serving.adapter_name}={adapter_dir}"]
        running = max(running, 2)  # KT's LoRA path needs two (a merged recipe's candidate server may ask for one)
    else:
        # The engine's levers, for a server without a KT LoRA (merged, or the base model)
        for flag, value in (("--kt-gpu-prefill-token-threshold", serving.kt_gpu_prefill_token_threshold),
                            ("--kt-max-deferred-experts-per-token", serving.kt_max_deferred_experts_per_token),
                            ("--kt-expert-placement-strategy", serving.kt_expert_placement_strategy)):
            if value is not None:
                args += [flag, str(value)]
        if serving.kt_enable_dynamic_expert_update:
            args.append("--kt-enable-dynamic-expert-update")
    args += ["--max-running-requests", str(running)]
    if serving.disable_cuda_graph or adapter_dir is not None:  # KT's LoRA path runs without CUDA graphs
        args.append("--disable-cuda-graph")
    for flag, value in (("--context-length", serving.context_length),
                        ("--chunked-prefill-size", serving.chunked_prefill_size),
                        ("--mem-fraction-static", serving.mem_fraction_static),
                        ("--max-total-tokens", serving.max_total_tokens),
                        ("--attention-backend", serving.attention_backend),
                        ("--sampling-backend", serving.sampling_backend),
                        ("--grammar-backend", serving.grammar_backend)):
        if value is not None:
            args += [flag, str(value)]
    args += ["--dtype", serving.dtype]
    if serving.disable_radix_cache:
        args.append("--disable-radix-cache")
    return args + serving.extra_args


def served_kt_method(method: str, adapter_dir: Path | None) -> str:
    """The ``--kt-method`` of one server: ``serving.kt_method``, except AMXBF16 without an expert LoRA.

    AMXBF16 names kt-kernel's BF16 *SFT* kernel: sglang-kt builds it only for an adapter with an expert LoRA
    (and maps BF16 and AMXBF16 alike to AMXBF16_SFT then). A server without one (the base model's, or an
    adapter without its expert part) gets kt-kernel's inference wrapper, which takes BF16 and refuses
    AMXBF16 ("Method 'AMXBF16' not supported for inference mode", seen on the GPU host): the same BF16
    experts on the CPU, under the name that path knows. An adapter whose weights are not on disk yet (a
    dry run) is taken to carry its expert LoRA, as a KT SFT adapter does.
    """
    if method != "AMXBF16":
        return method
    if adapter_dir is None:
        return "BF16"
    weights = Path(adapter_dir) / "adapter_model.safetensors"
    known = weights.is_file() and weights.stat().st_size > 0
    return "BF16" if known and not has_expert_lora(adapter_dir) else method


def _check_host(recipe: Recipe, host: HostInfo, api_key_env_present: bool) -> int:
    """The host's side: cores for ``--kt-cpuinfer`` (returned), GPUs for tensor parallelism, the API key."""
    serving = recipe.serving
    t = serving.kt_threadpool_count
    cpuinfer = kt_serving_threads(serving, host.physical_cores)
    if cpuinfer > host.physical_cores:
        raise HostRequirementError(
            "serving.kt_cpuinfer", f"is {cpuinfer}, but {host.hostname} has {host.physical_cores} physical cores "
            "(threads beyond physical cores slow KT's CPU experts down).",
            f"set serving.kt_cpuinfer to at most {host.physical_cores}, or leave it unset (physical cores less 2)",
        )
    if cpuinfer < t:
        raise InvalidInputError(
            "serving.kt_cpuinfer", f"is {cpuinfer}, below serving.kt_threadpool_count {t}: kt-kernel gives each of "
            f"the {t} thread pools kt_cpuinfer // {t} threads, so a pool would have none.",
            f"set serving.kt_cpuinfer to at least {t}",
        )
    if serving.gpus > len(host.gpus):
        raise HostRequirementError(
            "serving.gpus", f"asks for tensor parallel size {serving.gpus}, but {host.hostname} has "
            f"{len(host.gpus)} GPU(s).", f"set serving.gpus to at most {len(host.gpus)}, or serve on a larger host",
        )
    _check_api_key(recipe, api_key_env_present)
    return cpuinfer


def _check_api_key(recipe: Recipe, api_key_env_present: bool) -> None:
    serving = recipe.serving
    if not api_key_env_present and not is_loopback(serving.host):
        raise HostRequirementError(
            f"serving.api_key_env ({serving.api_key_env})",
            f"is not set, and serving.host {serving.host} is not a loopback address: the endpoint would be open to "
            "the network without a key.",
            f"export {serving.api_key_env}=<key> before serving, or bind serving.host: 127.0.0.1",
        )
    if serving.api_key_env in recipe.toolchains.serve.env:
        raise InvalidInputError(
            f"toolchains.serve.env.{serving.api_key_env}", "sets the API key variable in the recipe; the key itself "
            "never goes in a recipe.", f"remove it and export {serving.api_key_env} in the serving environment",
        )


# --------------------------------------------------------------------------- checks


def _check_model_dir(model_dir: Path) -> None:
    load_config(model_dir)  # CheckpointError when it is not a checkpoint directory
    manifest = read_manifest(model_dir)
    if manifest is not None and manifest.stage in _int8_stages():
        raise InvalidInputError(
            f"model_dir {model_dir}", "is a quantize-int8 output (CPU expert weights with renamed blk.* tensors); "
            "sglang loads the non-expert weights from --model-path.",
            "pass the BF16 (or original) checkpoint as the model and the INT8 directory as kt_weight_dir",
        )


def _check_kt_weights(recipe: Recipe, kt_dir: Path) -> int | None:
    """Check ``kt_dir`` holds what ``serving.kt_method`` reads; the INT8 T for AMXINT8, else None."""
    method = recipe.serving.kt_method
    assert method is not None
    t = recipe.serving.kt_threadpool_count
    subject = f"kt_weight_dir {kt_dir}"
    if not kt_dir.is_dir():
        raise InvalidInputError(subject, "does not exist." if not kt_dir.exists() else "is not a directory.",
                                f"pass the expert weights for serving.kt_method {method}")
    manifest = read_manifest(kt_dir)
    is_int8 = manifest is not None and manifest.stage in _int8_stages()
    merged = read_manifest(kt_dir.parent) if kt_dir.name == MERGED_KT_DIR else None
    if merged is not None and merged.stage == MERGE_STAGE:
        return _check_merged_kt_weights(kt_dir, merged, method, t)
    if method == "AMXINT4":
        raise InvalidInputError(subject, "is not the merge stage's kt-kernel output, the only AMXINT4 experts ktflow "
                                "makes.", "serve with serving.mode: merged (the merge writes AMXINT4 experts)")
    if method == "AMXINT8":
        return _check_int8_weights(kt_dir, manifest if is_int8 else None, t)
    expected = _NATIVE_FORMATS[method]
    if is_int8:
        raise InvalidInputError(
            subject, f"is a quantize-int8 output, but serving.kt_method {method} reads "
            f"{'the original checkpoint' if method in ('RAWINT4', 'FP8') else 'a BF16 checkpoint'}.",
            "set serving.kt_method: AMXINT8 to serve these weights, or pass the checkpoint",
        )
    found = inspect_checkpoint(kt_dir).format
    if method in ("RAWINT4", "FP8"):
        expected = frozenset({recipe.source.format}) & expected or expected
    if found not in expected:
        want = " or ".join(sorted(expected))
        fix = {
            "RAWINT4": "pass the original Kimi INT4 checkpoint (the download stage's output) as kt_weight_dir",
            "FP8": "pass the original DeepSeek-V3 FP8 checkpoint as kt_weight_dir",
        }.get(method, "pass a BF16 checkpoint (the dequantize stage's output, or a BF16 source)")
        raise InvalidInputError(
            subject, f"is a {found} checkpoint, but serving.kt_method {method} reads {want} expert weights "
            f"natively from --kt-weight-path.", fix,
        )
    return None


def _check_merged_kt_weights(kt_dir: Path, manifest: StageManifest, method: str, t: int) -> int:
    """The merge stage's kt-kernel experts (``<merged>/kt``): made as ``method`` with this very T; return T."""
    made_as, made_t = manifest.settings.get("method"), manifest.settings.get("threadpool_count")
    if made_as != method:
        raise InvalidInputError(f"kt_weight_dir {kt_dir}", f"was merged as {made_as}, not {method}.",
                                f"merge again as {method}, or set serving.kt_method: {made_as}")
    if made_t != t:
        raise InvalidInputError(
            "serving.kt_threadpool_count", f"is {t}, but the {method} experts in {kt_dir} were merged with "
            f"threadpool_count {made_t} (kt-kernel splits each expert into T NUMA slices).",
            f"set serving.kt_threadpool_count: {made_t}, or merge again with T={t}")
    return t


def _int8_stages() -> frozenset[str]:
    """The artifacts that hold AMXINT8 experts: quantize-int8's output, and the serve stage's ``.kt`` layout of it."""
    return frozenset({QUANTIZE_INT8_STAGE, KT_LAYOUT_STAGE})


def _check_expert_lora_layout(recipe: Recipe, kt_dir: Path, adapter_dir: Path) -> None:
    """AMXINT8 with an expert LoRA reads kt-kernel's ``.kt`` files only (the serve stage makes them)."""
    if recipe.serving.kt_method == "AMXINT8" and has_expert_lora(adapter_dir) and not has_kt_layout(kt_dir):
        raise InvalidInputError(
            f"kt_weight_dir {kt_dir}",
            "holds no _layer_L/_numa_N/*.kt files, but the adapter carries an expert LoRA: sglang-kt then serves "
            "the experts through kt-kernel's AMXINT8_SFT, which reads only that layout (not quantize-int8's "
            "blk.* safetensors).",
            "serve through ktflow's serve stage (it writes the .kt layout once, "
            "ktflow.stages.serve.sglang.inputs.int8_kt_layout), or pass that layout",
        )


def _check_int8_weights(kt_dir: Path, manifest: StageManifest | None, t: int) -> int:
    """AMXINT8 reads a quantize-int8 output made for this very T; return that T."""
    subject = f"kt_weight_dir {kt_dir}"
    if manifest is None:
        raise InvalidInputError(
            subject, f"is not a quantize-int8 output (no manifest.json with stage '{QUANTIZE_INT8_STAGE}'), but "
            "serving.kt_method AMXINT8 reads kt-kernel's pre-quantized INT8 experts.",
            "run the quantize-int8 stage and pass its output, or serve with kt_method BF16 from a BF16 checkpoint",
        )
    quant_method = manifest.settings.get("method", "AMXINT8")
    if quant_method != "AMXINT8":
        raise InvalidInputError(subject, f"was quantized for kt-kernel method {quant_method!r}, not AMXINT8.",
                                "re-run quantize-int8, or set serving.kt_method to match")
    quantized_t = manifest.settings.get("threadpool_count")
    if type(quantized_t) is not int:
        raise InvalidInputError(
            f"{kt_dir / 'manifest.json'}: settings.threadpool_count",
            f"is {quantized_t!r}; the INT8 layout depends on T, and this manifest does not say which.",
            "re-run the quantize-int8 stage",
        )
    if quantized_t != t:
        raise InvalidInputError(
            "serving.kt_threadpool_count",
            f"is {t}, but the AMXINT8 weights in {kt_dir} were quantized with threadpool_count {quantized_t} "
            "(kt-kernel splits each expert into T NUMA slices; served with another T the slices do not match).",
            f"set serving.kt_threadpool_count: {quantized_t}, or re-run quantize-int8 with T={t}",
        )
    return quantized_t
