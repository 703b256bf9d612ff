"""What serving needs of a host: the server's memory (:func:`serve_needs`, from the sizes :func:`measure_serve`
reads off headers), and what judging a candidate beside production costs in each mode, priced on a host
(:func:`candidate_prices`), with the mode chosen from those prices (:func:`choose_candidate_mode`). The plan,
the serve stage's preflight and promotion read the same figures."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from ktflow.host.hardware import HostInfo
from ktflow.planning.sizing import ModelSize, model_size
from ktflow.planning.stage_plan import host_requirements
from ktflow.recipe import Recipe
from ktflow.registry import CandidateMode
from ktflow.resources import GpuNeed, RamNeed, Resources, gpu_shortfall, ram_shortfall
from ktflow.units import GiB, human_bytes


class ServeSizes(BaseModel):
    """What the serve stage's needs are a function of."""

    model: ModelSize  # the checkpoint the server loads (sglang: its non-expert weights go to the GPUs)
    kt_weight_bytes: int = 0  # sglang: the CPU expert weights as ``serving.kt_method`` reads them


def measure_serve(model_dir: Path, kt_weight_dir: Path | None = None) -> ServeSizes:
    """The sizes :func:`serve_needs` reads, from headers only.

    Raises:
        CheckpointError: a config or header cannot be read.
    """
    kt_bytes = 0
    if kt_weight_dir is not None:
        kt = model_size(kt_weight_dir)
        kt_bytes = kt.expert_stored_bytes or kt.stored_bytes  # quantize-int8's output holds experts only
    return ServeSizes(model=model_size(model_dir), kt_weight_bytes=kt_bytes)


def serve_needs(recipe: Recipe, sizes: ServeSizes) -> Resources:
    """What serving ``recipe`` needs of its host: the CPU experts in RAM and the rest on the GPUs
    (sglang-kt), or the whole model in RAM (LlamaFactory's CPU API); both in BF16 where not quantized.
    sglang's KV pool is counted where ``serving.max_total_tokens`` bounds it and the model's KV geometry is
    known (:func:`kv_pool_bytes`); otherwise it comes on top (sglang gives it what the GPU has left) and the
    GPU figure is a lower bound, said so in its ``why``.
    """
    serving = recipe.serving
    requirement = host_requirements(recipe)["serve"]
    if serving.backend == "llamafactory":
        return Resources(host=requirement, ram=RamNeed(
            bytes=2 * sizes.model.parameters, what="serve", why="the model in BF16 with the adapter merged"))
    gpus = max(serving.gpus, 1)
    pool = kv_pool_bytes(recipe, sizes.model)
    weights_why = "the non-expert weights in BF16, split over the tensor-parallel ranks"
    if pool is not None:
        kv_why = (f", and a KV pool of {serving.max_total_tokens:,} tokens x {sizes.model.kv_bytes_per_token:,} B "
                  f"({'an MLA latent, whole on each rank' if sizes.model.kv_latent else 'split over the ranks'})")
    elif serving.max_total_tokens is not None:
        kv_why = f"; the KV pool of {serving.max_total_tokens:,} tokens comes on top (the model's KV size is unknown)"
    else:
        kv_why = ("; the KV pool comes on top (sglang gives it the GPU memory left: set serving.max_total_tokens to "
                  "bound it and count it here)")
    return Resources(
        host=requirement,
        ram=RamNeed(bytes=sizes.kt_weight_bytes, what="serve", why=f"the CPU experts as {serving.kt_method}",
                    of="installed", numa_pools=serving.kt_threadpool_count),
        # sglang holds its weights and KV pool in mem_fraction_static of each GPU's memory (the rest: activations)
        gpu=GpuNeed(bytes=2 * sizes.model.non_expert_parameters // gpus + (pool or 0), gpus=gpus,
                    fraction=serving.mem_fraction_static or 1.0, field="serving.gpus", what="sglang-kt",
                    why=weights_why + kv_why + (f"; mem_fraction_static {serving.mem_fraction_static:g} of each GPU"
                                                if serving.mem_fraction_static else "")),
    )


def kv_pool_bytes(recipe: Recipe, model: ModelSize) -> int | None:
    """One GPU's share of sglang's KV pool when ``serving.max_total_tokens`` bounds it (None: unbounded, or the
    model's KV geometry unknown). An MLA latent is held whole on every tensor-parallel rank; per-head keys and
    values are split over the ranks by KV head.
    """
    tokens = recipe.serving.max_total_tokens
    if tokens is None or not model.kv_bytes_per_token:
        return None
    total = tokens * model.kv_bytes_per_token
    return total if model.kv_latent else total // max(recipe.serving.gpus, 1)


# How many servers judging a candidate starts beside production, per mode (the evaluation asks the base model
# through a server of its own: LlamaFactory's API serves one model per process, and sglang-kt refuses base
# requests on a server whose expert LoRA is loaded). beside with serving.dynamic_lora: none (see candidate_needs).
CANDIDATE_SERVERS = {"beside": 2, "offline": 0, "swap": 1}


