"""Planning: which stages a recipe needs and where they run, and the models of what each costs.

- ``stage_plan.py``: which stages a recipe needs and why, what each needs of a host's hardware,
  ``ktflow doctor --recipe``'s check, and the stages a host prepares for another (``StageSkipped``).
  Imports: recipe, resources, host.
- ``sizing.py``: a checkpoint's size from its config and headers (``ModelSize``), plain SFT's GPU
  memory and KT SFT's GPU memory and RSS. Imports: formats, recipe, resources, units.
- ``costs.py``: the time model (``CostModel``; KT's step fitted on benchmarks/data/kt-throughput by
  benchmarks/kt_step_model.py, the rest on benchmarks/data/calibration.json). Imports: sizing, units.
- ``host_speed.py``: a host's own KT speed: the steady step each KT SFT run records against the time
  model's prediction (``KtStepRecord``), and the factor later plans on that host are scaled by
  (``calibrated_costs``). Imports: costs, sizing, recipe, store.
- ``host_probe.py``: a host probe that measures what KT does: kt-kernel's own SFT expert kernels timed on
  synthetic weights in the recipe's method and expert shape (the driver ``ktflow._drivers.kt_probe``, in the
  KT toolchain), kept per machine in the store, and the factor on KT's CPU passes it gives a host without KT
  runs (``probe_scale``). Imports: costs, sizing, recipe, host, errors, units.
- ``batch_shape.py``: tokens per record from the dataset, tokens per micro-batch, and the micro-batch
  split KT trains fastest that fits (``shape_kt_batches``), each at this host's own speed.
  Imports: costs, host_speed, sizing, recipe, resources, formats.
- ``merge_cost.py``: what the merge stage costs by output method (time, disk, peak RAM), from the other
  stages' measured rates until merges are timed. Imports: costs, sizing, units.

This package sits below the stages (they size and time their work with its models) and never imports
one, not even inside a function. What puts a whole plan together from the stages' own declarations
(``ktflow plan``, and ``ktflow doctor --recipe``'s check with the SFT stage's sizing) is
:mod:`ktflow.plan`, a layer above the stages. The preflight (:mod:`ktflow.resources`) and the plan
read the same declarations, so a plan says what the preflight will say.
"""
