"""The GPU backend: sglang-kt (KT's SGLang fork) from the serving toolchain, with KT's CPU experts; one adapter,
loaded at startup.

- ``launch.py``: the ``sglang.launch_server`` command line and the checks it must pass before a server starts
  (weights for ``--kt-method``, the host's cores and GPUs, the API key kept out of argv).
- ``inputs.py``: what sglang-kt is given to load where the pipeline's outputs are not what it reads (a view of
  the checkpoint, kt-kernel's ``.kt`` layout of AMXINT8 experts served with an expert LoRA).
- ``adapters.py``: one client for SGLang's adapter API (plain SGLang's no-downtime swap, a candidate loaded
  beside production).
- here: the backend the lifecycle starts (:data:`BACKEND`): readiness on ``/health``, the key handed to the
  server's parser in-process; in ``merged`` mode the adapter is first folded into the weights by the merge stage
  (:mod:`ktflow.stages.merge`, cached in the store) and the server gets those weights with no LoRA flags.
"""

from __future__ import annotations

from pathlib import Path

from ktflow.errors import InsufficientDiskError, InvalidInputError
from ktflow.host.hardware import HostInfo
from ktflow.recipe import Recipe
from ktflow.stages.serve.backend import Launch, Log, ServeMode
from ktflow.stages.serve.records import ENDPOINT_FILE, adapter_model_name, base_url, read_endpoint
from ktflow.stages.serve.sglang.inputs import model_view_plan, sglang_inputs
from ktflow.stages.serve.sglang.launch import render_sglang_launch

__all__ = ["BACKEND", "SglangBackend"]


def merges_served(recipe: Recipe) -> set[Path] | None:
    """The merges the store's recorded servers read (production's, a candidate's, a tuning server's), or None when a
    record cannot be read (then nothing may be removed)."""
    root = recipe.store.layout.root
    served: set[Path] = set()
    for folder in (root / "serving", root / "eval"):
        for path in folder.rglob(ENDPOINT_FILE) if folder.is_dir() else ():
            try:
                endpoint = read_endpoint(path.parent)
            except (OSError, ValueError):
                return None
            if endpoint is not None and endpoint.merged_dir is not None:
                served.add(Path(endpoint.merged_dir).resolve())
    return served


def _room_made(recipe: Recipe, merged: Path, short: InsufficientDiskError, log: Log) -> bool:
    """After the merge's own disk check failed: remove the store's least recently served merges no server reads until
    the new one fits. True when some were removed; False (the disk error stands) when the shortfall is not the
    merge's own, or nothing could go."""
    from ktflow.stages.merge import evict_merges

    if Path(short.subject).resolve() != merged.resolve():  # another filesystem's need (a scratch folder)
        return False
    served = merges_served(recipe)
    if served is None:
        if log:
            log("the store's merges were kept: a server record in the store could not be read")
        return False
    try:
        return bool(evict_merges(recipe.store.layout, short.need, keep=served | {merged.resolve()}, log=log))
    except Exception as exc:  # noqa: BLE001 - making room is a courtesy: the disk error says what is needed
        if log:
            log(f"the store's merges were kept: {type(exc).__name__}: {exc}")
        return False


