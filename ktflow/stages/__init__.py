"""The stages: one module per stage, each declared once for the runner (:mod:`ktflow.runner`).

Artifact stages (a ``StageSpec``, published atomically with a manifest):

- ``download.py``: a hub snapshot at a pinned revision, a local copy or a URI; verified.
- ``dequantize.py``: INT4/FP8 -> BF16, streaming, multi-core, bit-exact.
- ``sft.py``: LoRA SFT through LlamaFactory (plain, KT 0.7, legacy KT): render, launch, follow,
  resume, the auto backend, publish.
- ``convert_lora.py``: validate the adapter against its base (:mod:`ktflow.formats.adapter`); convert KT
  fused expert LoRA for SGLang.
- ``quantize_int8.py``: kt-kernel's AMXINT8 CPU expert weights (the driver runs in the serving toolchain).
- ``merge.py``: a converted adapter folded into its base in one streaming pass, written as the server reads
  it (BF16, Kimi INT4, or kt-kernel's AMXINT8/AMXINT4 through quantize-int8's driver).

Serving and promotion (a process and records, not an artifact):

- ``serve/``: the endpoint: its lifecycle (start, health gate, smoke test, stop, swap with rollback, a
  temporary server, the dry run), what serving needs of a host, the endpoint records, and one subpackage per
  backend (``llamafactory/``; ``sglang/`` with its launch command, its inputs and SGLang's adapter API).
- ``evaluate.py``: base vs candidate vs production through the OpenAI API, or offline.
- ``eval_metrics.py``: the evaluation's metrics (BLEU, ROUGE, option letters, style share, latency).
- ``contamination.py``: the train/eval overlap check.
- ``offline_generation.py``: answers through the training toolchain, no server.
- ``promotion.py``: judge a candidate, promote, roll back, recover a killed move
  (records: :mod:`ktflow.registry`).
- ``weights.py``: which weights each stage reads, and where they live in the store.

A stage may import the core (errors, units, recipe, resources, runner, store, registry), formats,
host and planning, and another stage only for what it consumes (evaluate asks serve for a
server, promotion asks evaluate and serve); nothing here imports Prefect (tasks/ and flows/ do).
"""
