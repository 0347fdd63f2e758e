"""The sparse variants train in a small causal LM (``benchmarks/variants_training.py``'s model, a
few steps): every parameter gets a finite gradient, the top-k indexer from its KL loss only, and
the loss falls on a batch it is trained on repeatedly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import variants_training as vt  # noqa: E402  (a script beside the package, not a module of it)


@pytest.mark.parametrize("name", ["moba", "nsa", "topk"])
def test_a_small_lm_trains_with_each_sparse_variant(name):
    torch.manual_seed(0)
    model = vt.model_with(name)
    indexers = vt.indexer_inputs(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = next(vt.batches(1))[:8]
    losses = []
    for step in range(12):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits[:, vt.HALF - 1 :].reshape(-1, vt.VOCAB), ids[:, vt.HALF :].reshape(-1))
        extra = sum((layer.indexer_loss(box[0]) for layer, box in indexers), torch.zeros(()))
        opt.zero_grad()
        (loss + extra).backward()
        if step == 0:
            for pname, p in model.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), pname
                if name == "nsa" and "compress" in pname or "gate_proj" in pname or "index_" in pname:
                    assert float(p.grad.abs().sum()) > 0, pname
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
