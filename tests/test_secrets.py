"""Secrets and exposure: nothing secret committed, endpoints loopback and keyed, no shell, no path
escapes from recipes or adapters, and the hub token never written anywhere.

(The whole-pipeline grep for the API key and token is in the pipeline tests; these are the static
and per-component parts.)
"""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hubserver import FakeHub, FakeRepo

from ktflow.errors import AdapterError, HostRequirementError, InvalidInputError, RecipeError
from ktflow.formats.adapter import validate_adapter
from ktflow.recipe import ServingConfig, load_recipe, recipe_from_mapping
from ktflow.stages.convert_lora import convert_lora
from ktflow.stages.serve import API_KEY_FILE, render_llamafactory_api, resolve_api_key
from ktflow.stages.serve.sglang.launch import is_loopback

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
TINY = yaml.safe_load((RECIPES / "tiny-demo.yaml").read_text())

# --------------------------------------------------------------------------- (a) committed secrets

SECRET_PATTERNS = {
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "OpenAI-style key": re.compile(r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),
    "private key": re.compile(r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----"),
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "AWS secret key": re.compile(r"aws_secret_access_key\s*[=:]\s*['\"]?[A-Za-z0-9/+]{40}"),
    "GitHub token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{40,})"),
    "Slack token": re.compile(r"\bxox[abprs]-[0-9A-Za-z-]{10,}"),
}
# A match containing one of these is a test sentinel by convention (AWS's docs use ...EXAMPLE).
PLACEHOLDER_MARKERS = ("SENTINEL", "EXAMPLE", "FAKE")


def find_secrets(text: str) -> list[tuple[str, str]]:
    """(kind, match) for every secret-looking string in ``text`` that is not a marked placeholder."""
    found = []
    for kind, pattern in SECRET_PATTERNS.items():
        for m in pattern.finditer(text):
            if not any(marker in m.group(0) for marker in PLACEHOLDER_MARKERS):
                found.append((kind, m.group(0)))
    return found


def tracked_files() -> list[Path]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
        names = [n for n in done.stdout.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):  # not a git checkout (a source tarball): walk it
        skip = {".git", ".ktflow", "__pycache__", ".pytest_cache", ".hypothesis"}
        names = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
                 if p.is_file() and not any(part in skip or part.startswith(".venv") for part in p.parts)]
    return [REPO / n for n in names if (REPO / n).is_file()]


def test_the_secret_scanner_finds_each_kind() -> None:
    # Built at run time, so this file holds none of them.
    samples = ["hf_" + "a1B2" * 9, "sk-" + "x9" * 24, "-----BEGIN RSA " + "PRIVATE KEY-----", "AKIA" + "Q" * 16,
               "aws_secret_access_key = " + "a/B+" * 10, "ghp_" + "z" * 36, "xoxb-" + "1234567890-abc"]
    for sample in samples:
        assert find_secrets(f"config: {sample}\n"), sample
    assert find_secrets("token = 'hf_" + "A" * 30 + "'")
    assert not find_secrets("hf_right_token_123 sk-short disk-" + "a" * 30 + " AKIAIOSFODNN7EXAMPLE")


def test_no_secret_is_committed() -> None:
    files = tracked_files()
    assert len(files) > 50 and any(f.name == "recipe.py" for f in files)  # the scan saw the repo
    leaks = []
    for path in files:
        if path.stat().st_size > 20_000_000:
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        leaks += [f"{path.relative_to(REPO)}: {kind} {match[:12]}..." for kind, match in find_secrets(text)]
    assert leaks == []


# --------------------------------------------------------------------------- (b) loopback and a key, always


def test_serving_binds_loopback_by_default() -> None:
    assert ServingConfig.model_fields["host"].default == "127.0.0.1"
    assert recipe_from_mapping({**TINY, "serving": {"backend": "llamafactory"}}).serving.host == "127.0.0.1"
    for path in sorted(RECIPES.glob("*.yaml")):
        assert is_loopback(load_recipe(path).serving.host), path.name


@pytest.mark.parametrize("value", ["", None, "lower_case", "1STARTS_WITH_DIGIT", "HAS-DASH", "A B"])
def test_a_recipe_cannot_name_no_key_variable(value: object) -> None:
    with pytest.raises(RecipeError, match="serving.api_key_env"):
        recipe_from_mapping({**TINY, "serving": {**TINY["serving"], "api_key_env": value}})


def test_a_key_in_the_recipe_is_refused_with_the_variable_to_use() -> None:
    with pytest.raises(RecipeError, match=r"serving\.api_key: unknown key; a key never goes in a recipe"):
        recipe_from_mapping({**TINY, "serving": {**TINY["serving"], "api_key": "x" * 32}})


