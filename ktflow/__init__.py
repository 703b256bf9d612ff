"""ktflow: the engine behind the KTransformers fine-tune-and-serve pipeline.

Plain, typed Python that never imports Prefect (only the command line starts flows). The Prefect
tasks in ``tasks/`` and flows in ``flows/`` are thin wrappers around the functions here.

The core, which every package below may import:

- ``errors.py``: every exception type (exit 2 for bad input, 1 otherwise). ``units.py``: GiB, GB and
  how sizes are written.
- ``recipe/``: the Recipe model, one pydantic model per concept (a module per section): load, override,
  validate.
- ``resources.py``: stage names, what a stage needs of a host, the shortfall wording, the preflight.
- ``runner.py``: the stage runner (``StageSpec``, ``run_stage``): refuse, cache, lock, preflight,
  staging, work, verify, publish, progress.
- ``store.py``: where artifacts live (``StoreLayout``, ``HostStore``: one host's store root against the
  recipe's) and their atomic publication with manifests.
- ``artifact_store.py``: what crosses hosts (the SFT adapter), published to a URL and fetched verified.
- ``registry.py``: adapter versions, their lineage and the production pointer.

The packages, each with a docstring that maps its modules: ``formats/`` (file formats), ``host/``
(hardware, pools, workers, processes), ``planning/`` (which stages, their cost), ``stages/`` (one
module or package per stage), ``fixtures/`` (checkpoints made locally), ``_drivers/`` (programs run
inside the toolchains). On top: ``cli/`` (a module per command group), ``demo.py``, ``run_report.py``,
``recipe_deployments.py``.
``tests/test_layers.py`` keeps who imports whom as stated.
"""

__version__ = "0.1.0"

# Bumped whenever an engine change alters what a stage writes. It is part of every
# stage's cache key, so a converter fix invalidates cached artifacts even when the
# task function's own source is unchanged (Prefect's TASK_SOURCE misses helpers).
ENGINE_VERSION = "1"
