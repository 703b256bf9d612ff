"""File formats: the bytes ktflow reads and writes, validated without loading tensors.

- ``safetensors_io.py``: the safetensors header reader and a streaming, parallel writer. Imports
  the standard library, numpy and ktflow.errors only: the drivers (``ktflow/_drivers``) import it
  inside the tools' own environments, so this package's ``__init__`` stays empty of imports.
- ``checkpoint.py``: checkpoint format detection and validation from config and headers
  (Kimi-K2.5/K2 INT4, DeepSeek FP8, BF16), and a checkpoint's cheap identity digest.
- ``dataset/``: dataset validation and normalization for LlamaFactory, every bad record named by
  file and line: a module per dialect (``alpaca``, ``sharegpt``, ``openai``), ``reader`` (config
  checks, file reading, validation), ``prepare`` (digest and the published copy), ``_common``.
- ``adapter.py``: the files a LoRA adapter directory holds (PEFT's, and KT's fused expert LoRA).
- ``quant_decode.py``: the decode rules as tensor kernels (compressed-tensors pack-quantized INT4 and
  DeepSeek block FP8 to BF16, bit for bit), which the dequantize stage streams checkpoints through.

Imports: errors, units, store, recipe; never a stage.
"""
