"""Error types raised by edgespec.

Every error a user can cause (a bad file, a bad setting, a bad request) is an ``EdgespecError`` whose message
names the file, key or value at fault. The CLI prints such errors on one line and exits non-zero; the server
maps them to OpenAI-shaped 4xx responses. Anything else escaping is a bug.
"""

from __future__ import annotations


class EdgespecError(Exception):
    """Base class of every user-facing edgespec error."""


class ConfigError(EdgespecError, ValueError):
    """A setting is unknown, has the wrong type, or is out of range."""


class CheckpointError(EdgespecError):
    """A checkpoint folder, config, weight file or tokenizer is missing, truncated or does not fit the model."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable but its architecture is not one edgespec runs."""


class RequestError(EdgespecError, ValueError):
    """A generation request is invalid (prompt too long, sampling parameter out of range, ...)."""


class PromptTooLongError(RequestError):
    """The prompt plus the requested tokens do not fit the configured maximum sequence length."""


class ImageError(RequestError):
    """An image a request sent cannot be served: undecodable, over a limit, too many, a remote URL, or a model
    without a vision tower. ``param``: the request field it came from (``messages[1].content[0]``), when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