def test_without_a_key_variable_a_random_key_is_generated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = recipe_from_mapping(TINY)
    monkeypatch.delenv(recipe.serving.api_key_env, raising=False)
    key, path = resolve_api_key(recipe, tmp_path)
    assert path == tmp_path / API_KEY_FILE and len(key) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_api_key(recipe, tmp_path) == (key, path)  # stable across restarts
    other, _ = resolve_api_key(recipe, tmp_path / "another")
    assert other != key  # random, not derived


def test_weak_or_exposed_keys_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = recipe_from_mapping(TINY)
    monkeypatch.setenv(recipe.serving.api_key_env, "short")
    with pytest.raises(InvalidInputError, match="at least 16 characters"):
        resolve_api_key(recipe, tmp_path)
    monkeypatch.setenv(recipe.serving.api_key_env, "")  # empty means unset: a key is generated, never none
    key, _ = resolve_api_key(recipe, tmp_path)
    assert key
    os.chmod(tmp_path / API_KEY_FILE, 0o644)
    monkeypatch.delenv(recipe.serving.api_key_env)
    with pytest.raises(InvalidInputError, match="readable by others"):
        resolve_api_key(recipe, tmp_path)


def test_the_key_is_not_in_the_rendered_server_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = recipe_from_mapping(TINY)
    secret = "k" * 40
    monkeypatch.setenv(recipe.serving.api_key_env, secret)
    argv, env, infer = render_llamafactory_api(recipe, model_dir=tmp_path, adapter_dir=tmp_path,
                                               train_python=tmp_path / "python", config_dir=tmp_path)
    assert secret not in json.dumps([argv, env, infer])


def test_a_non_loopback_sglang_server_without_a_key_is_refused(tmp_path: Path) -> None:
    from ktflow.host.hardware import GpuInfo, probe_host
    from ktflow.stages.serve.sglang.launch import render_sglang_launch

    recipe = load_recipe(RECIPES / "qwen3-30b-a3b-bf16.yaml", ["serving.host=0.0.0.0"])
    host = probe_host(tmp_path).model_copy(update={"gpus": [GpuInfo(index=0, name="g", vram_bytes=1)]})
    with pytest.raises(HostRequirementError, match=recipe.serving.api_key_env):
        render_sglang_launch(recipe, model_dir=tmp_path, kt_weight_dir=tmp_path, adapter_dir=tmp_path,
                             serve_python=tmp_path / "python", host=host, api_key_env_present=False, check_files=False)


# --------------------------------------------------------------------------- (c) no shell


SCANNED = ("ktflow", "tasks", "flows", "blocks")
FORBIDDEN_CALLS = {
    ("os", "system"), ("os", "popen"), ("os", "spawnlp"), ("os", "spawnvp"), ("subprocess", "getoutput"),
    ("subprocess", "getstatusoutput"), ("asyncio", "create_subprocess_shell"), ("pty", "spawn"),
}


