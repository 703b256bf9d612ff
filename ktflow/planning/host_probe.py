"""A host probe that measures what KT does: kt-kernel's own SFT expert kernels, timed before a host's first KT run.

The step model (:mod:`ktflow.planning.costs`) is fitted on one machine, and machines of one kind differ
more than the model does; a torch matmul and bandwidth microbenchmark did not explain why, a KT run does
(:mod:`ktflow.planning.host_speed`). So before a host has KT runs to calibrate its plan, the plan times
kt-kernel itself there: one MoE layer of its SFT wrapper (``KTMoEWrapper(mode="sft")``), forward and
backward, in the recipe's kt-kernel method (BF16, Kimi RAWINT4, FP8, ...), at the recipe model's expert
shape (hidden, moe_intermediate, top-k), the recipe's KT threads and NUMA pools, over synthetic experts
sized to defeat the CPU caches (:data:`PROBE_WEIGHT_BYTES`: fewer experts than the model's, at the
model's tokens an expert), for at most :data:`PROBE_TIME_LIMIT_S` (the driver
:mod:`ktflow._drivers.kt_probe`, in the KT toolchain). The result is kept per machine (CPU model,
physical cores, NUMA nodes: ``HostInfo.machine``) and settings under ``<store>/host-probe/``, so the
next plan reuses it.

The scale: the time model predicts the probe's own work as it predicts a step's KT passes; the
probe's measured / predicted seconds on a host, divided by the same ratio on the machine of the fit
(``CostModel.kt_probe_reference``, by method), scales KT's CPU passes (``kt_cpu_factor``). That
machine was never probed: the reference is estimated from hosts with both a probe and KT runs (their
probe ratio over the factor their runs' CPU passes needed; ``benchmarks/probe_reference.py``). A method
with no reference yet keeps the prediction as fitted, and the plan reports the probe's figures and says so.
A host with KT runs is calibrated by them instead (:func:`~ktflow.planning.host_speed.calibrated_costs`).
A host whose CPU has no kt-kernel SFT kernels, or no toolchain with kt-kernel, is planned as before,
and the plan says why it was not probed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from ktflow.errors import KtflowError
from ktflow.host.hardware import HostInfo
from ktflow.host.process import ktflow_pythonpath, run_tool, tool_versions
from ktflow.planning.costs import COSTS, CostModel, kt_step_estimate
from ktflow.planning.sizing import ModelSize, kt_share_backward_bb
from ktflow.recipe import Recipe, SftConfig
from ktflow.units import GiB

PROBE_TIME_LIMIT_S = 30.0
# The synthetic experts' bytes as the method stores them: past the last-level cache of the CPUs KT runs on
# (32-384 MiB a socket), so every pass reads its experts from memory, as a real model's layer does; no more,
# so that making them stays a few seconds of the time limit on a small host.
PROBE_WEIGHT_BYTES = 512 * 1024 * 1024
PROBE_MAX_EXPERTS = 1024
PROBE_MAX_TOKENS = 8192
PROBE_DIR = "host-probe"
# kt-kernel builds with SFT kernels (kt_kernel/_cpu_detect.py, 0.7.x).
SFT_VARIANTS = ("amx", "avx512_bf16")

# kt-kernel 0.7.2's kt_backend -> SFT method (kt_kernel/sft/wrapper.py), and "auto" by expert weight format.
_METHOD_BY_BACKEND = {"AMXBF16": "AMXBF16_SFT", "FP8": "AMXFP8_SFT", "AMXFP8": "AMXFP8_SFT", "INT8": "INT8_SFT",
                      "AMXINT8": "INT8_SFT", "RAWINT4": "RAWINT4_SFT", "AMXINT4_KGROUP": "RAWINT4_SFT",
                      "MXFP4": "MXFP4_SFT", "AMXINT4": "AMXINT4_SFT"}
_METHOD_BY_FORMAT = {"bf16": "AMXBF16_SFT", "rawint4": "RAWINT4_SFT", "fp8": "AMXFP8_SFT", "int8": "INT8_SFT",
                     "mxfp4": "MXFP4_SFT"}
# Bytes a parameter of the probe's synthetic experts takes, by method (BF16 tensors otherwise).
_BYTES_PER_PARAM = {"RAWINT4_SFT": 0.5625, "AMXFP8_SFT": 1.0}


def kt_sft_method(sft: SftConfig) -> str:
    """The kt-kernel SFT method a KT run of ``sft`` uses (``kt_config.kt_backend``, or its weight format's)."""
    kt = sft.kt_config
    if kt is None:
        return "AMXBF16_SFT"
    if kt.kt_backend == "auto":
        return _METHOD_BY_FORMAT.get(kt.effective_weight_format, "AMXBF16_SFT")
    return _METHOD_BY_BACKEND.get(kt.kt_backend, "AMXBF16_SFT")


class KtProbeSettings(BaseModel):
    """What the probe runs: one MoE layer of kt-kernel's SFT wrapper (the driver's plan)."""

    method: str  # kt-kernel's SFT method, e.g. RAWINT4_SFT
    hidden: int
    moe_intermediate: int
    experts: int  # synthetic experts: enough bytes to defeat the caches (not the model's count)
    top_k: int
    tokens: int  # the model's tokens an expert at the recipe's bound (cutoff_len x micro-batch), over ``experts``
    threads: int
    pools: int
    lora_rank: int
    lora_alpha: float
    share_backward_bb: bool

    def describe(self) -> str:
        return (f"{self.method} {self.hidden}x{self.moe_intermediate} experts, {self.experts} of them top-{self.top_k}, "
                f"{self.tokens} tokens, {self.threads} threads in {self.pools} pool(s)")


class KtProbe(BaseModel):
    """One probe's result on one machine, as kept in the store."""

    machine: str  # HostInfo.machine
    settings: KtProbeSettings
    status: Literal["measured", "skipped"]
    reason: str = ""  # skipped: why kt-kernel cannot run it here
    toolchain: str = ""  # the recipe field and python it ran in
    kt_kernel: str = ""
    cpu_variant: str = ""  # the kt-kernel build that ran
    forward_s: float | None = None  # medians over ``pairs`` forward + backward pairs, after one warm-up
    backward_s: float | None = None
    pairs: int = 0
    weight_bytes: int = 0  # the synthetic experts as stored
    setup_s: float = 0.0
    wall_s: float = 0.0
    measured_at: str = ""

    @property
    def seconds(self) -> float | None:
        return None if self.forward_s is None or self.backward_s is None else self.forward_s + self.backward_s

    def figures(self) -> str:
        """The raw figures: what ran, and its forward and backward seconds."""
        s = self.settings
        if self.status != "measured" or self.forward_s is None or self.backward_s is None:
            return f"{s.describe()}: not measured ({self.reason})"
        flops = s.tokens * s.top_k * 2 * 3 * s.hidden * s.moe_intermediate
        return (f"kt-kernel {self.kt_kernel} ({self.cpu_variant}) {s.describe()}, {self.weight_bytes / GiB:.2f} GiB of "
                f"synthetic experts: forward {self.forward_s * 1e3:.1f} ms ({flops / self.forward_s / 1e12:.2f} "
                f"TFLOP/s), backward {self.backward_s * 1e3:.1f} ms, median of {self.pairs} after a warm-up "
                f"({self.measured_at[:10]})")


class ProbeScale(BaseModel):
    """What the probe makes of a host's uncalibrated KT step: the factor on KT's CPU passes, and why."""

    factor: float = 1.0  # kt_cpu_factor; 1: the prediction as fitted
    probe: KtProbe | None = None
    predicted_s: float | None = None  # the time model's seconds for the probe's forward + backward
    ratio: float | None = None  # measured / predicted on this host
    reference: float | None = None  # the same ratio on the machine of the fit (None: never measured)
    basis: str


def probe_settings(sft: SftConfig, size: ModelSize, threads: int,
                   weight_bytes: int = PROBE_WEIGHT_BYTES) -> KtProbeSettings | None:
    """The probe for a KT run of ``sft`` on ``size`` at ``threads`` KT threads; None when the model's experts
    are unknown. The experts are as many as make ``weight_bytes`` (at least twice top-k), the tokens as
    many as give each expert the model's share of ``cutoff_len x per_device_train_batch_size``."""
    layers, routed, top_k = size.moe_layers, size.routed_experts, min(size.experts_per_token, size.routed_experts)
    if not (layers and routed and top_k and size.expert_parameters and size.hidden_size):
        return None
    hidden = size.hidden_size
    inter = round(size.expert_parameters / (layers * routed) / (3 * hidden))
    if inter <= 0:
        return None
    method = kt_sft_method(sft)
    per_expert = 3 * hidden * inter * _BYTES_PER_PARAM.get(method, 2.0)
    experts = min(max(math.ceil(weight_bytes / per_expert), 2 * top_k), PROBE_MAX_EXPERTS)
    tokens_an_expert = sft.cutoff_len * sft.per_device_train_batch_size * top_k / routed
    tokens = max(1, min(round(tokens_an_expert * experts / top_k), PROBE_MAX_TOKENS))
    pools = sft.kt_config.effective_threadpool_count if sft.kt_config is not None else 1
    return KtProbeSettings(method=method, hidden=hidden, moe_intermediate=inter, experts=experts, top_k=top_k,
                           tokens=tokens, threads=max(int(threads), 1), pools=pools, lora_rank=sft.lora_rank,
                           lora_alpha=sft.lora_alpha, share_backward_bb=kt_share_backward_bb(sft))


def probe_model_seconds(settings: KtProbeSettings, sft: SftConfig, costs: CostModel = COSTS) -> float:
    """The time model's forward + backward seconds for the probe's layer: KT's passes of one micro-batch
    (one forward: the probe recomputes nothing) through one MoE layer of ``settings.experts`` experts, at
    the constants as fitted (no host factor)."""
    params = 3 * settings.hidden * settings.moe_intermediate * settings.experts
    size = ModelSize(path="kt-probe", parameters=params, hidden_size=settings.hidden, num_layers=1, vocab_size=0,
                     linear_shapes={}, expert_parameters=params, moe_layers=1, routed_experts=settings.experts,
                     experts_per_token=settings.top_k)
    one = sft.model_copy(update={"gradient_accumulation_steps": 1, "kt_cpu_activation": "retain"})
    fitted = costs.model_copy(update={"kt_host_factor": 1.0, "kt_cpu_factor": 1.0})
    estimate = kt_step_estimate(size, one, settings.threads, fitted, settings.tokens)
    return estimate.kt_forward_s + estimate.kt_backward_s


def cache_path(store_root: str | os.PathLike[str], machine: str) -> Path:
    """Where a machine's probes are kept: ``<store>/host-probe/<digest of the machine>.json``."""
    return Path(store_root) / PROBE_DIR / f"{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json"


def cached_probes(store_root: str | os.PathLike[str], machine: str) -> list[KtProbe]:
    """Every probe kept for ``machine`` in the store (an unreadable file: none)."""
    try:
        document = json.loads(cache_path(store_root, machine).read_text(encoding="utf-8"))
        return [p for p in (KtProbe.model_validate(item) for item in document.get("probes", []))
                if p.machine == machine]
    except (OSError, ValueError, AttributeError):
        return []


def cached_probe(store_root: str | os.PathLike[str], machine: str, settings: KtProbeSettings) -> KtProbe | None:
    """The kept probe of ``machine`` with exactly ``settings``, if any."""
    return next((p for p in cached_probes(store_root, machine) if p.settings == settings), None)


def keep_probe(store_root: str | os.PathLike[str], probe: KtProbe) -> Path:
    """Add ``probe`` to its machine's file (replacing one with the same settings), written whole and renamed."""
    path = cache_path(store_root, probe.machine)
    kept = [p for p in cached_probes(store_root, probe.machine) if p.settings != probe.settings] + [probe]
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"machine": probe.machine, "probes": [p.model_dump(mode="json") for p in kept]}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".probe-", suffix=".tmp", delete=False,
                                     encoding="utf-8") as handle:
        handle.write(json.dumps(document, indent=1))
    os.replace(handle.name, path)
    return path


