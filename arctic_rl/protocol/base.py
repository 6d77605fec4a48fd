"""The two kinds of protocol model, and the error a protocol check raises.

* :class:`Strict` -- a body *we* define and send (most requests): an unknown key is refused, naming
  it, so a misspelt knob is an error instead of a silently ignored setting.
* :class:`Tolerant` -- a body we read from a server, or a request whose senders (the vendor's
  clients) add keys of their own: unknown keys are accepted and kept (``model_extra``), so an older
  reader keeps working against a newer writer.

The split follows Tinker's SDK (``StrictBase`` for requests, a lenient ``BaseModel`` for responses).
:class:`FieldError` is what the protocol's own checks (:func:`~.batches.validate_meta`,
:func:`~.generation.clean_sampling_params`) raise: the server answers it as a 400, the client as a
configuration error, both with the same field, allowed values and received value.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["FieldError", "Strict", "Tolerant"]


class Strict(BaseModel):
    """A model whose unknown keys are an error (``extra="forbid"``); non-finite numbers are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Tolerant(BaseModel):
    """A model that accepts and keeps unknown keys (``extra="allow"``)."""

    model_config = ConfigDict(extra="allow")


class FieldError(ValueError):
    """A protocol value refused: ``field`` (dotted), the ``allowed`` values and what was ``received``."""

    def __init__(self, field: str, message: str, *, allowed: Any = None, received: Any = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.allowed = allowed
        self.received = received
