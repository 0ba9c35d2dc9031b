"""Project error classes.

Every failure the user can act on is raised as a subclass of :class:`PartitionerError`. The CLI
turns one into a single line on stderr and the class's ``exit_code`` (2: bad input or usage,
1: a run failed or results mismatched), with no traceback unless ``--debug`` is given.
"""

from __future__ import annotations


class PartitionerError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code: int = 2


class UsageError(PartitionerError):
    """Bad command-line usage or bad option values."""


class ModelLoadError(PartitionerError):
    """The model file cannot be read or is not a valid, safe ONNX model."""


class UnsupportedOpError(ModelLoadError):
    """One or more operators are not supported. The message lists all of them with node names."""

    def __init__(self, message: str, ops: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.ops = list(ops or [])


class ClusterError(PartitionerError):
    """A cluster description (file or preset) is invalid."""


class PassError(PartitionerError):
    """A graph pass failed or left a graph that does not verify."""


class DataDependentShapeError(UnsupportedOpError, PassError):
    """A graph cannot get static shapes because some nodes make shapes from input *values*
    (Unique, a Range with run-time bounds, an If whose branches differ, ...). A refusal that names
    those nodes (an :class:`UnsupportedOpError`), raised where a pass found it (a :class:`PassError`)."""


class VerifyError(PartitionerError):
    """A graph, plan or per-rank program breaks an invariant."""


class PlanError(PartitionerError):
    """A plan cannot be built or is inconsistent."""


class StrategyNotApplicable(PlanError):
    """A strategy does not apply to a model. The message says why, in one line."""


class BackendError(PartitionerError):
    """A backend could not build or run a per-rank program."""


class UnsupportedByBackendError(BackendError):
    """Before anything is built, the backend lists ops or dtypes it does not support (a clean
    refusal: nothing failed). Every other BackendError is a failure of the build or the run."""


class ArtifactError(PartitionerError):
    """An artifact directory is missing files, tampered with, or of another format version."""


class InputError(PartitionerError):
    """Run-time inputs (an .npz file) do not match the model's bindings."""


class RunFailed(PartitionerError):
    """A distributed run failed on some rank, or outputs did not match the reference."""

    exit_code = 1
