"""Reading a server's answer through its model in :mod:`arctic_rl.protocol`.

:func:`parse_answer` validates a decoded answer with the protocol's (tolerant) response model; a
missing or mistyped field is a :class:`~verl.remote_backend.errors.RemoteProtocolError` naming the
field, what the model allows and what came -- never a ``KeyError`` deep in a role module.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from verl.remote_backend.errors import RemoteProtocolError

__all__ = ["parse_answer"]

M = TypeVar("M", bound=BaseModel)


def parse_answer(model: type[M], value: Any, endpoint: str) -> M:
    """``value`` read with the protocol's response ``model`` (see the module docstring)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ())) or "(the answer)"
        raise RemoteProtocolError(endpoint, f"{field}: {first.get('msg')} ({model.__name__}); received "
                                  f"{str(first.get('input'))[:200]}") from None
