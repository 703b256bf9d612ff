"""The serve stage's own measurement of a lever (:mod:`ktflow.stages.serve.levers`): a temporary server with the
candidate's settings, a few short streaming chat requests at concurrency 1 through the ``openai`` client (decode
tokens/s and time to the first token), and, where records are given, their served loss from SGLang's prompt
logprobs (``/generate``); then the server is stopped."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ktflow.errors import KtflowError
from ktflow.recipe import Recipe, ServingConfig
from ktflow.stages.serve.backend import Log, ServeMode
from ktflow.stages.serve.levers import LeverMeasurement
from ktflow.stages.serve.lifecycle import temporary_server

DECODE_PROMPT = "Count from one upwards in words, one number a line, and keep going."
DEFAULT_REQUESTS = 3
DEFAULT_MAX_TOKENS = 256
REQUEST_TIMEOUT_S = 600.0


def decode_timing(url: str, api_key: str, model: str, *, requests: int = DEFAULT_REQUESTS,
                  max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[float | None, float | None]:
    """``(decode tokens/s median, TTFT p50 s)`` of ``requests`` streaming chat requests one after another
    (concurrency 1), each asking for ``max_tokens`` with ``ignore_eos`` (sglang generates them all), after one
    short unmeasured request (the first request after a start pays one-off compilation).

    Raises:
        KtflowError: a request failed.
    """
    import openai

    client = openai.OpenAI(base_url=url, api_key=api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0)
    decode, ttft = [], []
    try:
        for i in range(requests + 1):
            warm_up = i == 0
            started = time.perf_counter()
            first = last = None
            chunks, completion = 0, None
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": DECODE_PROMPT}], temperature=0, stream=True,
                max_tokens=16 if warm_up else max_tokens, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta is not None and chunk.choices[0].delta.content:
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                if chunk.usage is not None:
                    completion = chunk.usage.completion_tokens
            if warm_up or first is None or last is None:
                continue
            ttft.append(first - started)
            tokens = completion or chunks
            if tokens > 1 and last > first:
                decode.append((tokens - 1) / (last - first))
    except openai.OpenAIError as exc:
        raise KtflowError(f"a timed request to {url} failed: {type(exc).__name__}: {exc}") from None
    finally:
        client.close()
    return (round(statistics.median(decode), 2) if decode else None,
            round(statistics.median(ttft), 4) if ttft else None)


def served_loss(root_url: str, api_key: str, records: list[list[int]], *, lora: str | None = None) -> float | None:
    """The mean loss of ``records`` (token ids; every token after the first counts) from the server's prompt
    logprobs through SGLang's ``/generate``; None without records.

    Raises:
        KtflowError: the server refused or answered without prompt logprobs.
    """
    import httpx

    total, count = 0.0, 0
    for ids in records:
        payload: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                   "return_logprob": True, "logprob_start_len": 0}
        if lora is not None:
            payload["lora_path"] = lora
        try:
            reply = httpx.post(f"{root_url}/generate", json=payload, headers={"Authorization": f"Bearer {api_key}"},
                               timeout=REQUEST_TIMEOUT_S)
            reply.raise_for_status()
            logprobs = [t[0] for t in reply.json()["meta_info"]["input_token_logprobs"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise KtflowError(f"{root_url}/generate gave no prompt logprobs: {type(exc).__name__}: {exc}") from None
        nll = [-lp for lp in logprobs[1:] if lp is not None]
        total += sum(nll)
        count += len(nll)
    return round(total / count, 6) if count else None


def loss_records(recipe: Recipe, model_dir: Path, count: int) -> list[list[int]]:
    """The first ``count`` training records as token ids, with the model's tokenizer and chat template (cut at
    ``sft.cutoff_len``); none where the dataset files or the tokenizer are not here."""
    from ktflow.formats.dataset import record_messages
    from ktflow.planning.batch_shape import chat_token_ids, load_tokenizer

    if count <= 0 or not all(Path(f).is_file() for f in recipe.dataset.files):
        return []
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:  # no tokenizer here: no served loss, said by the caller
        return []
    records: list[list[int]] = []
    try:
        conversations = list(record_messages(recipe.dataset))
    except KtflowError:  # an unreadable dataset: no served loss (the SFT stage reports it)
        return []
    for messages in conversations:
        try:
            ids = chat_token_ids(messages, tokenizer)[0][: recipe.sft.cutoff_len]
        except Exception:  # noqa: BLE001 - a tokenizer that fails on this record: scored without it
            continue
        if len(ids) > 1:
            records.append(ids)
        if len(records) >= count:
            break
    return records


def server_measurement(recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
                       record_dir: Path, api_key: str, mode: ServeMode, requests: int = DEFAULT_REQUESTS,
                       max_tokens: int = DEFAULT_MAX_TOKENS, records: list[list[int]] | None = None,
                       log: Log = None) -> Callable[[ServingConfig], LeverMeasurement]:
    """The measurement :func:`ktflow.stages.serve.levers.measure_levers` calls: for each candidate serving section,
    a temporary server of ``model_dir`` with ``adapter_dir`` in ``mode`` (merged: the merge stage's weights, made
    once per method and cached), timed (:func:`decode_timing`) and, with ``records``, its served loss; a failure is
    a measurement that did not serve, with its error."""

    def measure(serving: ServingConfig) -> LeverMeasurement:
        candidate = recipe.model_copy(update={"serving": serving})
        started = time.perf_counter()
        try:
            with temporary_server(candidate, model_dir=model_dir, adapter_dir=adapter_dir, api_key=api_key,
                                  record_dir=record_dir, what="lever measurement", log=log,
                                  kt_weight_dir=kt_weight_dir, mode=mode, measured_settings=False) as endpoint:
                decode, ttft = decode_timing(endpoint.url, api_key, endpoint.model, requests=requests,
                                             max_tokens=max_tokens)
                lora = serving.adapter_name if endpoint.adapter_model_name else None
                loss = served_loss(endpoint.url.removesuffix("/v1"), api_key, records, lora=lora) if records else None
        except (KtflowError, OSError) as exc:  # a configuration that does not serve is a result, not the end
            return LeverMeasurement(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:500]}",
                                    seconds=round(time.perf_counter() - started, 1))
        return LeverMeasurement(ok=decode is not None, decode_tokens_per_s=decode, ttft_p50_s=ttft, served_loss=loss,
                                loss_records=len(records or []), requests=requests,
                                seconds=round(time.perf_counter() - started, 1),
                                error=None if decode is not None else "no tokens streamed back")

    return measure
