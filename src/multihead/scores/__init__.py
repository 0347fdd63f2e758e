"""Score modifiers: what is added to or changed in the scores before the softmax.

``attention(q, k, v, mask=causal(), score_mod=[bias(t), softcap(30.0)])``. Masks say which keys
a query may see (:mod:`multihead.masks`); modifiers change the scores of the keys it sees. Position
biases built on it live in :mod:`multihead.positions` (ALiBi, T5's relative bias); a plain
function ``fn(score, b, h, q_idx, kv_idx)`` is a modifier too (:mod:`multihead.scores.user`).
Sharded attention reads a modifier at a block's absolute positions (:func:`shifted`, the ring) or
at a range of heads (:func:`head_range`, Ulysses).
"""

from multihead.scores.arguments import as_score_mod
from multihead.scores.base import ADDITIVE, ELEMENTWISE, Chain, ScoreMod
from multihead.scores.bias import Bias, bias
from multihead.scores.heads import HeadRange, head_range, sinks_range
from multihead.scores.relative import RelativeBias
from multihead.scores.shifted import Shifted, shifted
from multihead.scores.softcap import Softcap, softcap
from multihead.scores.user import UserScoreMod

__all__ = [
    "ScoreMod",
    "Chain",
    "as_score_mod",
    "bias",
    "softcap",
    "Bias",
    "Softcap",
    "RelativeBias",
    "UserScoreMod",
    "shifted",
    "Shifted",
    "head_range",
    "sinks_range",
    "HeadRange",
    "ADDITIVE",
    "ELEMENTWISE",
]
