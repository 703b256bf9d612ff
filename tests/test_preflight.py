"""The GPU workstation's install: the preflight on made-up hosts, the smoke check, and the KT toolchains' locks.

The preflight judges host facts (ktflow/host/preflight.py) without probing anything, so every requirement is
checked here on hosts this machine is not: an old glibc, Python 3.13, no driver, CUDA 13's nvcc, an AVX2 CPU.
The smoke check runs its CPU parts in the installed toolchains (skipped where they are not installed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ktflow.host.preflight import (
    INSTALL_DISK_BYTES,
    HostFacts,
    SmokeProbe,
    parse_gpu_query,
    parse_nvcc_version,
    preflight,
    run_smoke,
    smoke_probes,
)
from ktflow.units import GiB

REPO = Path(__file__).resolve().parent.parent
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
KT_PYTHON = REPO / ".venv-kt-train" / "bin" / "python"

WORKSTATION = HostFacts(
    machine="x86_64", glibc=(2, 35), os_name="Ubuntu 22.04.5 LTS", python=(3, 12), python_path="/usr/bin/python3.12",
    cpu_model="Intel(R) Xeon(R) w9-3495X", cpu_variant="amx", driver="580.95.05",
    gpus=["NVIDIA GeForce RTX 4090 (sm89)"], compute_caps=[(8, 9)], nvcc=(12, 8), gxx=(11, 4),
    disk_path="/home/me/ktflow", disk_free_bytes=800 * GiB,
)


def _verdicts(facts: HostFacts, gpu: bool = True) -> dict[str, str]:
    return {f.item: f.verdict for f in preflight(facts, gpu=gpu).findings}


def test_a_workstation_that_has_everything_passes() -> None:
    report = preflight(WORKSTATION)
    assert report.ok, [f for f in report.findings if f.verdict != "ok"]
    assert {f.verdict for f in report.findings} == {"ok"}
    assert "GPU kernels" in _verdicts(WORKSTATION)  # an sm89 card: its kernels are unpacked at the first start


def test_an_h100_needs_no_kernel_unpacking() -> None:
    h100 = WORKSTATION.model_copy(update={"gpus": ["NVIDIA H100 80GB HBM3 (sm90)"], "compute_caps": [(9, 0)]})
    assert "GPU kernels" not in _verdicts(h100)


@pytest.mark.parametrize(("change", "item", "fix_says"), [
    ({"glibc": (2, 34), "os_name": "Rocky Linux 9.4"}, "glibc", "Ubuntu 22.04"),
    ({"glibc": None}, "glibc", "glibc 2.35"),
    ({"python": (3, 13)}, "python", "python3.12"),
    ({"python": (3, 10)}, "python", "PYTHON=python3.12"),
    ({"machine": "aarch64"}, "architecture", "x86-64"),
    ({"driver": None, "gpus": [], "compute_caps": []}, "NVIDIA driver", "570"),
    ({"driver": "535.183.01"}, "NVIDIA driver", "570"),
    ({"gpus": [], "compute_caps": []}, "GPUs", "nvidia-smi"),
    ({"nvcc": None}, "nvcc", "cuda-toolkit-12-8"),
    ({"nvcc": (13, 0)}, "nvcc", "CUDA_HOME"),
    ({"gxx": (10, 5)}, "g++", "apt install g++"),
    ({"gxx": None}, "g++", "apt install g++"),
    ({"disk_free_bytes": 10 * GiB}, "free disk", "same filesystem"),
])
def test_each_missing_requirement_is_named_with_how_to_get_it(change: dict, item: str, fix_says: str) -> None:
    report = preflight(WORKSTATION.model_copy(update=change))
    assert not report.ok
    missing = {f.item: f for f in report.missing}
    assert item in missing, [f.item for f in report.missing]
    assert fix_says in missing[item].fix


def test_a_cpu_without_sft_kernels_warns_but_does_not_block() -> None:
    """Serving runs on avx512_base and up; KT SFT needs amx or avx512_bf16: a warning, the install goes on."""
    report = preflight(WORKSTATION.model_copy(update={"cpu_variant": "avx512_vnni"}))
    assert report.ok
    cpu = next(f for f in report.findings if f.item == "CPU")
    assert cpu.verdict == "warn" and "AVX512-BF16" in cpu.fix
    assert _verdicts(WORKSTATION.model_copy(update={"cpu_variant": "avx512_bf16"}))["CPU"] == "ok"


def test_without_a_gpu_the_gpu_side_is_skipped_not_failed() -> None:
    cpu_box = WORKSTATION.model_copy(update={"driver": None, "gpus": [], "compute_caps": [], "nvcc": None})
    verdicts = _verdicts(cpu_box, gpu=False)
    assert preflight(cpu_box, gpu=False).ok
    assert {verdicts[i] for i in ("NVIDIA driver", "GPUs", "nvcc", "g++")} == {"skipped"}


def test_the_probe_parsers() -> None:
    assert parse_nvcc_version("Cuda compilation tools, release 12.8, V12.8.93\nBuild cuda_12.8.r12.8") == (12, 8)
    assert parse_nvcc_version("nothing") is None
    driver, gpus, caps = parse_gpu_query("580.95.05, NVIDIA GeForce RTX 4090, 8.9\n580.95.05, NVIDIA H100, 9.0\n")
    assert driver == "580.95.05" and caps == [(8, 9), (9, 0)]
    assert gpus == ["NVIDIA GeForce RTX 4090 (sm89)", "NVIDIA H100 (sm90)"]
    assert parse_gpu_query("") == (None, [], [])


def test_the_smoke_check_names_a_toolchain_that_is_not_installed(tmp_path: Path) -> None:
    calls: list[str] = []

    def runner(python: str, code: str) -> tuple[int, str]:
        calls.append(code)
        return (1, "Traceback...\nModuleNotFoundError: No module named 'sglang'") if "sglang" in code else (0, "fine")

    python = tmp_path / "python"
    python.touch()
    results = run_smoke({"serve": str(python), "train": str(tmp_path / "absent")}, gpu=False, runner=runner)
    by_name = {(r.toolchain, r.name): r for r in results}
    assert by_name[("serve", "sglang's server arguments")].verdict == "missing"
    assert "No module named 'sglang'" in by_name[("serve", "sglang's server arguments")].detail
    assert by_name[("serve", "kt-kernel's extension")].verdict == "ok"
    assert all(r.verdict == "missing" and "make gpu-env" in r.detail for r in results
               if r.toolchain == "train" and r.verdict != "skipped")
    assert {r.verdict for r in results if r.name in ("torch.cuda", "sglang's GPU kernels")} == {"skipped"}
    assert len(calls) == len([p for p in smoke_probes(gpu=False) if p.toolchain == "serve"])


def test_every_smoke_probe_is_valid_python() -> None:
    for probe in smoke_probes(gpu=True):
        assert isinstance(probe, SmokeProbe)
        compile(probe.code, probe.name, "exec")


@pytest.mark.skipif(not (SERVE_PYTHON.exists() and KT_PYTHON.exists()),
                    reason="the KT toolchains are not installed (make serve-env kt-train-env)")
def test_the_installed_toolchains_pass_the_smoke_checks_cpu_parts() -> None:
    """What `make gpu-env-check` runs after the install: sglang-kt's server and kt-kernel import in the serving
    toolchain, LlamaFactory-kt's trainer and kt-kernel in the training one."""
    done = subprocess.run([str(REPO / ".venv/bin/ktflow"), "smoke-check", "--no-gpu", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"], report
    details = {r["name"]: r["detail"] for r in report["results"] if r["verdict"] == "ok"}
    assert details["sglang's server arguments"].startswith("sglang-kt 0.7.2")
    assert re.match(r"kt-kernel 0\.7\.2 build \w+", details["kt-kernel's extension"])


def test_the_preflight_command_runs_here() -> None:
    done = subprocess.run([str(REPO / ".venv/bin/ktflow"), "preflight", "--no-gpu", "--json",
                           "--python", sys.executable], cwd=REPO, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == (0 if report["ok"] else 2)
    assert {f["item"] for f in report["findings"]} >= {"glibc", "python", "CPU", "free disk", "nvcc"}
    assert report["facts"]["python"] == list(sys.version_info[:2])


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            package, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", package).lower()] = version
    return pins


def test_the_serving_lock_is_the_whole_server_not_its_parser() -> None:
    """sglang-kt with what its server imports on a GPU, and the ktransformers wheel that carries its kernels."""
    pins = _pins("serve.txt")
    for package, version in {"ktransformers": "0.7.2", "sglang-kt": "0.7.2", "kt-kernel": "0.7.2", "torch": "2.9.1",
                             "flashinfer-python": "0.6.3", "apache-tvm-ffi": "0.1.11",
                             "transformers-kt": "5.6.0.post6", "fastapi": None, "uvicorn": None}.items():
        assert package in pins, f"constraints/serve.txt lacks {package}"
        assert version is None or pins[package] == version, (package, pins[package])
    assert not (REPO / "constraints" / "sglang-nodeps.txt").exists()
    # never upstream sglang or transformers beside the KT forks: they share module names
    assert not {"sglang", "transformers", "sgl-kernel", "accelerate", "peft"} & set(pins)


@pytest.mark.parametrize("lock", ["serve.txt", "kt-train.txt"])
def test_the_kt_locks_resolve_the_same_on_python_3_12(lock: str) -> None:
    """The locks are made for CPython 3.11 (`make lock-serve`, `make lock-kt-train`); a GPU host with 3.12 must get
    the same pins. Resolved by uv from its cache (offline) where it can, else from the index."""
    uv = REPO / ".venv" / "bin" / "uv"
    packages = {"serve.txt": ["ktransformers[sglang]==0.7.2", "torch==2.9.1"],
                "kt-train.txt": ["ktransformers[sft]==0.7.2", "torch==2.9.1", "torchaudio==2.9.1"]}[lock]
    env = {**os.environ, "UV_CACHE_DIR": str(REPO / ".cache/uv"), "UV_PYTHON_DOWNLOADS": "never", "UV_NATIVE_TLS": "1"}
    argv = [str(uv), "pip", "compile", "-q", "--no-header", "--no-annotate", "--python-version", "3.12",
            "--python-platform", "x86_64-manylinux_2_35", "-c", str(REPO / "constraints" / lock), "-"]
    done = subprocess.run([*argv, "--offline"], input="\n".join(packages), capture_output=True, text=True,
                          timeout=300, env=env)
    if done.returncode != 0:
        done = subprocess.run(argv, input="\n".join(packages), capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0 and re.search(r"(?i)network|connect|dns|offline", done.stderr):
        pytest.skip(f"the package index is out of reach: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    resolved = {re.sub(r"[-_.]+", "-", p).lower(): v
                for p, v in (line.split("==", 1) for line in done.stdout.splitlines() if "==" in line)}
    assert resolved == _pins(lock)


def test_the_install_needs_at_least_what_was_measured() -> None:
    """The preflight's disk figure covers the two toolchains with their uv cache (11 GiB by `du` after installing
    both from an empty cache on the CPU box, 13 GiB once the serving toolchain's first import had unpacked its
    kernels) and the ~4 GiB of GPU kernels a GPU other than sm90 unpacks at the first start."""
    assert INSTALL_DISK_BYTES >= 17 * GiB