def probe_toolchain(recipe: Recipe) -> tuple[str, Path, dict[str, str]] | str:
    """The toolchain the probe runs in, as ``(recipe field, python, extra env)``: the training one (KT's SFT
    stack), else the serving one, whichever first has kt-kernel; else why neither can."""
    tried = []
    for field, chain in (("toolchains.train.python", recipe.toolchains.train),
                         ("toolchains.serve.python", recipe.toolchains.serve)):
        python = chain.python.absolute()  # not resolved: a venv's python is a symlink to the base
        if python.is_file() and "kt-kernel" in tool_versions(python, ("kt-kernel",)):
            return field, python, dict(chain.env)
        tried.append(f"{field} ({python}{'' if python.is_file() else ': missing'})")
    return f"no toolchain with kt-kernel: {' nor '.join(tried)}"


def run_probe(settings: KtProbeSettings, machine: str, python: Path, *, toolchain: str = "",
              env: dict[str, str] | None = None, time_limit_s: float = PROBE_TIME_LIMIT_S) -> KtProbe:
    """Run the driver once in ``python``'s toolchain and return its result (measured, or skipped with kt-kernel's
    reason).

    Raises:
        KtflowError: kt-kernel does not import there, or the driver failed or ran past three times
            ``time_limit_s`` plus a minute (its output's tail says why).
    """
    with tempfile.TemporaryDirectory(prefix="ktflow-probe-") as tmp, ktflow_pythonpath() as pkg_dir:
        plan_path, out_path = Path(tmp) / "plan.json", Path(tmp) / "result.json"
        plan_path.write_text(json.dumps({**settings.model_dump(), "time_limit_s": time_limit_s}), encoding="utf-8")
        argv = [str(python), "-m", "ktflow._drivers.kt_probe", "--plan", str(plan_path), "--out", str(out_path)]
        child_env = {**os.environ, **(env or {}), "PYTHONPATH": pkg_dir, "PYTHONUNBUFFERED": "1"}
        run_tool(argv, env=child_env, timeout_s=3 * time_limit_s + 60)
        try:
            result = json.loads(out_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise KtflowError(f"the KT probe wrote no result ({exc})") from None
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    common = {"machine": machine, "settings": settings, "toolchain": f"{toolchain} {python}".strip(),
              "kt_kernel": result.get("kt_kernel", ""), "cpu_variant": result.get("cpu_variant", ""),
              "measured_at": now}
    if result.get("status") == "unavailable":  # the toolchain's fault, not the machine's: nothing to keep
        raise KtflowError(f"{toolchain or python}: {result.get('reason')}")
    if result.get("status") != "ok":
        return KtProbe(status="skipped", reason=str(result.get("reason", "no reason given")), **common)
    return KtProbe(status="measured", forward_s=result["forward_median_s"], backward_s=result["backward_median_s"],
                   pairs=len(result["forward_s"]), weight_bytes=result["weight_bytes"], setup_s=result["setup_s"],
                   wall_s=result["wall_s"], **common)


def probe_scale(recipe: Recipe, size: ModelSize, host: HostInfo, threads: int, costs: CostModel = COSTS, *,
                run: bool = False, time_limit_s: float = PROBE_TIME_LIMIT_S,
                weight_bytes: int = PROBE_WEIGHT_BYTES) -> ProbeScale:
    """The factor on KT's CPU passes for ``recipe`` on ``host`` from its probe, and the words the plan says.

    The probe kept for ``host.machine`` with these settings is used; without one, ``run`` (this machine is
    ``host``) runs it and keeps the result. The factor is 1 (the prediction as fitted) unless the probe
    measured and ``costs.kt_probe_reference`` holds the method's reference ratio.
    """
    fitted = "the prediction as fitted"
    settings = probe_settings(recipe.sft, size, threads, weight_bytes)
    if settings is None:
        return ProbeScale(basis=f"KT probe: not run (the model's experts are not known); {fitted}")
    probe = cached_probe(recipe.store.root, host.machine, settings)
    if probe is None and not run:
        return ProbeScale(basis=f"KT probe: none of this machine ({host.machine}) with {settings.describe()} in the "
                                f"store (`ktflow plan` there runs it); {fitted}")
    if probe is None:
        if host.runnable_variant not in SFT_VARIANTS:
            return ProbeScale(basis=f"KT probe: not run: this CPU's kt-kernel build ({host.runnable_variant}) has no SFT "
                                    f"kernels (they need AVX512-BF16 or AMX); {fitted}")
        chain = probe_toolchain(recipe)
        if isinstance(chain, str):
            return ProbeScale(basis=f"KT probe: not run: {chain} (run `make kt-train-env`, or point "
                                    f"toolchains.train.python at an environment with kt-kernel); {fitted}")
        field, python, env = chain
        try:
            probe = run_probe(settings, host.machine, python, toolchain=field, env=env, time_limit_s=time_limit_s)
        except KtflowError as exc:
            return ProbeScale(basis=f"KT probe: failed ({str(exc).splitlines()[0]}); {fitted}")
        keep_probe(recipe.store.root, probe)
    if probe.status != "measured" or probe.seconds is None:
        return ProbeScale(probe=probe, basis=f"KT probe: {probe.figures()}; {fitted}")
    predicted = probe_model_seconds(settings, recipe.sft, costs)
    ratio = probe.seconds / predicted
    reference = costs.kt_probe_reference.get(settings.method)
    measured = f"KT probe: {probe.figures()}: {ratio:.2f}x the model's {predicted * 1e3:.1f} ms"
    if not reference:
        return ProbeScale(probe=probe, predicted_s=predicted, ratio=ratio,
                          basis=f"{measured}; not used: no host with KT runs has probed {settings.method} yet, so there "
                                f"is no reference to scale by; {fitted}")
    factor = ratio / reference
    return ProbeScale(factor=factor, probe=probe, predicted_s=predicted, ratio=ratio, reference=reference,
                      basis=f"{measured}, the reference {reference:.2f}x (hosts with KT runs): KT's CPU passes "
                            f"x{factor:.2f}")
