"""Fault injection for every stage that writes (issue #8, Reliability): kill -9 at random points,
a full disk, a read-only target, a source changed mid-run, and two runs of one stage onto one
target at once.

After each fault: nothing is visible under the final name unless it is complete (holds
manifest.json), the error names the path and the cause, and a rerun completes with output
identical to an uninterrupted run (file list, sizes and sha256 of every file).

Full-disk and read-only targets are real filesystems: a tiny tmpfs mounted in a private mount
namespace (``unshare -rm``: works as root and, through a user namespace, as any user), then
remounted read-only or larger ("freeing space") inside the same namespace. The stage runs as its
CLI command there. To reach the mid-write path past the preflight, the stage's view of free space
is made to lie (the disk "fills up after the check"); the writes themselves hit the real ENOSPC.

Kill -9 cases that already exist elsewhere are not repeated here: dequantize at byte offsets of
its progress (test_dequantize.py, 3 seeds), quantize-int8 mid-layer (test_quantize_int8.py), SFT
mid-training (test_sft.py). Added here: convert-lora, download (fsspec URI and local reference)
and dequantize at random points of the engine's own code (publishing included).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from ktflow.errors import ArtifactBusyError, HostRequirementError, KtflowError, StorageError
from ktflow.store import MANIFEST_NAME, artifact_lock, lock_path_for, read_manifest, staging_dir_for

REPO = Path(__file__).resolve().parent.parent
SERVE_PYTHON = REPO / ".venv-serve" / "bin" / "python"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
RECIPES = REPO / "recipes"
needs_serve_env = pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="serving toolchain not installed (make serve-env)")
needs_train_env = pytest.mark.skipif(not TRAIN_PYTHON.exists(), reason="training toolchain not installed (make train-env)")
CLI = [sys.executable, "-m", "ktflow.cli"]
ENV = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------- artifact comparison


def artifact_digest(directory: Path) -> dict[str, object]:
    """What must be equal between a faulted-then-rerun artifact and an uninterrupted one: every
    file's sha256 (manifest aside) and the manifest's file list, inputs and settings."""
    directory = Path(directory)
    files = {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST_NAME}
    manifest = read_manifest(directory)
    assert manifest is not None, f"{directory} has no manifest"
    return {"files": files, "listed": [(f.path, f.size) for f in manifest.files],
            "inputs": manifest.inputs, "settings": manifest.settings, "stage": manifest.stage}


def assert_same_artifact(a: Path, b: Path, *, ignore_inputs: bool = False) -> None:
    da, db = artifact_digest(a), artifact_digest(b)
    if ignore_inputs:  # a source at another path has another identity, not other content
        for d in (da, db):
            d.pop("inputs")
            d.pop("settings")
    assert da == db


def assert_nothing_partial(parent: Path) -> None:
    """No directory under a final name without its manifest, and no staging or lock left over."""
    for d in Path(parent).iterdir():
        if d.is_dir() and not d.name.startswith("."):
            assert (d / MANIFEST_NAME).is_file(), f"{d} is visible without a manifest"
    leftovers = sorted(p.name for p in Path(parent).iterdir() if p.name.endswith((".partial", ".lock")))
    assert leftovers == []


# --------------------------------------------------------------------------- tiny inputs


def peft_adapter(base: Path, out: Path, seed: int = 0) -> Path:
    """A plain PEFT LoRA adapter (attention projections of every layer) fitting ``base``."""
    import torch
    from safetensors.torch import save_file

    from ktflow.formats.safetensors_io import read_header

    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {shard: read_header(base / shard) for shard in set(index.values())}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    modules = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
    for name, shard in sorted(index.items()):
        parts = name.split(".")
        if name.endswith(".weight") and len(parts) == 6 and parts[3] == "self_attn" and parts[4] in modules:
            rows, cols = headers[shard].tensors[name].shape
            prefix = "base_model.model." + name.removesuffix(".weight")
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, cols, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, 8, generator=gen)
    assert tensors
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": "base", "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(modules)}, indent=2))
    return out


def uri_recipe(path: Path, src: Path, store: Path) -> Path:
    doc = yaml.safe_load((RECIPES / "tiny-demo.yaml").read_text())
    doc["source"] = {"uri": src.absolute().as_uri(), "format": "kimi-k2.5-int4"}
    doc["store"] = {"root": str(store)}
    path.write_text(yaml.safe_dump(doc))
    return path


def only_weights(store: Path) -> Path:
    (found,) = [d for d in (store / "weights").iterdir() if not d.name.startswith(".")]
    return found


# --------------------------------------------------------------------------- a private tmpfs


def _userns_problem() -> str | None:
    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux) on this host"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return ("cannot mount a private tmpfs: `unshare -rm` (user + mount namespaces) failed: "
                f"{probe.stderr.strip()[:200]} (check kernel.unprivileged_userns_clone / user.max_user_namespaces)")
    return None


USERNS_PROBLEM = _userns_problem()
needs_userns = pytest.mark.skipif(USERNS_PROBLEM is not None, reason=str(USERNS_PROBLEM))

# Runs inside the namespace, with the tmpfs mounted: each step is a command, a remount or a copy
# out to the real filesystem (the tmpfs vanishes with the namespace); results go to a JSON report.
_SCENARIO = r"""
import json, os, shutil, subprocess, sys
steps, report_path = json.loads(sys.argv[1]), sys.argv[2]
report = []
for step in steps:
    if "run" in step:
        done = subprocess.run(step["run"], capture_output=True, text=True, cwd=step.get("cwd"))
        report.append({"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr})
    elif "remount" in step:
        done = subprocess.run(["mount", "-o", "remount," + step["remount"], step["at"]], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        report.append({"remounted": step["remount"]})
    elif "list" in step:
        root = step["list"]
        report.append({"listing": sorted(os.path.relpath(os.path.join(d, n), root)
                                         for d, dirs, files in os.walk(root) for n in dirs + files)})
    elif "copy" in step:
        shutil.copytree(step["copy"], step["to"])
        report.append({"copied": step["to"]})
json.dump(report, open(report_path, "w"))
"""

# The stage's CLI, with the free-space reading patched to lie, so the preflight passes and the
# writes meet the real full disk (as when another process fills it after the check).
_LYING_FREE_SPACE = r"""
import sys
import ktflow.store
ktflow.store.free_bytes = lambda path: 1 << 45  # every stage's preflight reads free space through it
from ktflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


def in_tmpfs(mount: Path, size: str, steps: list[dict], tmp_path: Path) -> list[dict]:
    """Mount a ``size`` tmpfs on ``mount`` in a private namespace, run ``steps`` there, return the report."""
    mount.mkdir(parents=True, exist_ok=True)
    report = tmp_path / f"report-{random.getrandbits(32):08x}.json"
    argv = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@"', "sh",
            size, str(mount), sys.executable, "-c", _SCENARIO, json.dumps(steps), str(report)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())


def cli(*args: str) -> dict:
    return {"run": [*CLI, *args], "cwd": str(REPO)}


def cli_full_disk(*args: str) -> dict:
    return {"run": [sys.executable, "-c", _LYING_FREE_SPACE, *args], "cwd": str(REPO)}


def fault_matrix(mount: Path, args: list[str], final_rel: str, tmp_path: Path, *, small: str) -> tuple[list[dict], Path]:
    """Read-only target, then full disk caught by the preflight, then full disk mid-write, then
    "free space" (remount larger) and rerun; the result is copied out for comparison."""
    out = tmp_path / "rerun-result"
    steps = [
        {"remount": "ro", "at": str(mount)}, cli(*args), {"list": str(mount)},
        {"remount": f"rw,size={small}", "at": str(mount)}, cli(*args), {"list": str(mount)},
        cli_full_disk(*args), {"list": str(mount)},
        {"remount": "size=256m", "at": str(mount)}, cli(*args), {"list": str(mount)},
        {"copy": str(mount / final_rel), "to": str(out)},
    ]
    return in_tmpfs(mount, small, steps, tmp_path), out


def assert_fault_matrix(report: list[dict], mount: Path, final_rel: str) -> None:
    read_only, ro_list = report[1], report[2]["listing"]
    preflight, pre_list = report[4], report[5]["listing"]
    mid_write, mid_list = report[6], report[7]["listing"]
    rerun, after = report[9], report[10]["listing"]
    # read-only: exit 2 naming the directory and the cause, nothing written
    assert read_only["rc"] == 2, read_only
    assert "Read-only file system" in read_only["stderr"] and str(mount) in read_only["stderr"], read_only["stderr"]
    assert ro_list == []
    # full disk, caught by the preflight: exit 2 with what is needed and what is free, nothing published
    assert preflight["rc"] == 2, preflight
    assert "free" in preflight["stderr"] and str(mount) in preflight["stderr"], preflight["stderr"]
    assert "needs" in preflight["stderr"], preflight["stderr"]
    # full disk mid-write: exit 1, "no space left", the path; nothing under the final name
    assert mid_write["rc"] == 1, mid_write
    assert "no space left" in mid_write["stderr"].lower() and str(mount) in mid_write["stderr"], mid_write["stderr"]
    assert "internal error" not in mid_write["stderr"]
    for listing in (pre_list, mid_list):
        assert final_rel not in listing and not any(p.startswith(final_rel + "/") for p in listing), listing
        assert not any(p.endswith(".lock") for p in listing), listing
    # after freeing space: the rerun completes and leaves nothing but the artifact
    assert rerun["rc"] == 0, rerun
    assert not any(p.endswith((".partial", ".lock")) for p in after), after


# --------------------------------------------------------------------------- kill -9 at random points

# Runs a stage in-process and SIGKILLs itself at the N-th call of a function in ktflow's code
# (any thread): a random point of the engine, publishing and journaling included. N=0 counts.
_KILL_AT_CALL = r"""
import json, os, signal, sys, threading
kill_at, stage, args = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
import ktflow
root = os.path.dirname(ktflow.__file__)
count = 0
lock = threading.Lock()
def prof(frame, event, arg):
    global count
    if event == "call" and frame.f_code.co_filename.startswith(root):
        with lock:
            count += 1
            hit = count == kill_at
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
threading.setprofile(prof)
sys.setprofile(prof)
from pathlib import Path
if stage == "dequantize":
    from ktflow.stages.dequantize import dequantize_checkpoint
    dequantize_checkpoint(args["src"], args["dst"], workers=2)
elif stage == "convert-lora":
    from ktflow.stages.convert_lora import convert_lora
    convert_lora(Path(args["adapter"]), Path(args["out"]), base_dir=Path(args["base"]), serve_python=Path(sys.executable))
elif stage == "download":
    from ktflow.stages.download import download_checkpoint
    from ktflow.recipe import SourceConfig
    download_checkpoint(SourceConfig(**args["source"]), Path(args["store"]), max_workers=2)
sys.setprofile(None)
threading.setprofile(None)
print(json.dumps({"calls": count}))
"""


def _run_killable(kill_at: int, stage: str, args: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _KILL_AT_CALL, str(kill_at), stage, json.dumps(args)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def _kill_points(stage: str, args: dict, seeds: list[int]) -> list[int]:
    counted = _run_killable(0, stage, args)
    assert counted.returncode == 0, counted.stderr[-3000:]
    calls = json.loads(counted.stdout.strip().splitlines()[-1])["calls"]
    assert calls > 20
    return [random.Random(seed).randrange(1, int(calls * 0.95)) for seed in seeds]


def _stage_case(stage: str, tmp_path: Path, fixture_dir):
    """(args of the killable run, a function that runs the stage in-process): each result's
    ``path`` is the artifact it publishes."""
    if stage == "dequantize":
        from ktflow.stages.dequantize import dequantize_checkpoint

        src, dst = fixture_dir("kimi-k2"), tmp_path / "kill" / "out"
        return {"src": str(src), "dst": str(dst)}, lambda: dequantize_checkpoint(src, dst, workers=2)
    if stage == "convert-lora":
        from ktflow.stages.convert_lora import convert_lora

        base = fixture_dir("bf16")
        adapter, out = peft_adapter(base, tmp_path / "adapter"), tmp_path / "kill" / "out"
        return ({"adapter": str(adapter), "out": str(out), "base": str(base)},
                lambda: convert_lora(adapter, out, base_dir=base, serve_python=Path(sys.executable)))
    from ktflow.recipe import SourceConfig
    from ktflow.stages.download import download_checkpoint

    src, store = tmp_path / "src", tmp_path / "kill" / "store"
    shutil.copytree(fixture_dir("kimi-k2.5"), src)
    source = {"uri": src.as_uri(), "format": "kimi-k2.5-int4"}
    return ({"source": source, "store": str(store)},
            lambda: download_checkpoint(SourceConfig(**source), store, max_workers=2))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dequantize", "convert-lora", "download"])
def test_kill_9_at_random_points_then_rerun_is_identical(stage: str, tmp_path: Path, fixture_dir) -> None:
    args, run_stage = _stage_case(stage, tmp_path, fixture_dir)
    first = run_stage().path  # uninterrupted
    parent = first.parent
    clean = tmp_path / "clean"
    shutil.copytree(first, clean)
    shutil.rmtree(tmp_path / "kill")
    points = _kill_points(stage, args, seeds=[11, 12, 13])
    killed = 0
    for point in points:
        shutil.rmtree(tmp_path / "kill")  # the previous run's (or the counting run's) output
        done = _run_killable(point, stage, args)
        assert done.returncode in (-signal.SIGKILL, 0), done.stderr[-3000:]
        killed += done.returncode == -signal.SIGKILL
        if parent.exists():
            for d in parent.iterdir():  # a reader never sees a partial artifact
                if d.is_dir() and not d.name.startswith("."):
                    assert (d / MANIFEST_NAME).is_file(), f"kill at call {point}: {d} has no manifest"
        result = run_stage()
        assert result.path == first
        assert_same_artifact(result.path, clean)
        assert_nothing_partial(parent)
    assert killed >= 2, f"only {killed} of {len(points)} runs were killed before finishing"


def test_local_reference_survives_kill_9(tmp_path: Path, fixture_dir) -> None:
    """The local reference writes only a manifest: killed anywhere, the rerun publishes the same one."""
    from ktflow.recipe import SourceConfig
    from ktflow.stages.download import download_checkpoint

    src = fixture_dir("kimi-k2")
    source = SourceConfig(local_path=src, format="kimi-k2-int4")
    clean = download_checkpoint(source, tmp_path / "clean")
    code = textwrap.dedent(f"""
        import os, signal, ktflow.store as s
        from pathlib import Path
        from ktflow.stages.download import download_checkpoint
        from ktflow.recipe import SourceConfig
        original = s.atomic_write_bytes
        def dying(path, data, fsync=True):  # killed right after the manifest is written, before the rename
            original(path, data, fsync=fsync)
            os.kill(os.getpid(), signal.SIGKILL)
        s.atomic_write_bytes = dying
        download_checkpoint(SourceConfig(local_path=Path({str(src)!r}), format="kimi-k2-int4"),
                            Path({str(tmp_path / 'k')!r}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert [p.name for p in (tmp_path / "k" / "weights").iterdir() if not p.name.startswith(".")] == []
    again = download_checkpoint(source, tmp_path / "k")
    assert not again.cached and again.manifest_digest == clean.manifest_digest
    assert_nothing_partial(tmp_path / "k" / "weights")


# --------------------------------------------------------------------------- full disk and read-only target


@needs_userns
@pytest.mark.slow
def test_dequantize_full_disk_and_read_only_target(tmp_path: Path, fixture_dir) -> None:
    from ktflow.stages.dequantize import dequantize_checkpoint

    src = fixture_dir("kimi-k2.5")
    clean = dequantize_checkpoint(src, tmp_path / "clean", workers=2).path
    mount = tmp_path / "mnt"
    report, out = fault_matrix(mount, ["dequantize", str(src), str(mount / "out"), "--workers", "2"], "out",
                               tmp_path, small="3m")
    assert_fault_matrix(report, mount, "out")
    assert "the BF16 output needs" in report[4]["stderr"]
    # mid-write: the shards finished before the disk filled are kept for the rerun, the partial one is not
    assert any(p.startswith(".out.partial/") for p in report[7]["listing"])
    assert not any(p.endswith(".tmp") for p in report[7]["listing"])
    assert_same_artifact(out, clean)


@needs_userns
@pytest.mark.slow
def test_download_full_disk_and_read_only_store(tmp_path: Path, fixture_dir) -> None:
    from ktflow.recipe import SourceConfig
    from ktflow.stages.download import download_checkpoint

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("kimi-k2.5"), src)
    clean = download_checkpoint(SourceConfig(uri=src.as_uri(), format="kimi-k2.5-int4"), tmp_path / "clean").path
    mount = tmp_path / "mnt"
    recipe = uri_recipe(tmp_path / "recipe.yaml", src, mount / "store")
    report, out = fault_matrix(mount, ["download", str(recipe)], f"store/weights/{clean.name}", tmp_path, small="2m")
    # read-only: the store root itself cannot be created
    assert report[1]["rc"] == 2 and "Read-only file system" in report[1]["stderr"], report[1]
    report[2]["listing"] = []
    assert_fault_matrix(report, mount, f"store/weights/{clean.name}")
    assert "the download still needs" in report[4]["stderr"]
    assert_same_artifact(out, clean)


@needs_userns
@pytest.mark.slow
def test_convert_lora_full_disk_and_read_only_target(tmp_path: Path, fixture_dir) -> None:
    from ktflow.stages.convert_lora import convert_lora

    base = fixture_dir("bf16")
    adapter = peft_adapter(base, tmp_path / "adapter", seed=1)
    clean = convert_lora(adapter, tmp_path / "clean", base_dir=base, serve_python=Path(sys.executable)).path
    size = (adapter / "adapter_model.safetensors").stat().st_size
    mount = tmp_path / "mnt"
    small = f"{size // 1024 // 2}k"  # half the adapter
    report, out = fault_matrix(mount, ["convert-lora", str(adapter), str(mount / "out"), "--base", str(base)], "out",
                               tmp_path, small=small)
    assert_fault_matrix(report, mount, "out")
    assert "the converted adapter needs" in report[4]["stderr"]
    assert not any(p.startswith(".out.partial") for p in report[7]["listing"])  # convert-lora keeps no staging
    assert f"writing {mount / '.out.partial' / 'adapter_model.safetensors'} for {mount / 'out'}" in report[6]["stderr"]
    assert_same_artifact(out, clean)


@needs_userns
@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_quantize_int8_full_disk_and_read_only_target(tmp_path: Path, fixture_dir) -> None:
    from ktflow.stages.quantize_int8 import quantize_int8

    src = fixture_dir("bf16")
    clean = quantize_int8(src, tmp_path / "clean", threadpool_count=1, serve_python=SERVE_PYTHON, workers=2).path
    mount = tmp_path / "mnt"
    args = ["quantize-int8", str(src), str(mount / "out"), "--threadpool-count", "1", "--workers", "2",
            "--serve-python", str(SERVE_PYTHON)]
    report, out = fault_matrix(mount, args, "out", tmp_path, small="2m")
    assert_fault_matrix(report, mount, "out")
    assert "the output needs" in report[4]["stderr"]
    assert_same_artifact(out, clean)


_SFT_PREFLIGHT = r"""
import sys
from pathlib import Path
from ktflow.demo import write_demo_dataset
from ktflow.errors import HostRequirementError
from ktflow.host.hardware import probe_host
from ktflow.recipe import load_recipe
from ktflow.stages.sft import run_sft
root, model, store, python, recipe_file = (Path(a) for a in sys.argv[1:6])
if not (root / "data" / "train.jsonl").exists():
    write_demo_dataset(root / "data")
recipe = load_recipe(recipe_file, [
    f"source.local_path={model}", "source.format=bf16", f"dataset.files=[{root / 'data' / 'train.jsonl'}]",
    f"evaluation.files=[{root / 'data' / 'eval.jsonl'}]", f"store.root={store}", f"toolchains.train.python={python}"])
try:
    run_sft(recipe, model_dir=model, host=probe_host(store))
except HostRequirementError as exc:
    print("REFUSED", exc)
else:
    print("TRAINED")
"""


@needs_userns
@needs_train_env
def test_sft_refuses_a_read_only_or_full_store_before_launching(tmp_path: Path, fixture_dir) -> None:
    """SFT's own kill -9 test covers crashes; here its preflight: nothing is launched or written."""
    mount = tmp_path / "mnt"
    run = {"run": [sys.executable, "-c", _SFT_PREFLIGHT, str(tmp_path), str(fixture_dir("bf16")), str(mount / "store"),
                   str(TRAIN_PYTHON), str(RECIPES / "tiny-demo.yaml")], "cwd": str(REPO)}
    report = in_tmpfs(mount, "4g", [{"remount": "ro", "at": str(mount)}, run, {"list": str(mount)},
                                    {"remount": "rw,size=2m", "at": str(mount)}, run, {"list": str(mount)}], tmp_path)
    ro, full = report[1], report[4]
    assert ro["rc"] == 0 and "REFUSED" in ro["stdout"] and "Read-only file system" in ro["stdout"], ro
    assert str(mount / "store") in ro["stdout"]
    assert report[2]["listing"] == []
    assert full["rc"] == 0 and "REFUSED" in full["stdout"] and "sft's checkpoints needs" in full["stdout"], full
    assert str(mount / "store") in full["stdout"] and "free disk at the store" in full["stdout"], full
    assert report[5]["listing"] == []


def test_mid_write_storage_error_is_translated(tmp_path: Path) -> None:
    """The translation itself, without a namespace: ENOSPC and EROFS name the path; others pass."""
    import errno

    from ktflow.store import storage_errors

    final = tmp_path / "out"
    with pytest.raises(StorageError, match="no space left on the device while writing .*x.bin") as info:
        with storage_errors(final, need=10 << 20):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x.bin"))
    assert info.value.exit_code == 1 and "10.0 MiB" in str(info.value) and str(final) in str(info.value)
    with pytest.raises(StorageError, match="Read-only file system"):
        with storage_errors(final):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    with pytest.raises(FileNotFoundError):
        with storage_errors(final):
            raise FileNotFoundError(errno.ENOENT, "gone")


# --------------------------------------------------------------------------- a source changed mid-run


def test_dequantize_source_changed_after_its_shard_was_done_is_refused(tmp_path: Path, fixture_dir) -> None:
    """A shard rewritten after its own output shard passed the per-shard check (here: after the
    last tensor) still fails the stage: Kimi-K2.5 keeps scales in other shards than their weights,
    so any source change can mix versions."""
    from ktflow.stages.dequantize import dequantize_checkpoint

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("kimi-k2.5"), src)
    clean = dequantize_checkpoint(src, tmp_path / "clean", workers=2).path
    out = tmp_path / "o" / "out"
    victim = sorted(src.glob("model-*.safetensors"))[0]

    def touch_at_the_end(done: int, total: int) -> None:
        if done == total:
            os.utime(victim, ns=(time.time_ns(), time.time_ns() + 10**9))

    with pytest.raises(KtflowError, match="changed while"):
        dequantize_checkpoint(src, out, workers=2, progress=touch_at_the_end)
    assert not out.exists()
    result = dequantize_checkpoint(src, out, workers=2)
    assert not result.cached
    assert_same_artifact(out, clean, ignore_inputs=True)
    assert_nothing_partial(tmp_path / "o")


def test_convert_lora_adapter_changed_mid_run_is_refused(tmp_path: Path, fixture_dir, monkeypatch) -> None:
    import ktflow.stages.convert_lora as cl

    base = fixture_dir("bf16")
    adapter = peft_adapter(base, tmp_path / "adapter", seed=2)
    clean = cl.convert_lora(adapter, tmp_path / "clean", base_dir=base, serve_python=Path(sys.executable)).path
    original = cl._publish_peft

    def rewritten_meanwhile(adapter_dir, staging, base_dir, lora_alpha):
        original(adapter_dir, staging, base_dir, lora_alpha)
        model = adapter_dir / "adapter_model.safetensors"
        model.write_bytes(model.read_bytes())  # same bytes, a new write: the trainer saved again

    monkeypatch.setattr(cl, "_publish_peft", rewritten_meanwhile)
    out = tmp_path / "o" / "out"
    with pytest.raises(KtflowError, match="changed while being converted"):
        cl.convert_lora(adapter, out, base_dir=base, serve_python=Path(sys.executable))
    assert not out.exists()
    monkeypatch.setattr(cl, "_publish_peft", original)
    result = cl.convert_lora(adapter, out, base_dir=base, serve_python=Path(sys.executable))
    assert not result.cached
    assert_same_artifact(out, clean)
    assert_nothing_partial(tmp_path / "o")


def test_download_uri_source_changed_mid_copy_is_refused(tmp_path: Path, fixture_dir, monkeypatch) -> None:
    import ktflow.stages.download as dl
    import ktflow.stages.download.uri as dl_uri
    from ktflow.errors import DownloadError
    from ktflow.recipe import SourceConfig

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("kimi-k2.5"), src)
    source = SourceConfig(uri=src.as_uri(), format="kimi-k2.5-int4")
    original = dl_uri._copy_resumable
    calls = []

    def source_rewritten(fs, remote, dest, size):
        digest = original(fs, remote, dest, size)
        if not calls:  # after the first file: another writer replaces a file of the same size
            calls.append(remote)
            victim = src / "config.json"
            victim.write_bytes(victim.read_bytes())
            os.utime(victim, ns=(time.time_ns(), time.time_ns() + 10**9))
        return digest

    monkeypatch.setattr(dl_uri, "_copy_resumable", source_rewritten)
    store = tmp_path / "store"
    with pytest.raises(DownloadError, match="changed while being copied"):
        dl.download_checkpoint(source, store, max_workers=1)
    assert not store.exists() or list(store.rglob("*")) == []  # no artifact, no staging of a dead version
    monkeypatch.setattr(dl_uri, "_copy_resumable", original)
    result = dl.download_checkpoint(source, store, max_workers=2)
    clean = dl.download_checkpoint(source, tmp_path / "clean").path
    assert_same_artifact(result.path, clean)
    assert_nothing_partial(store / "weights")


def test_download_local_source_changed_while_identified_is_refused(tmp_path: Path, fixture_dir, monkeypatch) -> None:
    import ktflow.stages.download as dl
    import ktflow.stages.download.local as dl_local
    from ktflow.errors import DownloadError
    from ktflow.recipe import SourceConfig

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("kimi-k2"), src)
    source = SourceConfig(local_path=src, format="kimi-k2-int4")
    original = dl_local._sampled_hash

    def rewritten(path: Path, size: int) -> str:
        digest = original(path, size)
        if path.name == "config.json":
            os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        return digest

    monkeypatch.setattr(dl_local, "_sampled_hash", rewritten)
    with pytest.raises(DownloadError, match="changed while the checkpoint was being identified"):
        dl.download_checkpoint(source, tmp_path / "store", max_workers=1)
    monkeypatch.setattr(dl_local, "_sampled_hash", original)
    first = dl.download_checkpoint(source, tmp_path / "store")
    again = dl.download_checkpoint(source, tmp_path / "store")
    assert not first.cached and again.cached and again.manifest_digest == first.manifest_digest
    assert_nothing_partial(tmp_path / "store" / "weights")


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_quantize_int8_source_changed_mid_run_is_refused(tmp_path: Path, fixture_dir) -> None:
    from ktflow.stages.quantize_int8 import quantize_int8

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("bf16"), src)
    victim = sorted(src.glob("model-*.safetensors"))[-1]

    def touch_after_first_layer(done: int, total: int) -> None:
        if done == 1:
            os.utime(victim, ns=(time.time_ns(), time.time_ns() + 10**9))

    out = tmp_path / "o" / "out"
    with pytest.raises(KtflowError, match="changed while it was being quantized"):
        quantize_int8(src, out, threadpool_count=1, serve_python=SERVE_PYTHON, workers=2,
                      progress=touch_after_first_layer)
    assert not out.exists()
    result = quantize_int8(src, out, threadpool_count=1, serve_python=SERVE_PYTHON, workers=2)
    assert not result.cached and result.layers_reused == 0  # the old version's layers were discarded
    clean = quantize_int8(fixture_dir("bf16"), tmp_path / "clean", threadpool_count=1, serve_python=SERVE_PYTHON,
                          workers=2).path
    assert_same_artifact(out, clean, ignore_inputs=True)
    assert_nothing_partial(tmp_path / "o")