def candidate_servers(recipe: Recipe, mode: str) -> int:
    """The servers judging a candidate in ``mode`` runs beside production's (or, ``swap``, beside the
    candidate serving in its place)."""
    if mode == "beside" and recipe.serving.backend == "sglang" and recipe.serving.dynamic_lora:
        return 0  # a second adapter name on production's server, which answers base requests too
    return CANDIDATE_SERVERS[mode]


def candidate_needs(recipe: Recipe, sizes: ServeSizes, mode: str) -> Resources:
    """What judging a candidate costs on top of production (``evaluation.candidate``).

    ``beside``: a second adapter name on the server where it loads adapters at run time (a few MB;
    plain SGLang's ``serving.dynamic_lora``), else a server for the candidate and one for the base
    model beside production (:func:`serve_needs` twice: for sglang-kt each holds its own copy of the
    CPU experts in RAM and its non-expert weights on the same GPUs). ``offline``: the training
    toolchain generating with the model in BF16 in RAM (LlamaFactory's chat engine on CPU).
    ``swap``: the candidate serves in production's place while it is judged; the base model is
    asked through a server of its own beside it (:func:`serve_needs` once).
    """
    if mode == "offline":
        return Resources(ram=RamNeed(bytes=2 * sizes.model.parameters, what="offline candidate generation",
                                     why="the model in BF16 in the training toolchain"))
    servers = candidate_servers(recipe, mode)
    if servers == 0:
        return Resources()
    one = serve_needs(recipe, sizes)
    what = "judging the candidate"
    each = {2: "two more servers, the candidate's and the base model's, each with ",
            1: "one more server, the base model's, beside the candidate serving in production's place, with "}[servers]
    ram = one.ram.model_copy(update={"bytes": servers * one.ram.bytes, "what": what,
                                     "why": f"{each}{one.ram.why}"}) if one.ram else None
    gpu = one.gpu.model_copy(update={"bytes": servers * one.gpu.bytes, "what": what,
                                     "why": f"{each}{one.gpu.why}"}
                             ) if one.gpu else None
    return Resources(ram=ram, gpu=gpu)


def candidate_gpu_shortfall(recipe: Recipe, sizes: ServeSizes, mode: str, host: HostInfo) -> str | None:
    """Why the servers judging a candidate in ``mode`` do not fit on the GPUs production serves from
    (None: they do, or no GPU is involved).

    sglang sizes a server's static memory (weights and KV cache) as ``mem_fraction_static`` f of the
    GPU memory free when it starts: production takes f of each GPU, the next server f of what is
    left, and so on, so the n-th server beside production gets f (1 - f)^n of it, which must hold
    its non-expert weights. With f unset, sglang-kt gives production all of each GPU but its
    activation reserve: no second server fits.
    """
    serving = recipe.serving
    servers = candidate_servers(recipe, mode)
    gpus = host.gpus[: max(serving.gpus, 1)]
    if serving.backend != "sglang" or servers == 0 or not gpus:
        return None
    who = {2: "the candidate's and the base model's servers", 1: "the base model's server"}[servers]
    f = serving.mem_fraction_static
    if f is None:
        return (f"{who} would share the GPUs with production, but serving.mem_fraction_static is unset: sglang-kt "
                "then sizes production's weights and KV cache to all of each GPU but its activation reserve; set it "
                "(every server of the recipe takes that fraction of the GPU memory free when it starts)")
    weights = 2 * sizes.model.non_expert_parameters // max(serving.gpus, 1)
    for g in gpus:
        room = f * (1 - f) ** servers * g.vram_bytes
        if weights > room:
            return (f"{who} would share GPU {g.index} ({g.name}, {g.vram_bytes / GiB:.1f} GiB) with production: each "
                    f"sglang server takes mem_fraction_static {f} of the GPU memory free when it starts, which leaves "
                    f"the last one {room / GiB:.2f} GiB, less than its non-expert weights in BF16 "
                    f"({weights / GiB:.2f} GiB)")
    return None


class CandidatePrice(BaseModel):
    """What judging a candidate in one mode costs on a host, on top of production, and whether it fits."""

    mode: CandidateMode
    ram_bytes: int = 0
    gpu_bytes: int = 0  # per GPU
    servers: int = 0  # servers started beside production's (or beside the candidate serving in its place)
    problem: str | None = None  # why it does not fit (None: it does)

    def brief(self) -> str:
        """``beside: +16.0 GiB RAM, 2 more servers: does not fit (...)``."""
        costs = [f"+{human_bytes(self.ram_bytes)} RAM" if self.ram_bytes else "",
                 f"+{human_bytes(self.gpu_bytes)} per GPU" if self.gpu_bytes else "",
                 f"{self.servers} more server{'s' if self.servers != 1 else ''}" if self.servers else ""]
        what = ", ".join(c for c in costs if c) or "no more memory"
        traffic = "; the candidate takes production traffic while judged" if self.mode == "swap" else ""
        return f"{self.mode}: {what}{traffic}: " + ("fits" if self.problem is None else f"does not fit ({self.problem})")


