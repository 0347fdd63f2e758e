"""The backend registry and the ``auto`` choice.

``auto`` takes the first backend, in :data:`AUTO_ORDER`, that raises no refusal. The order is a
decision table kept in one place (rationale in ``docs/performance.md``). Forcing a backend that
refuses a call raises an error that lists its reasons. No environment variable changes this.
"""

from __future__ import annotations

from multihead.backends.base import Backend
from multihead.validation import AttentionCall

__all__ = ["register_backend", "get_backend", "available_backends", "select_backend", "BackendRefusedError"]

_REGISTRY: dict[str, Backend] = {}
#: The order ``auto`` tries backends in: fastest general path first, the oracle last.
AUTO_ORDER: list[str] = []


class BackendRefusedError(ValueError):
    """A forced backend cannot serve the call; the message lists why."""


def register_backend(backend: Backend, *, auto_rank: int | None = None) -> Backend:
    """Add ``backend``; ``auto_rank`` places it in the ``auto`` order (``None``: never automatic)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend expects a multihead Backend, got {type(backend).__name__}")
    _REGISTRY[backend.name] = backend
    if backend.name in AUTO_ORDER:
        AUTO_ORDER.remove(backend.name)
    if auto_rank is not None:
        AUTO_ORDER.insert(min(auto_rank, len(AUTO_ORDER)), backend.name)
    return backend


def available_backends() -> list[str]:
    """Names of the registered backends."""
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: 'auto', "
                         + ", ".join(repr(n) for n in _REGISTRY))
    return _REGISTRY[name]


def check_backend_name(name) -> None:
    if name != "auto":
        get_backend(name)


def select_backend(call: AttentionCall, name: str = "auto") -> tuple[Backend, dict[str, list[str]]]:
    """The backend that runs ``call``, and the refusals of every backend considered."""
    if name != "auto":
        backend = get_backend(name)
        reasons = backend.refusals(call)
        if reasons:
            raise BackendRefusedError(f"backend {name!r} cannot serve this call: " + "; ".join(reasons)
                                      + ". Use backend='auto' or see multihead.explain(...)")
        return backend, {}
    refused: dict[str, list[str]] = {}
    for candidate in AUTO_ORDER:
        backend = _REGISTRY[candidate]
        # auto_refusals: the decision table, reasons to prefer a later backend although this one
        # could serve the call (measured; docs/performance.md). Forcing a backend ignores them.
        reasons = backend.refusals(call) or backend.auto_refusals(call)
        if not reasons:
            return backend, refused
        refused[candidate] = reasons
    raise BackendRefusedError("no backend can serve this call: "
                              + "; ".join(f"{n}: {', '.join(r)}" for n, r in refused.items()))
