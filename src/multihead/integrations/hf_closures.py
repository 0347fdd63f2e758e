"""Which of ``transformers``' mask closures `multihead` reads as structure, checked against
``transformers`` itself.

``transformers.masking_utils`` describes a mask as closures built by a few factories
(``sliding_window_overlay(w)``, ``and_masks(...)``, ...). :mod:`multihead.integrations.hf_masks`
recognises a closure by its code object and reads it as the mask object that means the same. A
code object tells which factory built a closure, not what the closure computes: a later
``transformers`` may keep a factory's name and change its rule (a window one key wider) or the
variables its closure holds. So the table of kinds is built from the ``transformers`` installed,
and every kind is *probed* once per process: small masks built with its factory are read as
structure and compared with what ``transformers`` itself evaluates for them (``sdpa_mask``).

=================================================  =============================================
what is found                                      what happens
=================================================  =============================================
a kind whose probe agrees                          read as structure (band, documents, padding)
a kind whose probe disagrees or fails              left out: read densely, one warning
a factory missing from the installed version       nothing to read (it builds no closure)
a ``masking_utils`` closure of no known kind       read densely, one warning (a new factory)
a known kind whose closure has other variables     read densely, one warning
a model's own closure (not ``masking_utils``)      read densely, no warning: what dense is for
=================================================  =============================================

"Read densely" is ``transformers``' own evaluation of the closure into a bool tensor: the same
mask, without the structure that lets a backend skip blocks. The warnings name the closure and the
``transformers`` version, once per closure per process (:class:`UntestedTransformersWarning`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import CodeType
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["UntestedTransformersWarning", "closure_variables", "evaluate", "kind_of", "known_kinds", "unread"]

MaskFunction = Callable[..., Any]  # HF's mask_function(batch_idx, head_idx, q_idx, kv_idx) -> bool tensor
MODULE = "transformers.masking_utils"
TESTED = ">=5.23,<6"  # the 'hf' extra's range: `make test-compat` runs the integration at both ends


class UntestedTransformersWarning(UserWarning):
    """``transformers`` differs from what this version of `multihead` was tested with: a version
    outside :data:`TESTED` (``register()``), or a mask closure read densely (correct, slower)
    because its kind is unknown or its factory now follows another rule."""


class Frame(NamedTuple):
    """A call a mask is read for: ``B``, ``Lq``, ``Lk`` and HF's absolute offsets."""

    batch: int
    q_len: int
    kv_len: int
    q_offset: int
    kv_offset: int
    use_vmap: bool = False
    device: torch.device | str = "cpu"


# The frames every probe is read in: a prefill, a chunk after a dynamic cache, a part-filled
# static cache (keys past the queries) and a window of a cache that dropped its first keys.
_FRAMES = (Frame(2, 9, 9, 0, 0), Frame(2, 3, 9, 6, 0), Frame(2, 2, 9, 3, 0), Frame(2, 3, 6, 7, 4))
_PREFILL = _FRAMES[:1]  # packed documents: HF builds them only without a cache


# kind -> (its factory in masking_utils, one closure made by that factory: any arguments, only the
# code object is read from it)
_FACTORIES: dict[str, tuple[str, Callable[[Any, Any], MaskFunction]]] = {
    "and": ("and_masks", lambda make, mu: make(mu.causal_mask_function)),
    "or": ("or_masks", lambda make, mu: make(mu.causal_mask_function)),
    "causal": ("causal_mask_function", lambda fn, mu: fn),
    "full": ("bidirectional_mask_function", lambda fn, mu: fn),
    "window": ("sliding_window_overlay", lambda make, mu: make(1)),
    "window_both": ("sliding_window_bidirectional_overlay", lambda make, mu: make(1)),
    "chunks": ("chunked_overlay", lambda make, mu: make(1, torch.zeros(1, dtype=torch.long))),
    "padding": ("padding_mask_function", lambda make, mu: make(torch.zeros(1, 1, dtype=torch.long))),
    "packed": ("packed_sequence_mask_function", lambda make, mu: make(torch.zeros(1, 1, dtype=torch.long))),
    "remap": (
        "remap_positions_for_packed_sequence",
        lambda make, mu: make(mu.causal_mask_function, torch.zeros(1, 1, dtype=torch.long)),
    ),
    "blocks": ("blockwise_overlay", lambda make, mu: make(torch.zeros(1, 1, dtype=torch.long))),
}


def _probes(mu: Any) -> list[tuple[str, Callable[[], MaskFunction], tuple[Frame, ...]]]:
    """``(kind, a mask using it, frames)``, in an order where each probe uses only the kinds
    probed before it besides its own (``and`` is probed with a causal part, ``causal`` first)."""
    f = mu.causal_mask_function
    left_padding = torch.tensor([0, 2])
    padding = torch.ones(2, 13, dtype=torch.bool)
    padding[1, :3] = False
    padding[0, 11:] = False
    blocks = torch.tensor([[-1, 0, 0, 0, 1, 1, -1, 2, 2, 2, 2, -1, -1], [0, 0, 0, 1, 1, 1, 1, 1, -1, -1, 3, 3, 3]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1], list(range(9))])
    packed = mu.find_packed_sequence_indices(positions)
    return [
        ("causal", lambda: f, _FRAMES),
        ("full", lambda: mu.bidirectional_mask_function, _FRAMES),
        ("window", lambda: mu.sliding_window_overlay(3), _FRAMES),
        ("window_both", lambda: mu.sliding_window_bidirectional_overlay(2), _FRAMES),
        ("and", lambda: mu.and_masks(f, mu.sliding_window_overlay(3)), _FRAMES),
        ("or", lambda: mu.or_masks(f, mu.sliding_window_bidirectional_overlay(1)), _FRAMES),
        ("chunks", lambda: mu.and_masks(f, mu.chunked_overlay(3, left_padding)), _FRAMES),
        ("padding", lambda: mu.padding_mask_function(padding), _FRAMES),
        ("blocks", lambda: mu.or_masks(f, mu.blockwise_overlay(blocks)), _FRAMES),
        ("packed", lambda: mu.packed_sequence_mask_function(packed), _PREFILL),
        (
            "remap",
            lambda: mu.and_masks(
                mu.remap_positions_for_packed_sequence(f, positions), mu.packed_sequence_mask_function(packed)
            ),
            _PREFILL,
        ),  # fmt: skip
    ]