class CandidateChoice(BaseModel):
    """How a candidate is judged on a host, and why."""

    mode: CandidateMode
    reason: str
    ram_bytes: int = 0  # what judging it costs on top of production (RAM)
    gpu_bytes: int = 0  # and GPU memory, per GPU
    problem: str | None = None  # the chosen mode does not fit (set by evaluation.candidate): why
    prices: list[CandidatePrice] = []  # every mode, priced on this host


def candidate_prices(recipe: Recipe, sizes: ServeSizes, host: HostInfo, *,
                     production_running: bool) -> list[CandidatePrice]:
    """Each candidate mode (beside, offline, swap) priced on ``host``: what it costs on top of
    production (:func:`candidate_needs`) and whether that fits.

    ``production_running``: production's memory is already in use on ``host`` (a live endpoint: the
    extra RAM must be available now); else (a plan) production's is added to it. GPU memory:
    :func:`candidate_gpu_shortfall` for sglang (servers sharing the GPUs
    production serves from), the GPUs' capacity otherwise.
    """
    production = serve_needs(recipe, sizes)
    prices = []
    for mode in ("beside", "offline", "swap"):
        needs = candidate_needs(recipe, sizes, mode)
        problems = []
        if needs.ram is not None and needs.ram.bytes:
            ram = needs.ram
            if production_running:
                ram = ram.model_copy(update={"of": "available"})  # production holds its share already
            elif production.ram is not None:
                ram = RamNeed(bytes=ram.bytes + production.ram.bytes, what=f"{ram.what} beside production",
                              why=f"{ram.why}; production: {production.ram.why}", of=ram.of,
                              numa_pools=ram.numa_pools)
            problems.append(ram_shortfall("serve", ram, host))
        if recipe.serving.backend == "sglang":
            problems.append(candidate_gpu_shortfall(recipe, sizes, mode, host))
        elif needs.gpu is not None and needs.gpu.bytes:
            problems.append(gpu_shortfall("serve", needs.gpu, host))
        prices.append(CandidatePrice(
            mode=mode, ram_bytes=needs.ram.bytes if needs.ram else 0, gpu_bytes=needs.gpu.bytes if needs.gpu else 0,
            servers=candidate_servers(recipe, mode), problem="; ".join(p for p in problems if p) or None))
    return prices


def choose_candidate_mode(recipe: Recipe, sizes: ServeSizes, host: HostInfo, *,
                          production_running: bool) -> CandidateChoice:
    """``evaluation.candidate`` when the recipe sets it; else ``beside`` when a candidate fits beside
    production on ``host``, ``offline`` when generation through the training toolchain does, else
    ``swap``; never silently: the reason says which and why, and ``prices`` every mode.

    sglang-kt (KT's fork) loads its one adapter at start-up and cannot load another at run time, so
    ``beside`` is a second sglang-kt process for the candidate on a free port (and one for the base
    model, which a server with a KT expert LoRA refuses to answer): a second copy of the CPU experts
    in RAM and another share of each GPU (see :func:`candidate_prices`); plain SGLang with
    ``serving.dynamic_lora`` loads the candidate under a second adapter name instead.

    ``production_running``: production's memory is already in use on ``host`` (a live endpoint);
    else (a plan) it is added to the candidate's.
    """
    prices = {p.mode: p for p in candidate_prices(recipe, sizes, host, production_running=production_running)}

    def choice(mode: CandidateMode, reason: str) -> CandidateChoice:
        needs = candidate_needs(recipe, sizes, mode)
        return CandidateChoice(mode=mode, reason=reason, ram_bytes=needs.ram.bytes if needs.ram else 0,
                               gpu_bytes=needs.gpu.bytes if needs.gpu else 0, problem=prices[mode].problem,
                               prices=list(prices.values()))

    explicit = recipe.evaluation.candidate
    if explicit is not None:
        problem = prices[explicit].problem
        return choice(explicit, "set by evaluation.candidate" + (f" (though {problem})" if problem else ""))
    beside = prices["beside"].problem
    if beside is None:
        needs = candidate_needs(recipe, sizes, "beside")
        what = needs.ram.why if needs.ram else "a second adapter name on the server"
        return choice("beside", f"{what} fits beside production: the candidate takes no production traffic")
    offline = prices["offline"].problem
    if offline is None:
        return choice("offline", f"nothing fits beside production ({beside}); offline generation through the "
                                 "training toolchain does")
    return choice("swap", f"nothing fits beside production ({beside}), nor offline generation ({offline}): the "
                          "candidate serves in production's place and a failed gate rolls production back")
