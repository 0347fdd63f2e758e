"""Score modifiers: what is added to or changed in the scores before the softmax.

``attention(q, k, v, mask=causal(), score_mod=[bias(t), softcap(30.0)])``. Masks say which keys
a query may see (:mod:`multihead.masks`); modifiers change the scores of the keys it sees. The
positions issue adds ALiBi, relative biases, sinks and a user ``score_mod`` on this mechanism.
"""

from multihead.scores.base import ADDITIVE, ELEMENTWISE, Chain, ScoreMod, as_score_mod
from multihead.scores.bias import Bias, bias
from multihead.scores.softcap import Softcap, softcap

__all__ = ["ScoreMod", "Chain", "as_score_mod", "bias", "softcap", "Bias", "Softcap", "ADDITIVE", "ELEMENTWISE"]
