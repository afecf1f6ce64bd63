"""kvmesh's exception hierarchy: one base, a few meaningful kinds.

Every error a client or operator can see carries a message that says what was
wrong; the API maps each kind to an HTTP status and an OpenAI-style error body.
"""

from __future__ import annotations


class KVMeshError(Exception):
    """Base of every error kvmesh raises on purpose."""

    status = 500
    code = "internal_error"
    type = "server_error"


class InvalidRequest(KVMeshError):
    """The request was understood but its values are not acceptable."""

    status = 400
    code = "invalid_request"
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code:
            self.code = code


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus the tokens asked for) does not fit the model's context."""

    code = "context_length_exceeded"


class ModelNotFound(KVMeshError):
    status = 404
    code = "model_not_found"
    type = "invalid_request_error"


class Overloaded(KVMeshError):
    """No slot freed up in time, or the wait queue is full. Retry later."""

    status = 429
    code = "overloaded"
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unauthorized(KVMeshError):
    """A missing or wrong admin token or mesh secret."""

    status = 401
    code = "unauthorized"
    type = "authentication_error"


class NotFound(KVMeshError):
    """An unknown host or session named by an operator action, or a stored response not found (`param` names the
    field that named it, as OpenAI's previous_response_not_found does)."""

    status = 404
    code = "not_found"
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code:
            self.code = code


class Conflict(KVMeshError):
    """An operator action that cannot be carried out now (the host did not answer, no target)."""

    status = 409
    code = "conflict"
    type = "invalid_request_error"


class ImportRefused(KVMeshError):
    """A KV import was refused (fingerprint, hash chain, size): nothing was imported."""

    status = 409
    code = "import_refused"
    type = "invalid_request_error"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ConfigError(KVMeshError):
    """A configuration file or flag is invalid; the message names the field."""


class CheckpointError(ConfigError):
    """A model checkpoint directory cannot be served: a file is missing or unreadable, or
    its architecture or options are not supported. The message names the file."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path
