"""Typed errors. Every message names the field and the offending value(s)."""


class EngramServeError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(EngramServeError, ValueError):
    """A config file or dataclass field is missing, unknown or out of range."""


class CheckpointMismatch(EngramServeError):
    """A checkpoint, its config and its tokenizer disagree."""


class InvalidRequest(EngramServeError, ValueError):
    """A request or one of its parameters is malformed; it never reaches the batch."""


class SliceError(EngramServeError):
    """A step-batch field has no slicing rule, or a split is out of range."""


class StaticBufferError(EngramServeError):
    """A static (graph) buffer was asked for a different shape or dtype."""


class OwnershipError(EngramServeError):
    """A buffer owned by one microbatch was touched by another."""


class EngineFailed(EngramServeError, RuntimeError):
    """The engine stopped on a fatal error (e.g. a tensor-parallel worker died); the server shut down."""
