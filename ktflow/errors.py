"""Every exception type of ktflow, in one place (as huggingface_hub's ``errors.py``).

Two families, told apart by the CLI's exit code:

- :class:`InvalidInputError` (exit 2): bad input a user can fix (a recipe, checkpoint, dataset,
  adapter, argument or host that cannot work), found before heavy work. Each says what is wrong,
  where (file, field or tensor), and how to fix it.
- :class:`KtflowError` (exit 1): anything else that stopped a stage once it had started.

Where a caller would reasonably catch a built-in, ours subclass it too: :class:`StorageError` is
an ``OSError`` (with ``errno``), :class:`ToolTimeout` a ``TimeoutError``. :class:`InvalidInputError`
is deliberately not a ``ValueError``: pydantic turns a ``ValueError`` raised inside a validator
into a ``ValidationError``, which would hide the field, value and fix these carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

TAIL_SHOWN = 15  # a failed tool's last output lines shown in its error


class KtflowError(Exception):
    """Base class of ktflow's own errors. The CLI exits with :attr:`exit_code`."""

    exit_code: int = 1


# --------------------------------------------------------------------------- bad input (exit 2)


class InvalidInputError(KtflowError):
    """Bad input: a recipe, checkpoint, dataset, adapter, argument or host that cannot work.

    Args:
        subject: what is wrong, as a user would find it: ``"recipe.yaml: sft.lora_rank"``,
            ``"model-00002-of-00004.safetensors: tensor 'x.weight'"``.
        reason: what is wrong with it, including the offending value.
        fix: what to do about it. Optional but strongly encouraged.
    """

    exit_code = 2

    def __init__(self, subject: str, reason: str, fix: str | None = None) -> None:
        self.subject = subject
        self.reason = reason
        self.fix = fix
        message = f"{subject}: {reason}"
        if fix:
            message += f" Fix: {fix}"
        super().__init__(message)


class RecipeError(InvalidInputError):
    """The recipe (file or ``--set`` override) is invalid."""


class CheckpointError(InvalidInputError):
    """A checkpoint directory is malformed, truncated or in an unsupported format."""


class DatasetError(InvalidInputError):
    """A dataset file or record cannot be used for training or evaluation."""


class AdapterError(InvalidInputError):
    """A LoRA adapter does not match its base model or is internally inconsistent."""


class SourceAccessError(InvalidInputError):
    """The source cannot be read as named: repo, revision or file not found, or no access."""


class HostRequirementError(InvalidInputError):
    """This host lacks something a stage needs (CPU ISA, GPUs, RAM, disk, toolchain)."""


class InsufficientDiskError(HostRequirementError):
    """A filesystem has less free space than a stage still has to write there (exit 2, before any work).

    ``need`` is what was asked for (margin included), ``free`` what the filesystem has.
    """

    def __init__(self, subject: str, reason: str, fix: str | None = None, *, need: int, free: int) -> None:
        self.need = need
        self.free = free
        super().__init__(subject, reason, fix)


class NoWorkerError(HostRequirementError):
    """A stage was dispatched to a work pool that no live worker serves."""


# --------------------------------------------------------------------------- failures once started (exit 1)


class StorageError(KtflowError, OSError):
    """Writing an artifact failed because of its filesystem: full, over quota, read-only or not
    writable (exit 1: the stage had started; what it finished stays in staging for the rerun)."""

    def __init__(self, message: str, *, path: Path, errno_: int | None = None) -> None:
        super().__init__(message)
        self.path = Path(path)
        self.errno = errno_


class ArtifactBusyError(KtflowError):
    """Another process holds the artifact's lock and the caller asked not to wait."""


class ArtifactStoreError(KtflowError):
    """The artifact store (the URL what crosses hosts travels through) cannot be reached or written."""


class ArtifactNotPublishedError(InvalidInputError):
    """No complete artifact (its transfer manifest) is published under the key asked for."""


class ArtifactCorruptError(ArtifactStoreError):
    """A fetched object's size or sha256 differs from its transfer manifest (corrupt or truncated)."""


class DownloadError(KtflowError):
    """The download could not complete: the source kept failing, or bytes did not verify."""


class ChecksumMismatchError(DownloadError):
    """Downloaded files whose size or hash differs from what the source lists.

    The bad files have been deleted, so rerunning the stage fetches them again.
    ``mismatches`` holds ``(path, what, expected, actual)`` tuples.
    """

    def __init__(self, mismatches: list[tuple[str, str, str, str]]) -> None:
        self.mismatches = mismatches
        lines = [f"{path}: {what} expected {expected}, got {actual}" for path, what, expected, actual in mismatches]
        super().__init__(
            f"{len(mismatches)} downloaded file(s) failed verification and were deleted "
            f"(rerun the stage to fetch them again): " + "; ".join(lines)
        )


class ToolOutputError(KtflowError):
    """A tool (trainer, server, driver) failed; the message ends with its last output lines.

    Attributes:
        tail: its last output lines.
        log_path: its full output, when it was written to a file.
    """

    def __init__(self, message: str, tail: Sequence[str] = (), log_path: Path | None = None) -> None:
        self.tail = list(tail)
        self.log_path = log_path
        where = f" (full log: {log_path})" if log_path else ""
        shown = "\n    ".join(self.tail[-TAIL_SHOWN:])
        super().__init__(f"{message}{where}" + (f"; last lines:\n    {shown}" if shown else ""))


class ToolError(ToolOutputError):
    """A tool exited with a non-zero status."""

    def __init__(self, argv: Sequence[str], returncode: int, tail: Sequence[str], log_path: Path | None) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        super().__init__(f"{Path(argv[0]).name} exited with status {returncode}", tail, log_path)


class ToolTimeout(KtflowError, TimeoutError):
    """A tool ran past its time limit and was stopped."""


class ServerStartError(ToolOutputError):
    """The server exited, timed out, or failed its health gate or smoke test while starting."""


class SwapError(KtflowError):
    """A new adapter failed to serve. ``rolled_back`` says whether the previous one serves again."""

    def __init__(self, message: str, *, rolled_back: bool) -> None:
        self.rolled_back = rolled_back
        super().__init__(message)


class EvaluationError(KtflowError):
    """Requests to the endpoint failed during evaluation."""


class OfflineGenerationError(ToolOutputError):
    """The offline generation driver failed (or ran past its time limit); nothing was returned."""


class PromotionGateError(KtflowError):
    """The tuned model did not gain what the recipe's promotion gate asks over the base model."""


class StageFailedError(KtflowError):
    """A dispatched stage's child run ended in a state other than Completed."""