def shell_uses(source: str, filename: str = "<string>") -> list[str]:
    """Every call through a shell in ``source``: ``shell=<anything but False>``, os.system and friends."""
    tree = ast.parse(source, filename)
    aliases: dict[str, tuple[str, str]] = {}  # from os import system as s -> s: (os, system)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for name in node.names:
                aliases[name.asname or name.name] = (node.module, name.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{filename}:{node.lineno}: shell={ast.unparse(kw.value)}")
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = (func.value.id, func.attr)
        elif isinstance(func, ast.Name) and func.id in aliases:
            target = aliases[func.id]
        else:
            continue
        if target in FORBIDDEN_CALLS:
            found.append(f"{filename}:{node.lineno}: {target[0]}.{target[1]}")
    return found


def test_the_shell_checker_catches_each_form() -> None:
    bad = ("import subprocess, os\nsubprocess.run(cmd, shell=True)\nsubprocess.Popen(c, shell=flag)\n"
           "os.system('ls')\nos.popen('ls')\nsubprocess.getoutput('ls')\n"
           "from subprocess import getstatusoutput as g\ng('ls')\n")
    assert len(shell_uses(bad)) == 6
    assert shell_uses("import subprocess\nsubprocess.run(['ls'], shell=False)\nsubprocess.run(['ls'])\n") == []


def test_no_subprocess_goes_through_a_shell() -> None:
    files = [p for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))]
    assert any(p.name == "process.py" for p in files)
    uses = [u for p in files for u in shell_uses(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert uses == []


# --------------------------------------------------------------------------- (d) no escape from the store


@pytest.mark.parametrize("field", ["name", "dataset.name"])
@pytest.mark.parametrize("value", ["../../etc", "..", ".", "/etc", "a/b", "a/../../b", "~root", "x\x00y"])
def test_names_that_become_directories_cannot_escape(field: str, value: str) -> None:
    data = {**TINY, "name": value} if field == "name" else {**TINY, "dataset": {**TINY["dataset"], "name": value}}
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping(data)
    assert f"{field}: " in str(info.value) and "not a plain name" in str(info.value)
    assert recipe_from_mapping(TINY, [f"{field}=ok-name"])  # the field is a real one, and a plain name passes


@pytest.mark.parametrize("value", ["../../../tmp", "/etc", "a/../b", "main/..", "", "a\\b", "x\ny"])
def test_a_revision_cannot_escape_the_weights_dir(value: str) -> None:
    recipe = yaml.safe_load((RECIPES / "qwen3-30b-a3b-bf16.yaml").read_text())
    with pytest.raises(RecipeError, match="source.revision"):
        recipe_from_mapping({**recipe, "source": {**recipe["source"], "revision": value}})


@pytest.mark.parametrize("value", ["main", "v1.0", "refs/pr/1", "feature/x.y", "a" * 40])
def test_real_revisions_still_load(value: str) -> None:
    recipe = yaml.safe_load((RECIPES / "qwen3-30b-a3b-bf16.yaml").read_text())
    assert recipe_from_mapping({**recipe, "source": {**recipe["source"], "revision": value}}).source.revision == value


@pytest.mark.parametrize("value", ["../etc", "a/..", "./b"])
def test_a_repo_id_cannot_hold_dot_components(value: str) -> None:
    with pytest.raises(RecipeError, match="source.repo_id"):
        load_recipe(RECIPES / "qwen3-30b-a3b-bf16.yaml", [f"source.repo_id={value}"])


def _plain_adapter(fixture_dir, where: Path) -> tuple[Path, Path]:
    from test_convert_lora import make_kt_adapter

    base = fixture_dir("bf16")
    adapter = make_kt_adapter(base, where, fused=False, manifest=False,
                              mutate=lambda p, e, c: [p.pop(k) for k in [k for k in p if "orig_module" in k]])
    return base, adapter


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
def test_adapter_files_linking_outside_are_refused(tmp_path: Path, fixture_dir, name: str) -> None:
    base, adapter = _plain_adapter(fixture_dir, tmp_path / "adapter")
    secret = tmp_path / "private" / name
    secret.parent.mkdir()
    (adapter / name).rename(secret)
    (adapter / name).symlink_to(secret)
    for call in (lambda: validate_adapter(adapter, base),
                 lambda: convert_lora(adapter, tmp_path / "out", base_dir=base, serve_python=tmp_path / "none")):
        with pytest.raises(AdapterError, match="symbolic link .* outside the adapter directory") as info:
            call()
        assert info.value.subject == str(adapter / name)
    assert not (tmp_path / "out").exists()


def test_a_link_inside_the_adapter_is_fine(tmp_path: Path, fixture_dir) -> None:
    base, adapter = _plain_adapter(fixture_dir, tmp_path / "adapter")
    (adapter / "adapter_model.safetensors").rename(adapter / "weights.bin")
    (adapter / "adapter_model.safetensors").symlink_to("weights.bin")
    assert validate_adapter(adapter, base)[0] == 8


def test_the_adapter_configs_base_path_is_never_trusted(tmp_path: Path, fixture_dir) -> None:
    base, adapter = _plain_adapter(fixture_dir, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "../../../../etc"}))
    result = convert_lora(adapter, tmp_path / "out", base_dir=base, serve_python=tmp_path / "none")
    published = json.loads((result.path / "adapter_config.json").read_text())
    assert published["base_model_name_or_path"] == str(base.resolve())


# --------------------------------------------------------------------------- (e) the hub token, through `ktflow download`


def test_download_never_writes_or_prints_the_hub_token(tmp_path: Path) -> None:
    import uuid

    token = "hf_" + uuid.uuid4().hex + uuid.uuid4().hex[:8]
    files = {"config.json": json.dumps({"model_type": "deepseek_v3"}).encode(),
             "model.safetensors": os.urandom(200_000), "tokenizer.json": b"{}"}
    repo = FakeRepo.build("acme/tiny-moe", files)
    store = tmp_path / "store"
    with FakeHub(repo, token=token, lfs_redirect=True) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HUB_OFFLINE": "0",
               "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1", "COLUMNS": "200"}
        done = subprocess.run(
            [sys.executable, "-m", "ktflow.cli", "download", str(RECIPES / "tiny-demo.yaml"),
             "--set", "source.local_path=null", "--set", "source.repo_id=acme/tiny-moe",
             "--set", "source.format=bf16", "--set", f"store.root={store}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )
        sent = {r.authorization for r in hub.requests if r.kind != "cdn"}
    assert done.returncode == 0, done.stderr[-3000:]
    assert sent == {f"Bearer {token}"}  # the token was really used, so the grep below means something
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in written) and any(p.name == "model.safetensors" for p in written)
    leaks = [str(p) for p in written if token.encode() in p.read_bytes()]
    assert leaks == []
    assert token not in done.stdout and token not in done.stderr
    assert token[3:] not in done.stdout + done.stderr  # not even without its prefix