_KNOWN: dict[CodeType, str] = {}
_BUILT = False


def known_kinds(read: Callable[[MaskFunction, Frame], Any]) -> dict[CodeType, str]:
    """The code object of every closure kind this process reads as structure -> its kind.

    Built once from the installed ``transformers``; ``read(fn, frame)`` is the reader under test
    (:func:`multihead.integrations.hf_masks.read`: a mask object or ``None``). A kind whose probe
    disagrees with ``transformers``' own evaluation, or raises, is left out with a warning.
    """
    global _BUILT
    if _BUILT:
        return _KNOWN
    from transformers import masking_utils as mu

    for kind, (name, make) in _FACTORIES.items():
        try:
            _KNOWN[make(getattr(mu, name), mu).__code__] = kind
        except (AttributeError, TypeError):  # a factory this version does not have (or of other arguments)
            continue
    _BUILT = True  # the probes read through this table
    for kind, probe, frames in _probes(mu):
        if kind not in _KNOWN.values():
            continue
        try:
            fn = probe()
            agrees = all(_agrees(read, fn, frame) for frame in frames)
        except Exception as error:  # noqa: BLE001 - any failure of a probe means: do not trust the kind
            agrees, why = False, f"probing it raised {type(error).__name__}: {error}"
        else:
            why = "its mask differs from what transformers evaluates for it"
        if not agrees:
            for code in [c for c, k in _KNOWN.items() if k == kind]:
                del _KNOWN[code]
            _warn(f"the factory of {kind!r} closures ({_factory_name(kind)})", f"{why}; read densely from now on")
    return _KNOWN


def forget() -> None:
    """Build the table again at the next read (tests replace ``transformers``' factories)."""
    global _BUILT
    _KNOWN.clear()
    _BUILT = False
    _warned.cache_clear()


def kind_of(fn: object, read: Callable[[MaskFunction, Frame], Any]) -> str | None:
    """The kind of ``fn`` (``None``: not a closure this process reads as structure)."""
    code = getattr(fn, "__code__", None)
    return known_kinds(read).get(code) if isinstance(code, CodeType) else None


def closure_variables(fn: MaskFunction) -> dict[str, Any]:
    """The variables a closure holds, by name."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))


def unread(fn: MaskFunction, why: str) -> None:
    """``fn`` is about to be read densely: warn once if it is one of ``transformers``' own closures."""
    if getattr(fn, "__module__", None) == MODULE:
        _warn(f"the mask closure {MODULE}.{getattr(fn, '__qualname__', fn)!r}", f"{why}; read densely")


def evaluate(fn: MaskFunction, frame: Frame) -> Tensor:
    """``fn`` evaluated by ``transformers`` itself (``sdpa_mask``, neither of its skips):
    ``(B|1, 1, Lq, Lk)`` bool, ``True`` = may attend. The meaning of any closure, without its
    structure: how a closure this module does not trust is read, and what a probe compares with."""
    from transformers.masking_utils import sdpa_mask

    table = sdpa_mask(
        batch_size=frame.batch,
        q_length=frame.q_len,
        kv_length=frame.kv_len,
        q_offset=frame.q_offset,
        kv_offset=frame.kv_offset,
        mask_function=fn,
        attention_mask=None,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=frame.use_vmap,
        device=frame.device,
    )
    if table is None:  # "nothing blocked" (not expected: both of HF's skips are off)
        table = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=frame.device)
    return table


def _agrees(read: Callable[[MaskFunction, Frame], Any], fn: MaskFunction, frame: Frame) -> bool:
    shape = (frame.batch, 1, frame.q_len, frame.kv_len)
    expected = evaluate(fn, frame).expand(shape)
    mask = read(fn, frame)
    got = torch.ones(shape, dtype=torch.bool) if mask is None else mask.materialize(*shape).expand(shape)
    return torch.equal(got, expected)


def _factory_name(kind: str) -> str:
    return f"{MODULE}.{_FACTORIES[kind][0]}"


def _warn(what: str, why: str) -> None:
    _warned(what, why)


@functools.cache
def _warned(what: str, why: str) -> None:
    import transformers

    warnings.warn(
        f"multihead.integrations.hf: {what} of transformers {transformers.__version__} is not one this "
        f"version of multihead reads ({why}: correct, slower). Tested with transformers{TESTED}; "
        f"please report it with your transformers version",
        UntestedTransformersWarning,
        stacklevel=4,
    )
