"""Masks as immutable, composable objects: ``causal() & sliding_window(512)``.

``True`` means *may attend*; see :mod:`multihead.conventions` for alignment and polarity.
"""

from multihead.masks.band import Band, causal, sliding_window
from multihead.masks.base import And, BlockState, Mask, Not, Or, Shifted
from multihead.masks.document import Document, document
from multihead.masks.padding import KeyPadding, key_padding, prefix_lm
from multihead.masks.tensor import Custom, TensorMask, as_mask, bias, custom

__all__ = [
    "Mask", "BlockState", "And", "Or", "Not", "Shifted",
    "causal", "sliding_window", "key_padding", "prefix_lm", "document", "custom", "as_mask", "bias",
    "Band", "KeyPadding", "Document", "TensorMask", "Custom",
]
