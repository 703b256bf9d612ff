"""The GPU backend: sglang-kt from the serving toolchain (one adapter, loaded at startup), and plain
SGLang's adapter API (load a new versioned adapter, smoke-test it, unload the old: no downtime)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ktflow.errors import (
    KtflowError,
    SwapError,
)
from ktflow.recipe import Recipe
from ktflow.stages.serve.process import _Launch, smoke_test
from ktflow.stages.serve.records import adapter_model_name, base_url
from ktflow.store import atomic_write_json


def serve_python(recipe: Recipe) -> Path:
    """The serving toolchain's python, where sglang-kt and kt-kernel live (HostRequirementError when missing)."""
    return recipe.toolchains.serve.require("toolchains.serve.python", "sglang-kt and kt-kernel", "serve-env")


def _sglang_launch(recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
                   record_dir: Path, port: int, host: Any, log: Callable[[str], None] | None = None) -> _Launch:
    """sglang-kt in the serving toolchain; the key reaches it through its environment (the launcher
    hands it to the parser in-process), readiness is /health.

    The model directory and the expert weights are given as sglang-kt reads them
    (:func:`~ktflow.stages.serve.sglang_inputs.sglang_inputs`: a view of a checkpoint it cannot load
    as it is, kt-kernel's ``.kt`` layout of AMXINT8 experts served with an expert LoRA), made here
    when first needed. ``port`` may differ from ``serving.port``: a candidate's server beside
    production."""
    from ktflow.host.hardware import probe_host as probe_hardware
    from ktflow.stages.serve.sglang_inputs import sglang_inputs
    from ktflow.stages.sglang_launch import render_sglang_launch

    serving = recipe.serving
    python = serve_python(recipe)
    assert kt_weight_dir is not None
    model_dir, kt_weight_dir = sglang_inputs(recipe, model_dir=model_dir, kt_weight_dir=kt_weight_dir,
                                             adapter_dir=adapter_dir, record_dir=record_dir, log=log)
    launch = render_sglang_launch(recipe, model_dir=model_dir, kt_weight_dir=kt_weight_dir, adapter_dir=adapter_dir,
                                  serve_python=python, host=host or probe_hardware(record_dir), port=port)
    return _Launch(what="sglang-kt", python=python, argv=launch.argv, env=launch.env,
                   key_env=launch.api_key_env or serving.api_key_env,
                   model_name=adapter_model_name(recipe) if adapter_dir is not None else serving.served_model_name,
                   ready_url=f"{base_url(serving.host, port).removesuffix('/v1')}/health", expect_model=None,
                   check_auth=False)


class LoadedAdapter(BaseModel):
    """An adapter loaded into a plain SGLang server under a versioned name."""

    name: str
    path: Path
    version: int


class SglangAdapters(BaseModel):
    """What ``record_dir/sglang-adapters.json`` says a plain SGLang server is serving."""

    url: str
    current: LoadedAdapter | None = None
    previous: LoadedAdapter | None = None


def _post_json(url: str, api_key: str, payload: dict[str, Any], timeout_s: float = 600.0) -> tuple[int, str]:
    import httpx

    response = httpx.post(url, json=payload, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout_s)
    return response.status_code, response.text[:2000]


def swap_sglang_adapter(
    root_url: str,
    api_key: str,
    *,
    served_model_name: str,
    adapter_name: str,
    new_adapter_dir: Path,
    record_dir: Path,
) -> SglangAdapters:
    """Serve a retrained adapter on a running plain SGLang server with no downtime.

    Loads it under the next versioned name (``<adapter_name>-v<N+1>``: SGLang refuses a name that
    is already loaded), smoke-tests it through the OpenAI API (``model=<served>:<name>``), and only
    then unloads the old version; clients move by switching the model name. If loading or the
    smoke test fails, the new version is unloaded and the old one keeps serving. The KT fork loads
    one composite adapter at startup and cannot do this: use :func:`swap_adapter` (restart) there.

    Raises:
        SwapError: the new adapter failed (``rolled_back`` is True: the old one still serves).
    """
    record_dir = Path(record_dir)
    record_path = record_dir / "sglang-adapters.json"
    state = (SglangAdapters.model_validate_json(record_path.read_text()) if record_path.exists()
             else SglangAdapters(url=root_url))
    version = (state.current.version + 1) if state.current else 1
    new = LoadedAdapter(name=f"{adapter_name}-v{version}", path=Path(new_adapter_dir).absolute(), version=version)
    status, body = _post_json(f"{root_url}/load_lora_adapter",
                              api_key, {"lora_name": new.name, "lora_path": str(new.path), "pinned": False})
    if status != 200:
        raise SwapError(f"SGLang refused to load {new.path} as {new.name} (HTTP {status}: {body}); "
                        f"{state.current.name if state.current else 'the base model'} keeps serving", rolled_back=True)
    try:
        smoke_test(f"{root_url}/v1", api_key, f"{served_model_name}:{new.name}")
    except KtflowError as exc:
        _post_json(f"{root_url}/unload_lora_adapter", api_key, {"lora_name": new.name})
        raise SwapError(f"the new adapter {new.name} failed its smoke test ({exc}); it was unloaded and "
                        f"{state.current.name if state.current else 'the base model'} keeps serving",
                        rolled_back=True) from None
    if state.current is not None:
        _post_json(f"{root_url}/unload_lora_adapter", api_key, {"lora_name": state.current.name})
    state = SglangAdapters(url=root_url, current=new, previous=state.current)
    record_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, state.model_dump(mode="json"))
    return state
