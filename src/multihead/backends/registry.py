"""The backend registry and the ``auto`` choice.

``auto`` takes the first backend, in :data:`AUTO_ORDER`, that raises no refusal. The order comes
from the explicit ``priority`` each backend is registered with (lower first; never the import
order), a decision table kept in one place (rationale in ``docs/performance.md``). Forcing a backend that
refuses a call raises an error that lists its reasons. No environment variable changes this.
"""

from __future__ import annotations

from typing import cast

import torch

from multihead import plans
from multihead.backends.base import Backend
from multihead.call import AttentionCall

__all__ = [
    "register_backend",
    "unregister_backend",
    "get_backend",
    "available_backends",
    "select_backend",
    "BackendRefusedError",
    "AUTO_ORDER",
]

_REGISTRY: dict[str, Backend] = {}
_PRIORITY: dict[str, int] = {}
#: The order ``auto`` tries backends in (by priority): fastest general path first, the oracle last.
AUTO_ORDER: list[str] = []


class BackendRefusedError(ValueError):
    """A forced backend cannot serve the call; the message lists why."""


def register_backend(backend: Backend, *, priority: int | None = None) -> Backend:
    """Add ``backend`` (replacing one of the same name). ``priority`` places it in the ``auto``
    order, lower first (ties by name); ``None``: never chosen automatically, only by name."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend expects a multihead Backend, got {type(backend).__name__}")
    if backend.name == "auto" or not isinstance(backend.name, str) or not backend.name:
        raise ValueError(
            f"register_backend: a backend cannot be named {backend.name!r}; 'auto' means "
            "'let the dispatcher choose' and a name must be a non-empty str"
        )
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise TypeError(f"register_backend: priority must be an int or None, got {priority!r}")
    _REGISTRY[backend.name] = backend
    _PRIORITY.pop(backend.name, None)
    if priority is not None:
        _PRIORITY[backend.name] = priority
    _order()
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove a registered backend (and its place in the ``auto`` order); returns it."""
    backend = get_backend(name)
    del _REGISTRY[name]
    _PRIORITY.pop(name, None)
    _order()
    return backend


def _order() -> None:
    AUTO_ORDER[:] = sorted(_PRIORITY, key=lambda n: (_PRIORITY[n], n))
    plans.clear()  # a stored plan names the backend auto chose among the old ones


def available_backends() -> list[str]:
    """Names of the registered backends."""
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``; ``ValueError`` listing the known names otherwise."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: 'auto', " + ", ".join(repr(n) for n in _REGISTRY))
    return _REGISTRY[name]


def check_backend_name(name: object) -> None:
    """Raise ``ValueError`` unless ``name`` is ``"auto"`` or a registered backend's name."""
    if name != "auto":
        get_backend(cast(str, name))  # get_backend refuses what is not a str, naming the backends


def select_backend(call: AttentionCall, name: str = "auto") -> tuple[Backend, dict[str, list[str]]]:
    """The backend that runs ``call``, and the refusals of every backend considered."""
    if name != "auto":
        backend = get_backend(name)
        reasons = backend.refusals(call)
        if reasons:
            raise BackendRefusedError(
                f"backend {name!r} cannot serve this call: "
                + "; ".join(reasons)
                + ". Use backend='auto' or see multihead.explain(...)"
            )
        return backend, {}
    refused: dict[str, list[str]] = {}
    compiling = torch.compiler.is_compiling()
    for candidate in AUTO_ORDER:
        backend = _REGISTRY[candidate]
        # auto_refusals: the decision table, reasons to prefer a later backend although this one
        # could serve the call (measured; docs/performance.md). Forcing a backend ignores them.
        # Under torch.compile a backend that does not trace into one graph is passed over too.
        if compiling and not backend.capabilities.compiles:
            refused[candidate] = [f"under torch.compile: {backend.capabilities.compile_note}"]
            continue
        reasons = backend.refusals(call) or backend.auto_refusals(call)
        if not reasons:
            return backend, refused
        refused[candidate] = reasons
    raise BackendRefusedError(
        "no backend can serve this call: " + "; ".join(f"{n}: {', '.join(r)}" for n, r in refused.items())
    )
