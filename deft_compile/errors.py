"""Exceptions raised by deft_compile. Each one names the cause so a user can act on it."""

from __future__ import annotations


class DeftError(RuntimeError):
    """Base class of every error deft_compile raises on purpose."""


class UnsupportedOptimizerError(DeftError):
    """The optimizer's update is not per-parameter and element-wise, so it cannot be bucketed or delayed."""


class TraceError(DeftError):
    """The training step could not be captured into one FX graph (names the op and the module)."""


class LossError(DeftError):
    """The step did not produce a scalar loss."""


class ModelMismatchError(DeftError):
    """Ranks hold different models, optimizers or plans; training would silently diverge."""


class PeerFailureError(DeftError):
    """A collective failed or timed out; the message names the ranks that did not answer."""


class TornCheckpointError(DeftError):
    """A checkpoint that was not completely written (a save interrupted by a failure, a truncated copy)."""


class ModelChangedError(DeftError):
    """The model's parameters changed after ``deft_compile()`` (cast, moved, replaced, frozen or unfrozen)."""


class InputChangeError(DeftError):
    """A step failed on tensor inputs whose dtype or device changed since the last step that ran; names them."""


class NetnsError(RuntimeError):
    """Creating, shaping, entering or deleting a network namespace, or binding gloo to an interface, failed;
    the message names the command or interface and the error."""
