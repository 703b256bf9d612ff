"""The three toolchain environments as `make` installs them.

They must share one torch stack: it is what makes them importable together with kt-kernel's pin
(torch 2.9.1), and what lets the installer store the ~6.5 GB of CUDA libraries once (uv hardlinks
them from its cache) instead of once per environment. Each training toolchain must also be able to
import LlamaFactory's trainer, which a torch/torchaudio mismatch breaks before any step runs.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = {"train": "train.txt", "serve": "serve.txt", "kt-train": "kt-train.txt"}
# The packages that make up the shared stack: torch, its companions and its CUDA libraries.
_STACK = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-[a-z0-9-]+)$")


def _normalize(package: str) -> str:
    return re.sub(r"[-_.]+", "-", package).lower()  # PEP 503


def _pins(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            package, version = line.split("==", 1)
            pins[_normalize(package)] = version
    return pins


def test_toolchains_pin_one_torch_stack() -> None:
    stacks = {env: {p: v for p, v in _pins(f).items() if _STACK.match(p)} for env, f in CONSTRAINTS.items()}
    for env, stack in stacks.items():
        assert stack.get("torch") == "2.9.1", f"constraints/{CONSTRAINTS[env]} pins torch {stack.get('torch')}"
    versions: dict[str, dict[str, str]] = {}
    for env, stack in stacks.items():
        for package, version in stack.items():
            versions.setdefault(package, {})[env] = version
    split = {p: by_env for p, by_env in versions.items() if len(set(by_env.values())) > 1}
    assert not split, f"toolchains pin different versions of the shared torch stack: {split}"


def test_pyproject_extras_agree_with_the_constraints() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for env, constraints in CONSTRAINTS.items():
        pins = _pins(constraints)
        for requirement in extras[env]:
            package, _, version = requirement.partition("==")
            pinned = pins.get(_normalize(re.sub(r"\[.*\]", "", package)))
            assert pinned == version, f"pyproject [{env}] says {requirement}, constraints/{constraints} pins {pinned}"


@pytest.mark.parametrize("venv", [".venv-train", ".venv-kt-train"])
def test_training_toolchain_imports_the_trainer(venv: str) -> None:
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{venv} not installed (make test installs it)")
    # What `llamafactory-cli train` imports first: with a torchaudio built for another torch this
    # fails with "Could not load this library: .../_torchaudio.abi3.so".
    result = subprocess.run([str(python), "-c", "import llamafactory.train.tuner, torch, torchaudio; "
                             "print(torch.__version__, torchaudio.__version__)"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    torch_version, torchaudio_version = result.stdout.split()
    assert torch_version.split("+")[0] == torchaudio_version.split("+")[0] == "2.9.1"


def test_toolchains_store_the_torch_stack_once() -> None:
    libs = [next((REPO / v).glob("lib/python3.*/site-packages/torch/lib/libtorch_cpu.so"), REPO / v)
            for v in (".venv-train", ".venv-serve", ".venv-kt-train")]
    missing = [str(lib) for lib in libs if lib.name != "libtorch_cpu.so"]
    if missing:
        pytest.skip(f"toolchains not installed: {missing}")
    stats = [os.stat(lib) for lib in libs]
    if len({s.st_dev for s in stats}) > 1:
        pytest.skip("toolchains live on different filesystems: hardlinks are impossible")
    inodes = {s.st_ino for s in stats}
    assert len(inodes) == 1, (
        "the toolchains hold separate copies of torch (installed by an older Makefile, or with "
        "UV_LINK_MODE changed): `make clean-env && make test` reinstalls them sharing one copy")
