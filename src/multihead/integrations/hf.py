"""`multihead` as a Hugging Face ``transformers`` attention implementation.

    import multihead.integrations.hf as mh_hf
    mh_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="multihead")
    model.set_attn_implementation("multihead")         # or switch a loaded model

:func:`register` registers two functions under one name, because ``transformers`` asks for two:

* the **mask function** (``AttentionMaskInterface``): called once per forward by the model's
  ``create_causal_mask`` / ``create_sliding_window_causal_mask`` / ``create_bidirectional_mask``
  with HF's mask description (a ``mask_function`` closure, the 2-D padding mask, the cache's
  offsets); it returns the `multihead` mask object (:mod:`multihead.integrations.hf_masks`) in
  an :class:`HFMask`, which the model hands unchanged to every attention layer. Without it
  ``transformers`` skips mask creation for an unknown name and every layer receives
  ``attention_mask=None``: causal masking silently gone.
* the **attention function** (``AttentionInterface``): called by every attention layer with
  ``(module, query, key, value, attention_mask, scaling=, dropout=, sliding_window=, softcap=,
  s_aux=, ...)``, in HF's layout ``(B, H, L, D)``, which is `multihead`'s; it runs
  :func:`multihead.attention` and returns ``(output (B, Lq, Hq, Dv), weights or None)``.

What arrives and how it is passed on:

==============================  ====================================================================
HF                              :func:`multihead.attention`
==============================  ====================================================================
GQA (``Hkv < Hq``)              ``k``, ``v`` as they are (no ``repeat_kv`` copies)
``scaling``                     ``scale=``
``dropout`` (0 in eval)         ``dropout_p=``
``softcap`` (Gemma 2)           ``softcap=``
``s_aux`` (gpt-oss sinks)       ``sinks=``
``position_bias`` (T5 style)    ``score_mod=scores.bias(position_bias)``
``output_attentions=True``      ``return_weights=True``: probabilities before dropout, sinks included
``HFMask`` (the mask function)  ``mask=`` its mask object (``None``: nothing blocked)
dense 4-D mask (a user's)       recognised (``hf_masks.from_dense``): band / documents / padding, or
                                the bool tensor; additive entries ``<= finfo.min / 2`` are blocked
``attention_mask=None``         the module's ``is_causal`` (as HF's ``sdpa`` reads it):
                                ``causal()`` (& ``sliding_window(w - 1)``), else no mask
==============================  ====================================================================

Hook points and captures: with the backend registered, each attention module of the model (those
it declares for ``output_attentions``, :mod:`multihead.integrations.hf_hooks`) has the hook points
of a `multihead` layer (``q``, ``k``, ``v``, ``scores``, ``pattern``, ``output``; names such as
``"model.layers.0.self_attn.pattern"``), and :func:`multihead.capture_attention` and the viewer's
recording read its weights: a watched call runs :func:`multihead.hooks.observed_attention`, an
unwatched one pays one dictionary lookup. ``docs/hooks.md`` shows it on MiniLM and Llama.

``sliding_window`` is part of the mask object when one arrives (HF builds it into the mask) and is
read only when none does. Continuous batching's paged cache (``cache=``) is refused.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

import torch
from torch import Tensor

import multihead
from multihead import scores
from multihead.backends.registry import check_backend_name
from multihead.call import AttentionResult
from multihead.capture import captures_of, is_capturing, register_layer_finder
from multihead.hooks import ATTRIBUTE as HOOKS
from multihead.hooks import observed_attention
from multihead.integrations.hf_closures import TESTED, MaskFunction, UntestedTransformersWarning
from multihead.integrations.hf_hooks import REGISTERED, attention_modules
from multihead.integrations.hf_masks import band_blocks_nothing, from_dense, from_mask_function
from multihead.layers.checks import check_flag
from multihead.masks import Mask, causal
from multihead.masks import sliding_window as sliding_window_mask
from multihead.nonfinite import check_finite_flag

__all__ = [
    "NAME",
    "HFMask",
    "UntestedTransformersWarning",
    "attention_forward",
    "mask_interface",
    "register",
    "unregister",
]

NAME = "multihead"


def register(
    name: str = NAME, *, backend: str = "auto", check_finite: bool = False, nonfinite_check: bool | None = None
) -> str:
    """Register ``name`` with ``transformers``' attention interface and its mask interface.

    ``backend`` is passed to every :func:`multihead.attention` call (``"auto"``, or a backend
    name such as ``"sdpa"`` or ``"reference"``), and so is ``check_finite``: apply `multihead`'s
    rules for NaN and infinite inputs (``docs/conventions.md``) inside the model too. Off by
    default, as for every call: a model then gives what ``transformers``' ``sdpa`` gives there.
    (``nonfinite_check=`` is its former name: it warns and means the same.) Registering again
    replaces the functions. Returns ``name``, for ``attn_implementation=register()``.

    From then on the attention modules of a model running ``name`` have hook points
    (:func:`multihead.hooks.hook_points`) and are recorded by :func:`multihead.capture_attention`.
    """
    _check_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_backend_name(backend)
    if nonfinite_check is not None:
        warnings.warn(
            "register(nonfinite_check=...) is now register(check_finite=...)", DeprecationWarning, stacklevel=2
        )
        check_finite = check_flag("register", "nonfinite_check", nonfinite_check)
    check_finite_flag("register", check_finite)
    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend, check_finite=check_finite))
    AttentionMaskInterface.register(name, mask_interface)
    REGISTERED.add(name)
    register_layer_finder("huggingface", attention_modules)
    return name


# What register() plugs into: a transformers without one of these cannot run a model on multihead.
_INTERFACES = (
    ("transformers", "AttentionInterface"),
    ("transformers.masking_utils", "AttentionMaskInterface"),
    ("transformers.masking_utils", "sdpa_mask"),  # reads the closures multihead does not know
    ("transformers.masking_utils", "causal_mask_function"),
)
_TESTED_RANGE = ((5, 23), (6, 0))  # TESTED as numbers


def _check_transformers() -> None:
    """Refuse, naming what is missing, a ``transformers`` without the interfaces this backend plugs
    into; warn outside the tested range (it then runs: mask closures this version does not know
    are read densely, see :mod:`multihead.integrations.hf_closures`)."""
    import transformers

    missing = []
    for module, name in _INTERFACES:
        try:
            found = getattr(importlib.import_module(module), name, None) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{name}")
    if missing:
        raise ImportError(
            f"multihead.integrations.hf: transformers {transformers.__version__} lacks {', '.join(missing)}, "
            f"which the backend registers with or reads masks through; it is tested with transformers{TESTED} "
            f"(pip install 'multihead[hf]')"
        )
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if not _TESTED_RANGE[0] <= version < _TESTED_RANGE[1]:
        warnings.warn(
            f"multihead.integrations.hf is tested with transformers{TESTED}, found {transformers.__version__}: "
            f"mask closures it does not know are read densely (correct, slower), with a warning naming each",
            UntestedTransformersWarning,
            stacklevel=3,
        )


def unregister(name: str = NAME) -> None:
    """Remove ``name`` from both interfaces (models already set to it stop working)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)
    REGISTERED.discard(name)


