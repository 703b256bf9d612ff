"""Shared test fixtures: tiny generated checkpoints, built once per session.

The directories these factories return are shared by every test of the session: treat them
as read-only and copy (``shutil.copytree``) before changing anything.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# Before anything imports transformers: never reach the network, and keep the remote-code
# modules that trust_remote_code copies out of the user's ~/.cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "HF_MODULES_CACHE" not in os.environ:
    _modules_cache = tempfile.mkdtemp(prefix="ktflow-test-hf-modules-")
    os.environ["HF_MODULES_CACHE"] = _modules_cache
    atexit.register(shutil.rmtree, _modules_cache, ignore_errors=True)

# Each test process (pytest-xdist runs two) has its own Prefect home: embedded API servers and
# their SQLite databases of concurrent tests never share a file, nor touch the user's ~/.prefect.
if "PREFECT_HOME" not in os.environ:
    _prefect_home = tempfile.mkdtemp(prefix="ktflow-test-prefect-home-")
    os.environ["PREFECT_HOME"] = _prefect_home
    atexit.register(shutil.rmtree, _prefect_home, ignore_errors=True)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# pytest-xdist runs the suite in several processes; each one's trainers, servers and kernels share
# its part of the cores (OpenMP threads of two processes spinning on the same cores slow both).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import functools  # noqa: E402

import pytest  # noqa: E402

from ktflow.fixtures.checkpoints import FixtureSpec, make_fixture  # noqa: E402


@functools.cache
def int8_kernels_missing() -> str | None:
    """Why kt-kernel's INT8 MoE kernels cannot run on this host (None: they can).

    The same check the quantize-int8 stage and ``ktflow doctor`` make, so a test is skipped
    exactly where the product would refuse or skip: on a CPU without AVX512F + AVX512BW, or
    where KT_KERNEL_CPU_VARIANT forces kt-kernel's avx2 build.
    """
    from ktflow.host.hardware import probe_host
    from ktflow.planning.stage_plan import INT8_KERNELS, check_requirement

    return "; ".join(check_requirement(INT8_KERNELS, probe_host())) or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first (pytest-xdist hands tests out in this order: the long ones start while the
    short ones fill the gaps); tests marked ``int8_kernels`` run where kt-kernel's INT8 kernels do,
    else are skipped with the reason."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order within each
    reason = int8_kernels_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs kt-kernel's INT8 kernels: {reason}")
    for item in items:
        if item.get_closest_marker("int8_kernels"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def int8_kernels() -> bool:
    """Whether this host runs kt-kernel's INT8 kernels: where they are missing, the pipeline skips
    the quantize-int8 stage (with the reason) instead of running it."""
    return int8_kernels_missing() is None


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``fixture_dir(kind, **dims)``: the generated checkpoint for ``FixtureSpec(kind=kind, **dims)``.

    Each distinct spec is generated once per session (a few hundred ms). Read-only.
    """
    built: dict[FixtureSpec, Path] = {}

    def get(kind: str, **dims: int) -> Path:
        spec = FixtureSpec(kind=kind, **dims)
        if spec not in built:
            name = "-".join([kind, *(f"{k}{v}" for k, v in sorted(dims.items()))])
            built[spec] = make_fixture(spec, tmp_path_factory.mktemp("fixtures") / name)
        return built[spec]

    return get


@pytest.fixture(scope="session")
def reference_bf16_dir(
    fixture_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """``reference_bf16_dir(kind, **dims)``: the quantized fixture decoded to BF16 by compressed-tensors.

    The reference decode for comparing ktflow's converter with: compressed-tensors'
    ``convert_checkpoint`` with ``CompressedTensorsDequantizer`` (Kimi INT4) or
    ``FP8BlockDequantizer`` (DeepSeek-V3 FP8) on CPU, then ``quantization_config`` removed at
    every level (compressed-tensors leaves ``text_config.quantization_config`` in place).
    Read-only.
    """
    import torch
    from compressed_tensors.entrypoints.convert import (
        CompressedTensorsDequantizer,
        FP8BlockDequantizer,
        convert_checkpoint,
    )

    built: dict[tuple, Path] = {}

    def get(kind: str, **dims: int) -> Path:
        key = (kind, tuple(sorted(dims.items())))
        if key not in built:
            src = fixture_dir(kind, **dims)
            if kind == "deepseek-v3":
                converter = FP8BlockDequantizer.from_pretrained(src, dtype=torch.bfloat16)
            elif kind in ("kimi-k2.5", "kimi-k2"):
                converter = CompressedTensorsDequantizer(src, dtype=torch.bfloat16)
            else:
                raise ValueError(f"fixture kind {kind!r} is not quantized")
            dst = tmp_path_factory.mktemp("reference-bf16") / kind
            convert_checkpoint(src, dst, converter=converter, max_workers=1, device="cpu")
            config = json.loads((dst / "config.json").read_text())
            config.pop("quantization_config", None)
            if isinstance(config.get("text_config"), dict):
                config["text_config"].pop("quantization_config", None)
            (dst / "config.json").write_text(json.dumps(config, indent=2))
            built[key] = dst
        return built[key]

    return get


# --------------------------------------------------------------------------- the suite's own hygiene

from session_guard import (  # noqa: E402,F401  (hooks: every process the tests start is accounted for)
    pytest_configure,
    pytest_configure_node,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# --------------------------------------------------------------------------- the distributed cluster


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's load scheduling, with the modules that share the session's cluster handed to
    one worker as one unit (each builds its own session fixtures: two workers would make two
    clusters and run the first pipeline twice). Decided from the node ids in the controller, as
    pytest-xdist's ``loadgroup`` does with its marker (which pytest 9.2's node ids no longer take)."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from distributed import CLUSTER_MODULES
    from xdist.scheduler import LoadScopeScheduling

    class ClusterAsOneUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "the distributed cluster" if nodeid.split("::", 1)[0] in CLUSTER_MODULES else nodeid

    return ClusterAsOneUnit(config, log)


@pytest.fixture(scope="session")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """One Prefect server (PostgreSQL where installed) with the two hosts' workers, for the session:
    tests/test_orchestration.py and tests/test_ui.py (one xdist group, so one worker builds it)."""
    from distributed import distributed_setup

    with distributed_setup(tmp_path_factory.mktemp("distributed")) as made:
        yield made


@pytest.fixture(scope="session")
def first_run(setup):
    """The demo pipeline run once on ``setup``, with the server restarted while SFT trains; it
    must complete (else every test that reads it fails with this fixture's error)."""
    from distributed import first_run as run_first

    run = run_first(setup)
    if run.final["state_type"] != "COMPLETED":
        raise AssertionError(f"the session's first pipeline run {run.parent} ended "
                             f"{run.final['state_type']}: {run.final['state'].get('message')}")
    return run
