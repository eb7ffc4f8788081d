"""Typed errors. Every message names the field and the offending value(s)."""


class EngramServeError(Exception):
    """Base class of every error this package raises on purpose."""


class UsageError(EngramServeError, ValueError):
    """A bad command line: an option unknown, or its value out of range (the message names it)."""


class ConfigError(EngramServeError, ValueError):
    """A config file or dataclass field is missing, unknown or out of range."""


class CheckpointMismatch(EngramServeError):
    """A checkpoint, its config and its tokenizer disagree."""


class InvalidRequest(EngramServeError, ValueError):
    """A request or one of its parameters is malformed; it never reaches the batch.

    `param` is the request field at fault, as the request names it ("max_tokens", "stop",
    "prompt"), or None when no single field is; the server's error body carries it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keep `param` through pickling (tensor-parallel ranks)
        return type(self), (str(self), self.param)


class QueueFull(InvalidRequest):
    """The scheduler's waiting queue is at its limit; the request was refused, retry later."""


class SliceError(EngramServeError):
    """A step-batch field has no slicing rule, or a split is out of range."""


class StaticBufferError(EngramServeError):
    """A static (graph) buffer was asked for a different shape or dtype."""


class OwnershipError(EngramServeError):
    """A buffer owned by one microbatch was touched by another."""


class EngineFailed(EngramServeError, RuntimeError):
    """The engine stopped on a fatal error (e.g. a tensor-parallel worker died); the server shut down."""
