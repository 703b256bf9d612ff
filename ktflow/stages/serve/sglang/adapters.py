"""One client for SGLang's adapter API (``/load_lora_adapter``, ``/unload_lora_adapter``): plain SGLang's
no-downtime adapter swap, and a candidate loaded for the length of an evaluation beside production.

sglang-kt (KT's fork) loads its one adapter at startup and has neither endpoint: there, a swap is a restart
(:func:`ktflow.stages.serve.swap_adapter`) and a candidate gets a server of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ktflow.errors import EvaluationError, KtflowError, SwapError
from ktflow.stages.serve.process import smoke_test
from ktflow.store import atomic_write_json

REQUEST_TIMEOUT_S = 600.0


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


def load_adapter(root_url: str, api_key: str, name: str, adapter_dir: Path) -> tuple[int, str]:
    """Ask the server at ``root_url`` to load ``adapter_dir`` as ``name`` (unpinned): ``(HTTP status, body)``.
    SGLang registers an adapter only once it loaded, so a refused load changes nothing the server serves."""
    return _post_json(f"{root_url}/load_lora_adapter", api_key,
                      {"lora_name": name, "lora_path": str(Path(adapter_dir).absolute()), "pinned": False})


def unload_adapter(root_url: str, api_key: str, name: str) -> tuple[int, str]:
    """Ask the server at ``root_url`` to unload the adapter ``name``: ``(HTTP status, body)``."""
    return _post_json(f"{root_url}/unload_lora_adapter", api_key, {"lora_name": name})


def _post_json(url: str, api_key: str, payload: dict[str, Any]) -> tuple[int, str]:
    import httpx

    response = httpx.post(url, json=payload, headers={"Authorization": f"Bearer {api_key}"},
                          timeout=REQUEST_TIMEOUT_S)
    return response.status_code, response.text[:2000]


@contextlib.contextmanager
def dynamic_adapter(root_url: str, api_key: str, name: str, adapter_dir: Path,
                    log: Callable[[str], None] | None = None) -> Iterator[str]:
    """``adapter_dir`` loaded into a running SGLang server as ``name`` for the length of the block, unloaded on
    the way out whatever happened.

    Raises:
        EvaluationError: the server refused to load it (HTTP status and body named).
    """
    status, body = load_adapter(root_url, api_key, name, adapter_dir)
    if status != 200:
        raise EvaluationError(f"{root_url} refused to load the candidate {adapter_dir} as {name} "
                              f"(HTTP {status}: {body[:500]}); production is untouched")
    if log:
        log(f"candidate loaded beside production as {name}")
    try:
        yield name
    finally:
        unload_adapter(root_url, api_key, name)
        if log:
            log(f"candidate {name} unloaded")


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
    one composite adapter at startup and cannot do this: use :func:`ktflow.stages.serve.swap_adapter` (restart) there.

    Raises:
        SwapError: the new adapter failed (``rolled_back`` is True: the old one still serves).
    """
    record_dir = Path(record_dir)
    record_path = record_dir / "sglang-adapters.json"
    state = (SglangAdapters.model_validate_json(record_path.read_text()) if record_path.exists()
             else SglangAdapters(url=root_url))
    version = (state.current.version + 1) if state.current else 1
    new = LoadedAdapter(name=f"{adapter_name}-v{version}", path=Path(new_adapter_dir).absolute(), version=version)
    status, body = load_adapter(root_url, api_key, new.name, new.path)
    if status != 200:
        raise SwapError(f"SGLang refused to load {new.path} as {new.name} (HTTP {status}: {body}); "
                        f"{state.current.name if state.current else 'the base model'} keeps serving", rolled_back=True)
    try:
        smoke_test(f"{root_url}/v1", api_key, f"{served_model_name}:{new.name}")
    except KtflowError as exc:
        unload_adapter(root_url, api_key, new.name)
        raise SwapError(f"the new adapter {new.name} failed its smoke test ({exc}); it was unloaded and "
                        f"{state.current.name if state.current else 'the base model'} keeps serving",
                        rolled_back=True) from None
    if state.current is not None:
        unload_adapter(root_url, api_key, state.current.name)
    state = SglangAdapters(url=root_url, current=new, previous=state.current)
    record_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, state.model_dump(mode="json"))
    return state
