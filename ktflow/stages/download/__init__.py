"""The download stage: fetch the base checkpoint, verify every byte, publish it atomically.

Three kinds of source (``SourceConfig`` sets exactly one):

* **Hub** (``repo_id``): the revision is resolved to a commit sha first, and everything after
  that is pinned to the sha, so a branch that moves mid-download cannot mix two commits. The
  file listing (sizes, LFS sha256, git blob ids) drives a free-disk preflight and the final
  verification; ``huggingface_hub.snapshot_download`` does the transfer into the stage's
  deterministic staging directory, so a rerun after a crash skips every file that finished.
  Output: ``store_root/weights/<owner>--<name>@<sha>/`` (plus ``+<patterns-digest>`` when
  ``allow_patterns`` selects a subset, so two subsets of one commit never overwrite each other).
* **Local / NFS path** (``local_path``): nothing is copied. The directory's identity is every
  file's size plus a sampled sha256 (first, middle and last MiB), and a small reference
  artifact ``weights/local-<digest>/manifest.json`` points back at the source.
* **fsspec URI** (``uri``: ``s3://``, ``gs://``, ``file://``, ``memory://``, ...): copied with
  fsspec into staging (resuming partial files), sizes verified, sha256 recorded, published
  as ``weights/uri-<digest>/``.

Secrets: the hub token comes from the ``token`` argument or ``HF_TOKEN``. It is passed to
huggingface_hub and nowhere else: it is not logged, not written to the manifest, not in
:class:`DownloadResult`, and scrubbed from every message this module builds.

This module never imports Prefect; the Prefect task around it adds caching and artifacts.

Modules: ``hub.py``, ``local.py`` and ``uri.py`` (one per source kind, each a StageSpec), ``common.py``
(what they share: request, result, needs, retries, error translation), ``stage.py``
(:func:`download_checkpoint`, which picks the source's spec). The names callers use are re-exported.
"""

from ktflow.stages.download.common import DownloadRequest, DownloadResult, DownloadSizes, download_needs
from ktflow.stages.download.hub import resolve_revision
from ktflow.stages.download.stage import download_checkpoint

__all__ = ["DownloadRequest", "DownloadResult", "DownloadSizes", "download_checkpoint", "download_needs",
           "resolve_revision"]