class SglangBackend:
    """sglang-kt in the serving toolchain."""

    name = "sglang"

    def python(self, recipe: Recipe) -> Path:
        return recipe.toolchains.serve.require("toolchains.serve.python", "sglang-kt and kt-kernel", "serve-env")

    def check_adapter(self, adapter_dir: Path, *, model_dir: Path, validate: bool) -> Path:
        # Converted for SGLang (its keys name the served model, which may be a view of model_dir): the launch
        # checks that it is a converted adapter.
        return Path(adapter_dir).absolute()

    def prepare(self, recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
                record_dir: Path, log: Log, mode: ServeMode = "lora") -> None:
        model_dir, kt_weight_dir, adapter_dir, _ = self._served_weights(recipe, model_dir, adapter_dir, kt_weight_dir, mode,
                                                                 dry_run=False, log=log)
        sglang_inputs(recipe, model_dir=model_dir, kt_weight_dir=kt_weight_dir, adapter_dir=adapter_dir,
                      record_dir=record_dir, log=log)

    def _served_weights(self, recipe: Recipe, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
                 mode: ServeMode, *, dry_run: bool, log: Log) -> tuple[Path, Path, Path | None, Path | None]:
        """``(model dir, expert weights, adapter for the LoRA flags, merged dir)`` the server is given: in ``merged``
        mode the merge of ``adapter_dir`` into ``model_dir`` (made now, or named for a dry run) and no adapter;
        else the inputs as they are."""
        model_dir = Path(model_dir).absolute()
        if mode != "merged" or adapter_dir is None:
            return model_dir, _required_weights(kt_weight_dir), adapter_dir, None
        from ktflow.stages.merge import (  # torch: only where a merge runs
            MergeResult,
            mark_merge_served,
            merge_adapter,
            merge_target,
            served_paths,
        )

        method = recipe.serving.kt_method
        assert method is not None
        t = recipe.serving.kt_threadpool_count
        if dry_run:
            merged = recipe.store.layout.merged(f"<{method.lower()} merge of the trained adapter>").absolute()
        else:
            merged = merge_target(recipe.store.layout, model_dir, adapter_dir, method, t).absolute()
            if log:
                log(f"merging {adapter_dir} into {model_dir} as {method} (serving.mode merged): {merged}")
            def merge() -> MergeResult:
                return merge_adapter(model_dir, adapter_dir, merged, method=method, threadpool_count=t,
                                     serve_python=self.python(recipe))

            try:
                result = merge()
            except InsufficientDiskError as short:
                if not _room_made(recipe, merged, short, log):
                    raise
                result = merge()  # its preflight checks the disk again
            mark_merge_served(merged)
            if log:
                log(f"merged weights {'found in the store' if result.cached else f'made in {result.seconds:.0f} s'}: "
                    f"{merged}")
        served_model, served_experts = served_paths(merged, method)
        return served_model, served_experts, None, merged

    def launch(self, recipe: Recipe, *, model_dir: Path, adapter_dir: Path | None, kt_weight_dir: Path | None,
               record_dir: Path, port: int | str, host: HostInfo | None, log: Log = None, dry_run: bool = False,
               mode: ServeMode = "lora") -> Launch:
        """The key reaches the server through its environment (the launcher hands it to the parser in-process);
        readiness is ``/health``. The model and the experts are given as sglang-kt reads them
        (:func:`~ktflow.stages.serve.sglang.inputs.sglang_inputs`), made here when first needed; a dry run only
        names them, and says so in its notes. ``port`` may differ from ``serving.port``: a candidate's server
        beside production."""
        from ktflow.host import hardware

        serving = recipe.serving
        python = recipe.toolchains.serve.python.absolute() if dry_run else self.python(recipe)
        model_dir, weights, adapter_dir, merged = self._served_weights(recipe, model_dir, adapter_dir, kt_weight_dir, mode,
                                                                dry_run=dry_run, log=log)
        notes: list[str] = []
        if dry_run and merged is not None:
            notes.append(f"--model-path and --kt-weight-path: the merge stage folds the adapter into the weights as "
                         f"{serving.kt_method} before the start ({merged.parent}/<base>-<adapter>-<method>), cached")
        if not dry_run or (model_dir / "config.json").is_file():  # a dry run before the weights exist names no view
            model_in = model_dir
            model_dir, weights = sglang_inputs(recipe, model_dir=model_in, kt_weight_dir=weights,
                                               adapter_dir=adapter_dir, record_dir=record_dir, create=not dry_run,
                                               log=log)
            if dry_run and model_dir != model_in:
                notes.append(f"--model-path: a view of {model_in} the serve stage makes at start "
                             f"({model_view_plan(model_in).reason})")  # type: ignore[union-attr]
        if dry_run and serving.kt_method == "AMXINT8" and merged is None:
            notes.append("--kt-weight-path: with an adapter that carries an expert LoRA (a KT SFT adapter), the "
                         "serve stage serves kt-kernel's .kt layout of these INT8 weights, written once into the "
                         "store at start")
        rendered = render_sglang_launch(recipe, model_dir=model_dir, kt_weight_dir=weights, adapter_dir=adapter_dir,
                                        serve_python=python, host=host or hardware.probe_host(record_dir), port=port,
                                        check_files=not dry_run)
        details: dict[str, object] = {}
        if rendered.int8_threadpool_count is not None:
            details["int8_threadpool_count"] = rendered.int8_threadpool_count
        if notes:
            details["notes"] = notes
        return Launch(what="sglang-kt", python=python, argv=rendered.argv, env=rendered.env,
                      key_env=rendered.api_key_env or serving.api_key_env,
                      model_name=adapter_model_name(recipe) if adapter_dir is not None else serving.served_model_name,
                      ready_url=f"{base_url(serving.host, port).removesuffix('/v1')}/health", expect_model=None,
                      check_auth=False, details=details, merged_dir=merged)


def _required_weights(kt_weight_dir: Path | None) -> Path:
    if kt_weight_dir is None:
        raise InvalidInputError("kt_weight_dir", "the sglang backend needs the CPU expert weights",
                                "pass the weights for serving.kt_method")
    return Path(kt_weight_dir).absolute()


BACKEND = SglangBackend()
