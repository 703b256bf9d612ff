"""Exception types of ktflow.

Every error a user can cause derives from :class:`InvalidInputError` (exit code 2) and
says what is wrong, where (file, field or tensor), and how to fix it. Anything else is a
:class:`KtflowError` (exit code 1).
"""

from __future__ import annotations


class KtflowError(Exception):
    """Base class of ktflow's own errors. The CLI exits with :attr:`exit_code`."""

    exit_code: int = 1


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


class HostRequirementError(InvalidInputError):
    """This host lacks something a stage needs (CPU ISA, GPUs, RAM, disk, toolchain)."""



class NoWorkerError(HostRequirementError):
    """A stage was dispatched to a work pool that no live worker serves."""


class PromotionGateError(KtflowError):
    """The tuned model did not gain what the recipe's promotion gate asks over the base model."""
