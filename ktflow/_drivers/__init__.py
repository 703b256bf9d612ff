"""Drivers: small programs that ktflow runs INSIDE a tool's own environment (toolchain).

A driver is started as ``<toolchain python> -m ktflow._drivers.<name> ...`` with ``PYTHONPATH``
pointing at a directory that holds only the ``ktflow`` package, so it imports ktflow from the
orchestrator's checkout without being installed there. It may import the standard library,
torch, safetensors, the tool itself, and the import-light parts of ktflow (``ktflow.errors``,
``ktflow.formats.safetensors_io``), never pydantic, Prefect or anything else the toolchain lacks.

Drivers talk back through stdout: one line per event, ``<PREFIX> <json>``, which the orchestrator
parses while it streams the tool's output to the stage log.

- ``kt_int8.py``: kt-kernel's own AMXINT8 quantizer driven per layer, in the serving toolchain
  (``ktflow.stages.quantize_int8``).
- ``kt_probe.py``: kt-kernel's own SFT expert kernels (forward and backward) timed on synthetic weights, in
  the KT toolchain: the host probe (``ktflow.planning.host_probe``).
- ``offline_chat.py``: LlamaFactory's chat engine answering OpenAI-style requests, in the training
  toolchain (``ktflow.stages.offline_generation``).
"""
