"""Prefect flows: the pipeline DAG (``pipeline.py``: download -> dequantize -> sft -> convert-lora
-> quantize-int8 -> evaluate (the candidate) -> serve (promote it), run in-process or dispatched), one flow per stage
(``stages.py``: each a deployment on the work pool whose hardware capability it needs), and the
events ktflow emits (``events.py``).
"""
