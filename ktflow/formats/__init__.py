"""File formats: the bytes ktflow reads and writes, validated without loading tensors.

- ``safetensors_io.py``: the safetensors header reader and a streaming, parallel writer. Imports
  the standard library, numpy and ktflow.errors only: the drivers (``ktflow/_drivers``) import it
  inside the tools' own environments, so this package's ``__init__`` stays empty of imports.
- ``checkpoint.py``: checkpoint format detection and validation from config and headers
  (Kimi-K2.5/K2 INT4, DeepSeek FP8, BF16), and a checkpoint's cheap identity digest.
- ``dataset/``: dataset validation and normalization for LlamaFactory, every bad record named by
  file and line: a module per dialect (``alpaca``, ``sharegpt``, ``openai``), ``reader`` (config
  checks, file reading, validation), ``prepare`` (digest and the published copy), ``_common``.
- ``adapter.py``: the LoRA adapter format: the files an adapter directory holds (PEFT's, and KT's fused expert
  LoRA with its manifest), expert-LoRA detection, and an adapter validated against its base from headers only.
- ``kt_layout.py``: kt-kernel's AMXINT8 expert layouts (quantize-int8's ``blk.*`` shards, ``cpu_save``'s ``.kt``
  files): names and sizes. Standard library only, like ``safetensors_io``: the drivers import it.
- ``quant_decode.py``: the decode rules as tensor kernels (compressed-tensors pack-quantized INT4 and
  DeepSeek block FP8 to BF16, bit for bit), which the dequantize stage streams checkpoints through.
- ``quant_encode.py``: the INT4 encode rule (Kimi's pack-quantized scheme, the inverse of its decode bit for
  bit on decoded weights), which the merge stage re-quantizes merged experts with.
- ``lora_merge.py``: the LoRA merge rule ``bf16(W + alpha/r * B @ A)``, computed alike in every toolchain.

Imports: errors, units, store, recipe; never a stage.
"""
