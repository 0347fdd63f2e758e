"""Train a small causal language model built of `multihead` layers, then generate with it.

    python examples/train_causal_lm.py             # about 600 steps, stops at 99% accuracy
    python examples/train_causal_lm.py --quick     # 60 steps, the test suite's setting

The task is copying: 8 random symbols, a separator, then the same 8 symbols again. Only the copy
is scored, and only attention can solve it (each copied symbol sits 9 positions back), so the
loss falling means the attention layers learned to look there. The model is
:class:`multihead.models.CausalDecoder` (token and position embeddings, pre-norm blocks of causal
:class:`multihead.MultiHeadAttention` with GQA and an MLP), trained with AdamW; afterwards
``generate`` continues unseen prompts (it returns only the new tokens) and the attention of one
copy step is captured to show where the model looks.

``main()`` returns the losses and the accuracy, so ``tests/examples/test_look_train_export.py``
can check them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import multihead as mh  # noqa: E402
from multihead.models import CausalDecoder, DecoderConfig  # noqa: E402

SYMBOLS, N = 16, 8  # symbols 0..15; token 16 separates the original from the copy
SEP = SYMBOLS


def batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs (size, 2N), targets (size, 2N))``: targets are the next tokens, ``-100`` (not
    scored) before the copy begins."""
    symbols = torch.randint(0, SYMBOLS, (size, N), generator=generator)
    seq = torch.cat([symbols, torch.full((size, 1), SEP), symbols], dim=1)  # (size, 2N + 1)
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[:, :N] = -100  # the original symbols are random: nothing to learn there
    return inputs, targets


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps (the test suite's setting)")
    parser.add_argument("--steps", type=int, default=None, help="most training steps (default 600, 60 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 600)
    torch.manual_seed(args.seed)
    data = torch.Generator().manual_seed(args.seed)

    config = DecoderConfig(
        vocab_size=SYMBOLS + 1, max_len=2 * N + 1, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2
    )
    model = CausalDecoder(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        inputs, targets = batch(64, data)
        logits = model(inputs)  # (B, 2N, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # -100 ignored
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")
        if not args.quick and step % 20 == 19 and accuracy(model, data) >= 0.99:
            print(f"step {step}: 99% of held-out copies right, stopping")
            break

    model.eval()
    acc = accuracy(model, data)
    prompt, _ = batch(1, data)
    prompt = prompt[:, : N + 1]  # the symbols and the separator
    continuation = model.generate(prompt, N)  # (1, N): only the new tokens
    print(f"prompt {prompt[0, :N].tolist()} -> generated {continuation[0].tolist()}  (held-out accuracy {acc:.2f})")

    # Where the model looks while copying: the last layer's weights for the first copied symbol.
    with torch.no_grad(), mh.capture_attention(model) as cap:
        model(prompt)
    looked = cap.weights[-1][0, :, N].argmax(-1)  # (H,): each head's top key for the query at the separator
    print(f"{cap.names[-1]}: at the separator (position {N}) the heads look most at positions {looked.tolist()}")
    return {"losses": losses, "accuracy": acc, "prompt": prompt, "generated": continuation, "looked": looked}


@torch.no_grad()
def accuracy(model: CausalDecoder, generator: torch.Generator) -> float:
    """The share of copied symbols predicted right on 256 fresh sequences."""
    inputs, targets = batch(256, generator)
    predicted = model(inputs).argmax(-1)
    scored = targets != -100
    return float((predicted[scored] == targets[scored]).float().mean())


if __name__ == "__main__":
    main()
