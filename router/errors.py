"""OpenAI-format errors raised anywhere in the router and turned into HTTP responses in one place."""

from __future__ import annotations

from typing import Any

from tandem.contracts.protocol import openai_error


class RouterError(Exception):
    """An error the client sees: an HTTP status plus an OpenAI-format body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = openai_error(message, type_, param, code)
        self.headers = headers or {}

    @classmethod
    def from_body(cls, status: int, body: Any) -> RouterError:
        """Wrap an error a worker returned, keeping its body unchanged when it is OpenAI-shaped."""
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            err = cls(status, str(body["error"].get("message", "")))
            err.body = body
            return err
        return cls(status, f"worker error: {body!r}"[:500], "server_error")

    @property
    def message(self) -> str:
        return str(self.body["error"].get("message", ""))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param, code)


def no_worker(message: str, retry_after_s: int = 2) -> RouterError:
    """503 with Retry-After: nothing can serve right now, but it may soon (workers starting)."""
    return RouterError(
        503, message, "service_unavailable", None, "no_worker_available",
        headers={"Retry-After": str(retry_after_s)},
    )


def overloaded(retry_after_s: float, message: str = "every worker that could serve this request is busy"
               ) -> RouterError:
    """503 with Retry-After: the workers are alive but full (they said so with 429/503)."""
    wait = max(1, round(retry_after_s))
    return RouterError(
        503, f"{message}; retry after {wait} s.", "service_unavailable", None, "server_overloaded",
        headers={"Retry-After": str(wait)},
    )


def upstream_failed(message: str) -> RouterError:
    return RouterError(502, message, "server_error", None, "worker_failed")
