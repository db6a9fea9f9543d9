"""What the controller answers a request its state does not allow."""

from __future__ import annotations


class ControllerError(Exception):
    """A request the state does not allow (409), or for an unknown kernel (404)."""

    def __init__(self, status: int, message: str, retryable: bool = True):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retryable = retryable