# --------------------------------------------------------------------------- two runs at once

# One stage run, slowed down so a second process arrives while the first holds the lock; prints
# whether it was a cache hit. The stage code is unchanged; only a progress/copy step sleeps.
_SLOW_RUN = r"""
import json, sys, time
from pathlib import Path
stage, args = sys.argv[1], json.loads(sys.argv[2])
if stage == "dequantize":
    from ktflow.stages.dequantize import dequantize_checkpoint
    r = dequantize_checkpoint(args["src"], args["dst"], workers=1, progress=lambda d, t: time.sleep(0.05))
elif stage == "convert-lora":
    import ktflow.stages.convert_lora as cl
    original = cl._publish_peft
    cl._publish_peft = lambda *a: (time.sleep(3), original(*a))
    r = cl.convert_lora(Path(args["adapter"]), Path(args["out"]), base_dir=Path(args["base"]),
                        serve_python=Path(sys.executable))
elif stage == "download":
    import ktflow.stages.download as dl
    import ktflow.stages.download.uri as dl_uri
    from ktflow.recipe import SourceConfig
    original = dl_uri._copy_resumable
    dl_uri._copy_resumable = lambda *a: (time.sleep(0.3), original(*a))[1]
    r = dl.download_checkpoint(SourceConfig(**args["source"]), Path(args["store"]), max_workers=1)
elif stage == "quantize-int8":
    from ktflow.stages.quantize_int8 import quantize_int8
    r = quantize_int8(Path(args["src"]), Path(args["dst"]), threadpool_count=1, serve_python=Path(args["python"]),
                      workers=1, progress=lambda d, t: time.sleep(1))
print("RESULT " + json.dumps({"cached": r.cached, "path": str(r.path)}))
"""


