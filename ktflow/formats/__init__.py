"""File formats: the bytes ktflow reads and writes, validated without loading tensors.

- ``safetensors_io.py``: the safetensors header reader and a streaming, parallel writer. Imports
  the standard library, numpy and ktflow.errors only: the drivers (``ktflow/_drivers``) import it
  inside the tools' own environments, so this package's ``__init__`` stays empty of imports.
- ``checkpoint.py``: checkpoint format detection and validation from config and headers
  (Kimi-K2.5/K2 INT4, DeepSeek FP8, BF16), and a checkpoint's cheap identity digest.
- ``dataset.py``: dataset validation and normalization for LlamaFactory (alpaca, sharegpt, openai),
  every bad record named by file and line.
- ``adapter.py``: the files a LoRA adapter directory holds (PEFT's, and KT's fused expert LoRA).

Imports: errors, units, store, recipe; never a stage.
"""
