"""The FSDP2 + context-parallel training example (``examples/fsdp_context_parallel.py``) inside a
spawned world: a small causal LM of ``multihead`` layers trained for three AdamW steps on a
``(dp, cp)`` mesh, its loss, every gradient and every parameter equal to one process training on
the whole batch (fp64, ``assert_close``, checked by the example on every rank at every step).
A world of 4 is the 2 x 2 mesh; 2 and 3 ranks are ``(1, P)``: context parallelism alone. In a
world of 4 the example also trains with ``cp = 4`` as a 2-D context-parallel mesh (2 ring ranks by
2 Ulysses ranks) with attention sinks in every layer."""

from __future__ import annotations

import os
import sys

from dist_checks import check

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


@check("fsdp-context-parallel-training")
def _fsdp_training(rank, world):
    # imported here: collecting the tests must not need torch.distributed.fsdp (a build without
    # torch.distributed skips them instead)
    sys.path.insert(0, EXAMPLES)
    import fsdp_context_parallel

    dp, cp = (2, 2) if world == 4 else (1, world)
    losses = fsdp_context_parallel.train(dp=dp, cp=cp, steps=3, batch_size=4, length=24)
    assert losses[-1] < losses[0], f"three steps did not lower the loss: {losses}"
    if world == 4:
        losses = fsdp_context_parallel.train(
            dp=1, cp=4, steps=2, batch_size=2, length=24, method="hybrid", ulysses=2, sinks=True
        )
        assert losses[-1] < losses[0], f"two steps did not lower the loss: {losses}"
