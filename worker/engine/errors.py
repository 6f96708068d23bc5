"""Request errors carry their HTTP status and OpenAI error fields, so the server maps them 1:1."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses; the server turns it into a 4xx/5xx OpenAI-format error
    (with Retry-After when `retry_after_s` says the refusal is temporary: a full queue)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


class ModelLoadError(RuntimeError):
    """The model folder is missing, unreadable or of an architecture the engine does not run."""
