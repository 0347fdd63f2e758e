"""Context parallelism: one sequence sharded across the ranks of a ``torch.distributed`` group.

* :func:`ring_attention`: every rank keeps its queries; K/V shards travel point to point, and
  the partial results merge by log-sum-exp. Any mask, read at absolute positions; blocks that a
  mask hides are neither computed nor sent.
* :func:`ulysses_attention`: two all-to-alls turn the sequence shards into head shards around
  one local :func:`multihead.attention` over the whole sequence.
* :func:`hybrid_attention`: a 2-D mesh (:class:`Mesh2D`), Ulysses inside a group and the ring
  across groups, the layouts composed (:func:`hybrid_shard`, :func:`hybrid_positions`).
* :func:`shard_sequence` / :func:`unshard_sequence` / :func:`shard_positions`: the ``zigzag`` and
  ``contiguous`` layouts (:mod:`multihead.distributed.layout`), and :func:`document_layout`,
  packed documents balanced per document (:mod:`multihead.distributed.documents`).
* :class:`ShardedKVCache`: decoding over keys and values sharded by position across the ranks
  (prefill by ring attention, each step one query broadcast and one LSE merge).
* :class:`ContextParallel`: group, layout and method as one object, for layers and models;
  :class:`ContextParallelAttend`, the ``attend=`` seam a layer with ``context_parallel=`` runs.

Both functions equal :func:`multihead.attention` on the whole sequence, outputs, LSE and
gradients (``tests/distributed``). See ``docs/distributed.md``.
"""

from multihead.distributed.context import METHODS, ContextParallel, ContextParallelAttend
from multihead.distributed.decoding import ShardedKVCache, StepTraffic
from multihead.distributed.documents import DocumentLayout, document_layout
from multihead.distributed.hybrid import Mesh2D, hybrid_attention, hybrid_positions, hybrid_shard, hybrid_unshard
from multihead.distributed.layout import LAYOUTS, Layout, shard_positions, shard_sequence, unshard_sequence
from multihead.distributed.plan import RingPlan, plan_ring
from multihead.distributed.ring import ring_attention
from multihead.distributed.ulysses import ulysses_attention

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "hybrid_attention",
    "Mesh2D",
    "hybrid_shard",
    "hybrid_unshard",
    "hybrid_positions",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "plan_ring",
    "RingPlan",
    "LAYOUTS",
    "Layout",
    "document_layout",
    "DocumentLayout",
    "ContextParallel",
    "ContextParallelAttend",
    "METHODS",
    "ShardedKVCache",
    "StepTraffic",
]
