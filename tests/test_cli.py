"""The `ktflow` command line as users and outside checks call it: exit codes, JSON, stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ktflow.host.hardware import detect_cpu_variant, probe_host

REPO = Path(__file__).resolve().parent.parent


def ktflow(*args: str, cwd: Path = REPO, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ktflow.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**(os.environ if env is None else env), "COLUMNS": "200"},
    )


def test_doctor_json_reports_this_host() -> None:
    result = ktflow("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("cpu_variant", "physical_cores", "numa_nodes", "ram_bytes", "gpus", "disk_free_bytes"):
        assert key in report
    with open(os.environ.get("KTFLOW_CPUINFO") or "/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert report["cpu_variant"] == detect_cpu_variant(flags)
    assert report["ram_bytes"] == probe_host().ram_bytes
    assert 0 < report["physical_cores"] <= os.cpu_count()
    assert all({"name", "vram_bytes"} <= set(g) for g in report["gpus"])


def test_doctor_with_recipe_lists_stages_and_fails_when_host_cannot_run_it() -> None:
    result = ktflow("doctor", "--recipe", "recipes/kimi-k2.5-rawint4.yaml", "--json")
    report = json.loads(result.stdout)
    stages = {s["stage"]: s for s in report["stages"]}
    enough_gpus = len(report["gpus"]) >= 1  # the recipe trains on one GPU
    assert stages["sft"]["runnable"] is enough_gpus
    assert result.returncode == (0 if enough_gpus and report["cpu_variant"] in ("amx", "avx512_bf16") else 2)
    if not enough_gpus:
        assert f"sft needs 1 GPU(s); this host has {len(report['gpus'])}" in stages["sft"]["missing"]


def test_doctor_table_for_the_demo_recipe() -> None:
    result = ktflow("doctor", "--recipe", "recipes/tiny-demo.yaml")
    assert result.returncode == 0, result.stderr
    assert "kt-kernel variant" in result.stdout and "quantize-int8" in result.stdout


@pytest.mark.parametrize(("cpuinfo", "variant", "int8_runs"), [
    ("epyc_avx2_only.txt", "avx2", False),
    ("xeon_6248_2s2c2t.txt", "", True),  # Cascade Lake: avx512_vnni
])
def test_doctor_says_before_the_run_whether_the_demo_quantizes_to_int8_here(cpuinfo: str, variant: str,
                                                                            int8_runs: bool) -> None:
    # Any CPU, on every CPU: the probe reads a stand-in cpuinfo (and kt-kernel's variant follows it).
    env = {**os.environ, "KTFLOW_CPUINFO": str(REPO / "tests/data/cpuinfo" / cpuinfo), "KT_KERNEL_CPU_VARIANT": variant}
    result = ktflow("doctor", "--recipe", "recipes/tiny-demo.yaml", "--json", env=env)
    assert result.returncode == 0, result.stderr  # the demo runs on both
    [int8] = [s for s in json.loads(result.stdout)["stages"] if s["stage"] == "quantize-int8"]
    assert int8["needed"] is int8_runs and int8["runnable"], int8
    if not int8_runs:
        for says in ("skipped on this host", "needs a avx512_base CPU or better", "AMD EPYC (AVX2 only), kt-kernel "
                     "variant avx2", "pool avx512-serve"):
            assert says in int8["reason"], (says, int8["reason"])


def test_invalid_recipe_exits_2_naming_the_field() -> None:
    result = ktflow("sft", "recipes/kimi-k2.5-rawint4.yaml", "--set", "sft.lora_rank=16")
    assert result.returncode == 2
    assert "sft.lora_rank: RAWINT4 SFT requires 8 (got 16)" in result.stderr
    assert result.stdout == ""


def test_bad_arguments_exit_2() -> None:
    assert ktflow("fixture", "gguf", "/tmp/x").returncode == 2
    assert ktflow("quantize-int8", "a", "b", "--threadpool-count", "0").returncode == 2
    assert ktflow("nonsense").returncode == 2


def test_fixture_then_inspect_json(tmp_path: Path) -> None:
    out = tmp_path / "k25"
    made = ktflow("fixture", "kimi-k2.5", str(out), "--layers", "3", "--experts", "4", "--seed", "3")
    assert made.returncode == 0, made.stderr
    result = ktflow("inspect", str(out), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["format"] == "kimi-k2.5-int4"
    assert info["num_routed_experts"] == 4 and info["num_layers"] == 3


def test_fixture_rejects_misaligned_sizes(tmp_path: Path) -> None:
    result = ktflow("fixture", "bf16", str(tmp_path / "x"), "--hidden", "96")
    assert result.returncode == 2
    assert "--hidden" in result.stderr
    assert not (tmp_path / "x").exists()


def test_inspect_rejects_a_missing_shard(tmp_path: Path) -> None:
    out = tmp_path / "k2"
    assert ktflow("fixture", "kimi-k2", str(out)).returncode == 0
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    result = ktflow("inspect", str(out))
    assert result.returncode == 2
    assert shard.name in result.stderr


def test_inspect_rejects_a_directory_without_config(tmp_path: Path) -> None:
    result = ktflow("inspect", str(tmp_path))
    assert result.returncode == 2
    assert "config.json" in result.stderr


def test_download_of_a_local_source_publishes_a_reference(fixture_dir, tmp_path: Path) -> None:
    src = fixture_dir("kimi-k2.5")
    result = ktflow(
        "download", "recipes/tiny-demo.yaml", "--set", f"source.local_path={src}", "--set", f"store.root={tmp_path}"
    )
    assert result.returncode == 0, result.stderr
    assert "revision local-" in result.stdout
    manifests = list((tmp_path / "weights").glob("local-*/manifest.json"))
    assert len(manifests) == 1
    assert json.loads(manifests[0].read_text())["extra"]["source_path"] == str(src)


SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"


@pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="serving toolchain not installed (make serve-env)")
def test_doctor_variant_is_the_one_kt_kernel_itself_picks() -> None:
    # This machine's own CPU, as both see it: no override, no stand-in cpuinfo.
    env = {k: v for k, v in os.environ.items() if k not in ("KT_KERNEL_CPU_VARIANT", "KTFLOW_CPUINFO")}
    report = json.loads(ktflow("doctor", "--json", env=env).stdout)
    done = subprocess.run([str(SERVE_PYTHON), "-c", "import kt_kernel; print(kt_kernel.__cpu_variant__)"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["cpu_variant"] == done.stdout.strip().splitlines()[-1]


def test_serve_dry_run_json_for_int8_weights_names_their_threadpool_count() -> None:
    result = ktflow("serve", "recipes/kimi-k2.5-bf16-int8.yaml", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["int8_threadpool_count"] == 2
    argv = doc["argv"]
    assert argv[argv.index("--kt-method") + 1] == "AMXINT8"
    assert argv[argv.index("--kt-threadpool-count") + 1] == "2"
    assert "--api-key" not in argv  # the key never travels on a command line


def test_serve_dry_run_json_native_method_has_no_int8_count() -> None:
    doc = json.loads(ktflow("serve", "recipes/kimi-k2.5-rawint4.yaml", "--dry-run", "--json").stdout)
    assert "int8_threadpool_count" not in doc
    assert doc["argv"][doc["argv"].index("--kt-method") + 1] == "RAWINT4"


def test_make_from_another_directory_runs_in_the_checkout(tmp_path: Path) -> None:
    # `make -f <checkout>/Makefile demo` from anywhere: make re-runs itself in the checkout (dry run here).
    done = subprocess.run(["make", "-n", "-f", str(REPO / "Makefile"), "demo"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"-C {REPO} demo" in done.stdout and ".venv/bin/ktflow demo" in done.stdout, done.stdout
    assert not any(tmp_path.iterdir())


def test_demo_finds_its_checkout_from_any_directory(tmp_path: Path) -> None:
    from ktflow.cli import _demo_checkout

    here = Path.cwd()
    try:
        os.chdir(tmp_path)
        assert _demo_checkout() == REPO  # the checkout ktflow runs from
    finally:
        os.chdir(here)


def test_fixture_kinds_in_the_cli_are_the_fixture_module_kinds() -> None:
    from ktflow.cli import FIXTURE_KINDS as CLI_KINDS
    from ktflow.fixtures.checkpoints import FIXTURE_KINDS

    assert CLI_KINDS == FIXTURE_KINDS


def test_deepseek_v2_lite_fixture_then_inspect(tmp_path: Path) -> None:
    out = tmp_path / "v2"
    made = ktflow("fixture", "deepseek-v2-lite", str(out), "--layers", "3")
    assert made.returncode == 0, made.stderr
    info = json.loads(ktflow("inspect", str(out), "--json").stdout)
    assert info["format"] == "bf16" and info["num_layers"] == 3 and info["num_routed_experts"] == 8
    refused = ktflow("fixture", "deepseek-v2-lite", str(tmp_path / "x"), "--full-size", "--experts", "4")
    assert refused.returncode == 2 and "--experts 4" in refused.stderr
    assert not (tmp_path / "x").exists()


def test_sft_refuses_the_kt_backend_on_deepseek_v2_before_anything_runs(fixture_dir, tmp_path: Path) -> None:
    """kt-kernel 0.7.2 stops at the first step on DeepseekV2 (seen on the GPU host); ktflow says so up front."""
    model = fixture_dir("deepseek-v2-lite", layers=4)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello nya~"}]}) + "\n")
    store = tmp_path / "store"
    result = ktflow("sft", str(REPO / "benchmarks/recipes/v2-lite-kt.yaml"), "--set", f"source.local_path={model}",
                    "--set", f"dataset.files=[{data}]", "--set", f"store.root={store}")
    assert result.returncode == 2, result.stderr
    assert "model_type deepseek_v2 with sft.backend kt" in result.stderr
    dry = ktflow("sft", str(REPO / "benchmarks/recipes/v2-lite-kt.yaml"), "--dry-run", "--json", "--set",
                 f"source.local_path={model}", "--set", f"dataset.files=[{data}]", "--set", f"store.root={store}")
    assert dry.returncode == 0 and "would refuse" in dry.stderr and json.loads(dry.stdout)["launch"]
    assert "kt-legacy" in result.stderr and "Traceback" not in result.stderr
    assert not (store / "runs").exists()


def test_a_promotion_in_a_toolchain_without_prefect_stands_and_says_nothing_was_announced(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`ktflow promote` / `rollback` run in the GPU host's serving toolchain, which has no Prefect: the move is
    done when the event would be emitted, so a missing Prefect must not fail the command (it did, on the host:
    "No module named 'prefect'" after the server was up); with PREFECT_API_URL set, it says the event was not sent."""
    from ktflow.cli.serving import _announce
    from ktflow.stages.promotion import MoveResult

    moved = MoveResult(version=2, replaced=1, moved=True)
    monkeypatch.setitem(sys.modules, "prefect.settings", None)  # import prefect.settings -> ImportError
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    _announce(None, moved, "ktflow promote")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    _announce(None, moved, "ktflow promote")
    assert "ktflow.adapter.promoted was not emitted" in capsys.readouterr().err