def _two_at_once(stage: str, args: dict) -> list[tuple[dict, str]]:
    procs = [subprocess.Popen([sys.executable, "-c", _SLOW_RUN, stage, json.dumps(args)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
        results.append((json.loads(line[len("RESULT "):]), stderr))
    return results


def _assert_one_worker(results: list[tuple[dict, str]]) -> None:
    assert sorted(r["cached"] for r, _ in results) == [False, True]  # exactly one did the work
    waited = [stderr for r, stderr in results if "waiting for" in stderr]
    assert len(waited) == 1 and "pid " in waited[0], [s[-500:] for _, s in results]
    assert [r for r, stderr in results if "waiting for" in stderr][0]["cached"]  # the waiter reused it
    assert results[0][0]["path"] == results[1][0]["path"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dequantize", "convert-lora", "download"])
def test_two_runs_onto_one_target_do_the_work_once(stage: str, tmp_path: Path, fixture_dir) -> None:
    if stage == "dequantize":
        from ktflow.stages.dequantize import dequantize_checkpoint

        src = fixture_dir("kimi-k2")
        clean = dequantize_checkpoint(src, tmp_path / "clean", workers=2).path
        args = {"src": str(src), "dst": str(tmp_path / "both" / "out")}
    elif stage == "convert-lora":
        from ktflow.stages.convert_lora import convert_lora

        base = fixture_dir("bf16")
        adapter = peft_adapter(base, tmp_path / "adapter", seed=3)
        clean = convert_lora(adapter, tmp_path / "clean", base_dir=base, serve_python=Path(sys.executable)).path
        args = {"adapter": str(adapter), "out": str(tmp_path / "both" / "out"), "base": str(base)}
    else:
        from ktflow.recipe import SourceConfig
        from ktflow.stages.download import download_checkpoint

        src = tmp_path / "src"
        shutil.copytree(fixture_dir("kimi-k2"), src)
        source = {"uri": src.as_uri(), "format": "kimi-k2-int4"}
        clean = download_checkpoint(SourceConfig(**source), tmp_path / "clean").path
        args = {"source": source, "store": str(tmp_path / "both")}
    results = _two_at_once(stage, args)
    _assert_one_worker(results)
    assert_same_artifact(Path(results[0][0]["path"]), clean)
    assert_nothing_partial(Path(results[0][0]["path"]).parent)


@needs_serve_env
@pytest.mark.int8_kernels
@pytest.mark.slow
def test_two_quantize_int8_runs_onto_one_target_do_the_work_once(tmp_path: Path, fixture_dir) -> None:
    from ktflow.stages.quantize_int8 import quantize_int8

    src = fixture_dir("bf16")
    clean = quantize_int8(src, tmp_path / "clean", threadpool_count=1, serve_python=SERVE_PYTHON, workers=2).path
    results = _two_at_once("quantize-int8", {"src": str(src), "dst": str(tmp_path / "both" / "out"),
                                             "python": str(SERVE_PYTHON)})
    _assert_one_worker(results)
    assert_same_artifact(tmp_path / "both" / "out", clean)
    assert_nothing_partial(tmp_path / "both")


# --------------------------------------------------------------------------- the lock itself

_HOLD = r"""
import sys, time
from pathlib import Path
from ktflow.store import artifact_lock
with artifact_lock(Path(sys.argv[1])):
    print("HELD", flush=True)
    if sys.argv[2] == "die":
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(sys.argv[2]))
"""


def _holder(final: Path, how: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(final), how], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if how != "die":
        assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
    return proc


def test_lock_fail_fast_names_the_holder(tmp_path: Path) -> None:
    final = tmp_path / "art"
    holder = _holder(final, "30")
    try:
        with pytest.raises(ArtifactBusyError, match=f"pid {holder.pid} on "):
            with artifact_lock(final, wait=False):
                pass
        waits: list[str] = []
        started = time.monotonic()
        holder.terminate()  # the waiter goes on as soon as the holder is gone
        with artifact_lock(final, on_wait=waits.append):
            pass
        assert time.monotonic() - started < 20
    finally:
        holder.kill()
        holder.wait()
    assert not lock_path_for(final).exists()


def test_lock_of_a_killed_holder_is_free_at_once(tmp_path: Path) -> None:
    final = tmp_path / "art"
    holder = _holder(final, "die")
    holder.wait()
    assert holder.returncode == -signal.SIGKILL
    assert lock_path_for(final).exists()  # the file stays, the lock does not
    waits: list[str] = []
    with artifact_lock(final, wait=True, on_wait=waits.append):
        assert json.loads(lock_path_for(final).read_text())["pid"] == os.getpid()
    assert waits == []


def test_lock_waiter_names_whom_it_waits_for(tmp_path: Path) -> None:
    final = tmp_path / "art"
    holder = _holder(final, "1.5")
    waits: list[str] = []
    started = time.monotonic()
    try:
        with artifact_lock(final, on_wait=waits.append):
            assert time.monotonic() - started > 1.0  # only once the holder left
    finally:
        holder.wait()
    assert len(waits) == 1 and f"pid {holder.pid}" in waits[0] and str(final) in waits[0]


def test_lock_on_a_read_only_directory_is_a_host_error_unless_published(tmp_path: Path, monkeypatch) -> None:
    import errno

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / ".art.lock"))

    final = tmp_path / "art"
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(HostRequirementError, match="Read-only file system") as info:
        with artifact_lock(final):
            pass
    assert str(tmp_path) in str(info.value) and info.value.exit_code == 2
    monkeypatch.undo()
    final.mkdir()
    (final / MANIFEST_NAME).write_text(json.dumps({"stage": "x"}))
    monkeypatch.setattr(os, "open", refuse)
    with artifact_lock(final):  # published: a cache hit needs no lock, so reading goes on
        pass
    monkeypatch.undo()
    assert staging_dir_for(final).exists() is False
