"""Positions: rotary embeddings and position biases (floor 2, building on the core's score modifiers).

* :mod:`~multihead.positions.rotary`: ``RotaryEmbedding`` and ``apply_rotary`` (RoPE, with the
  linear, dynamic-NTK, YaRN and Llama-3 scalings), passed to a layer as ``rope=``;
* :mod:`~multihead.positions.alibi`: ``ALiBi`` and ``alibi_slopes``, a score modifier;
* :mod:`~multihead.positions.relative_bias`: ``RelativePositionBias``, T5's learned bucketed bias.

The biases are :class:`multihead.scores.RelativeBias` modifiers: functions of the head and the
distance between aligned positions, which blocked backends add a block at a time as a strided
view of ``R + K - 1`` values. ``docs/positions.md`` has each scheme with a picture of its bias.
"""

from multihead.positions.alibi import ALiBi, alibi_slopes
from multihead.positions.relative_bias import BucketedBias, RelativePositionBias, relative_position_bucket
from multihead.positions.rotary import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    RopeScaling,
    RotaryEmbedding,
    YaRNScaling,
    apply_rotary,
)

__all__ = [
    "ALiBi",
    "alibi_slopes",
    "RelativePositionBias",
    "BucketedBias",
    "relative_position_bucket",
    "apply_rotary",
    "RotaryEmbedding",
    "LinearScaling",
    "DynamicNTKScaling",
    "YaRNScaling",
    "Llama3Scaling",
    "RopeScaling",
]