_NOT_A_TENSOR = (
    "multihead: this model {what} as a tensor, but with attn_implementation='multihead' the mask is "
    "an HFMask holding a multihead mask object (structure, not a 4-D tensor); models that edit or "
    "combine their masks themselves (Doge, Bloom, CodeGen, XGLM, MPT, ...) cannot run on it: use "
    "attn_implementation='sdpa' or 'eager' for this model"
)


class HFMask:
    """What :func:`mask_interface` returns and the model hands to its layers: the `multihead`
    mask of the call (``mask``; ``None`` when nothing is blocked), with the little of a 4-D
    tensor's interface that ``transformers`` reads on the way (``ndim``, ``shape``,
    ``contiguous()``: ``generate`` with a static cache builds the masks ahead and calls them).
    The attention function unwraps it; :func:`multihead.attention` receives ``mask``."""

    __slots__ = ("mask", "shape")
    ndim = 4

    def __init__(self, mask: Mask | None, shape: tuple[int, int, int, int]):
        self.mask, self.shape = mask, torch.Size(shape)  # (B, 1, Lq, Lk)

    def contiguous(self) -> HFMask:
        return self

    def __getattr__(self, name: str) -> Any:  # only for names HFMask lacks: a model using the mask as a tensor
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_NOT_A_TENSOR.format(what=f"reads its attention mask's .{name}"))

    def _refuse(self, *args: object) -> Any:
        raise TypeError(_NOT_A_TENSOR.format(what="computes with its attention mask"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = _refuse
    __getitem__ = __invert__ = _refuse

    def __repr__(self) -> str:
        return f"HFMask(shape={tuple(self.shape)}, mask={self.mask!r})"


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int | Tensor = 0,
    mask_function: MaskFunction | None = None,
    attention_mask: Tensor | HFMask | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> HFMask:
    """The mask function of the ``AttentionMaskInterface`` (the signature of HF's ``sdpa_mask``):
    HF's mask description -> an :class:`HFMask` holding the `multihead` mask object for
    ``Lq = q_length``, ``Lk = kv_length`` (``None`` inside when nothing is blocked). The other
    keywords HF passes (``allow_is_causal_skip``, ``local_size``, ``dtype``, ``config``) are not
    needed: the mask object is never materialised."""
    if isinstance(attention_mask, HFMask):  # built ahead by generate() (static cache): already this call's
        return attention_mask
    shape = (int(batch_size), 1, int(q_length), int(kv_length))
    causal_function = _causal_mask_function()
    if mask_function is None:  # HF's default
        mask_function = causal_function
    if (
        mask_function is causal_function
        and attention_mask is None
        and band_blocks_nothing(None, 0, shape[2], shape[3], int(q_offset), int(kv_offset))
    ):
        # A decoding step's causal row sees every key: no mask, found before reading the function
        # (what transformers' sdpa_mask skips too; reading it was a visible share of a step).
        # measured: docs/performance.md#hugging-face-backend-benchmarkshfpy
        return HFMask(None, shape)
    mask = from_mask_function(
        mask_function,
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        device=device,
    )
    return HFMask(mask, shape)


@functools.cache
def _causal_mask_function() -> MaskFunction:
    """``transformers.masking_utils.causal_mask_function`` (imported once)."""
    from transformers.masking_utils import causal_mask_function

    return causal_mask_function


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: HFMask | Mask | Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    *,
    backend: str = "auto",
    check_finite: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The attention function of the ``AttentionInterface``.

    Args:
        module: the calling attention layer (read for ``is_causal`` when no mask arrives, and for
            ``config.output_attentions``).
        query: ``(B, Hq, Lq, D)``; key: ``(B, Hkv, Lk, D)``; value: ``(B, Hkv, Lk, Dv)``.
        attention_mask: the mask object of :func:`mask_interface`, a dense 4-D mask
            ``(B|1, 1, Lq, >= Lk)`` (bool or additive), or ``None``.
        scaling, dropout, sliding_window, softcap, s_aux: as HF passes them (module docstring).
        backend: the :func:`multihead.attention` backend.
        check_finite: :func:`multihead.attention`'s (what :func:`register` was given).

    Returns:
        ``(output (B, Lq, Hq, Dv), weights (B, Hq, Lq, Lk) or None)``.
    """
    if kwargs.get("cache") is not None:
        raise ValueError(
            f"multihead: cache= (continuous batching's paged cache) is refused: got "
            f"{type(kwargs['cache']).__name__}, expected none (generate() with its default DynamicCache "
            f"or a StaticCache passes keys and values directly)"
        )
    Lk = key.shape[2]
    score_mod: list[scores.ScoreMod] = []
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        score_mod.append(scores.bias(position_bias[..., :Lk]))
    if isinstance(attention_mask, HFMask):
        mask = attention_mask.mask
    elif attention_mask is None or isinstance(attention_mask, Mask):
        mask = (
            attention_mask
            if attention_mask is not None
            else _mask_without_one(module, kwargs.get("is_causal"), sliding_window)
        )
    elif isinstance(attention_mask, Tensor):
        mask, bias = from_dense(attention_mask, Lk)
        if bias is not None:
            score_mod.append(scores.bias(bias))
    else:
        raise TypeError(
            f"multihead: attention_mask must be a multihead mask, a 4-D tensor or None, got "
            f"{type(attention_mask).__name__}; hint: build the model with attn_implementation="
            f"'multihead' after multihead.integrations.hf.register(), so that its masks are mask objects"
        )
    want_weights = _weights_wanted(module, kwargs)
    hooks = module.__dict__.get(HOOKS)  # None unless a hook is set: with no capture, the one test paid
    if hooks is not None or is_capturing(module):
        y, weights = observed_attention(
            module,
            query,
            key,
            value,
            hooks=hooks,
            captures=captures_of(module),
            need_weights=want_weights,
            mask=mask,
            score_mod=score_mod or None,
            softcap=softcap,
            sinks=s_aux,
            scale=scaling,
            dropout_p=float(dropout),
            backend=backend,
            check_finite=check_finite,
        )  # (B, Hq, Lq, Dv), (B, Hq, Lq, Lk) or None
        return y.transpose(1, 2).contiguous(), weights
    result = multihead.attention(
        query,
        key,
        value,
        mask=mask,
        score_mod=score_mod or None,
        softcap=softcap,
        sinks=s_aux,
        scale=scaling,
        dropout_p=float(dropout),
        return_weights=want_weights,
        backend=backend,
        check_finite=check_finite,
    )
    output, weights = (result.output, result.weights) if isinstance(result, AttentionResult) else (result, None)
    return output.transpose(1, 2).contiguous(), weights  # (B, Lq, Hq, Dv), as HF's attention functions return


def _weights_wanted(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the model will keep this call's weights: ``output_attentions`` passed down, or
    ``transformers``' output collector asking for attentions (models such as GPT-2 and OPT do not
    pass ``output_attentions`` to the attention function: the collector that records the weights
    is how ``model(..., output_attentions=True)`` reaches it), or, where no collector runs, the
    module's config."""
    if kwargs.get("output_attentions", False):
        return True
    active = _active_collector()
    wanted = None if active is None else active.get()
    if wanted is not None:  # the running forward's collector: it read the config's defaults itself
        return "attentions" in wanted or "cross_attentions" in wanted
    # (A config's attribute is slow to read through transformers' config class, once per layer
    # and step, so it is read only for models that set no collector.)
    # measured: docs/performance.md#hugging-face-backend-benchmarkshfpy
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


@functools.cache
def _active_collector() -> Any:
    """``transformers``' context variable of the running output collector (looked up once), or
    ``None`` for a ``transformers`` without one (it passes ``output_attentions`` down instead)."""
    try:
        from transformers.utils.output_capturing import _active_collector as active
    except ImportError:
        return None
    return active


def _mask_without_one(module: torch.nn.Module, is_causal: bool | None, window: int | None) -> Mask | None:
    """No mask arrived: causal (bottom-right, so a decoding step sees its cache) when the module
    is causal, as HF's ``sdpa`` decides, with HF's window of ``w`` keys (``w - 1`` before)."""
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not is_causal:
        return None
    return _causal_mask(window)


@functools.lru_cache(maxsize=16)
def _causal_mask(window: int | None) -> Mask:
    """One mask object per window (masks are immutable): what it derives (its hash, its plans)
    is computed once, not on every call of every layer."""
    return causal() if window is None else sliding_window_mask(window - 1)
