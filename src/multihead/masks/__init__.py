"""Masks as immutable, composable boolean objects: ``causal() & sliding_window(512)``.

``True`` means *may attend*; see :mod:`multihead.conventions` for alignment and polarity.
Masks are read at absolute positions of the whole attention (:meth:`Mask.shifted`,
:meth:`Mask.at`). What is added to the scores lives in :mod:`multihead.scores`.
"""

from multihead.blocks import Block, Extent
from multihead.masks.band import Band, Window, causal, sliding_window
from multihead.masks.base import And, BlockState, Mask, Not, Or, Positioned, register_coercion
from multihead.masks.document import Document, DocumentCausal, document, document_causal
from multihead.masks.heads import HeadRange, head_range
from multihead.masks.padding import KeyPadding, key_padding, prefix_lm
from multihead.masks.select import BlockSelect, block_select
from multihead.masks.tensor import Custom, TensorMask, additive_blocked, as_mask, bias, custom
from multihead.masks.tree import Tree, at_new_tokens, holds_tree, tree

__all__ = [
    "Mask",
    "BlockState",
    "Extent",
    "Block",
    "And",
    "Or",
    "Not",
    "Positioned",
    "Window",
    "register_coercion",
    "causal",
    "sliding_window",
    "key_padding",
    "prefix_lm",
    "document",
    "document_causal",
    "head_range",
    "block_select",
    "tree",
    "at_new_tokens",
    "holds_tree",
    "custom",
    "as_mask",
    "additive_blocked",
    "bias",
    "Band",
    "KeyPadding",
    "Document",
    "DocumentCausal",
    "HeadRange",
    "BlockSelect",
    "Tree",
    "TensorMask",
    "Custom",
]
