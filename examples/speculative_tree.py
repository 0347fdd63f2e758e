"""Speculative decoding with a draft tree: verify every draft in one call, keep the accepted path.

A tiny target language model (an embedding, one causal GQA layer with rotary positions, a head)
generates greedily. A cheap drafter (a bigram table: the target's top-``k`` next tokens given one
token of context) proposes, after each accepted token, a tree of continuations ``k`` wide and
``depth`` deep. Each round the target runs the last accepted token and the whole tree in ONE call,
``mask=tree(parents)`` (each draft sees the cache, the tokens before it on its branch, itself),
its drafts rotated at ``P + depth``; it accepts the longest branch whose every token is its own
greedy choice, plus one token of its own after it, and ``commit_path`` leaves the cache holding
exactly the accepted tokens. The generated text equals plain greedy decoding, token for token.

    python examples/speculative_tree.py --tokens 48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # runnable from a clone

import multihead as mh  # noqa: E402
from multihead.caches import commit_path  # noqa: E402
from multihead.positions import RotaryEmbedding  # noqa: E402


class TinyLM(nn.Module):
    """Embedding -> one causal GQA attention layer with rotary positions (residual) -> logits."""

    def __init__(self, vocab: int = 48, d_model: int = 64, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        rope = RotaryEmbedding(d_model // heads)
        self.attn = mh.MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads, causal=True, rope=rope)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: Tensor, cache: mh.KVCache | None = None, **kw) -> Tensor:
        x = self.embed(ids)  # (1, L, E)
        return self.head(x + self.attn(x, kv_cache=cache, **kw))  # (1, L, vocab)


def draft_tree(last: int, table: Tensor, width: int, depth: int) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` of the drafter's tree after token ``last``, breadth first: each node
    ``width`` children from the bigram ``table``, ``depth`` levels."""
    tokens, parents, level = [], [], [(-1, last)]
    for _ in range(depth):
        nxt = []
        for parent, token in level:
            for child in table[token, :width].tolist():
                parents.append(parent)
                tokens.append(child)
                nxt.append((len(tokens) - 1, child))
        level = nxt
    return tokens, parents


def accept(logits: Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """The longest branch the target agrees with, and the target's own next token after it.
    ``logits (1 + T, vocab)``: row 0 after the last accepted token, row ``1 + i`` after draft ``i``."""
    choice = logits.argmax(-1).tolist()
    path, at = [], 0  # `at`: the row whose choice the next draft must match
    while True:
        parent = path[-1] if path else -1
        child = next((i for i, p in enumerate(parents) if p == parent and tokens[i] == choice[at]), None)
        if child is None:
            return path, choice[at]
        path.append(child)
        at = 1 + child


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument("--width", type=int, default=2, help="children per draft node")
    parser.add_argument("--depth", type=int, default=3, help="levels of the draft tree")
    parser.add_argument("--quick", action="store_true", help="24 tokens")
    args = parser.parse_args(argv)
    n_new = 24 if args.quick else args.tokens

    torch.manual_seed(0)
    model = TinyLM().double().eval()
    prompt = torch.randint(0, 48, (1, 8))
    with torch.no_grad():
        # the drafter: the target's top-k next tokens given one token of context
        vocab = torch.arange(48).view(-1, 1)
        table = torch.stack([model(vocab[t : t + 1]) for t in range(48)])[:, 0, -1].topk(args.width, -1).indices

        # plain greedy decoding: the reference
        cache = mh.DynamicKVCache()
        logits = model(prompt, cache)
        greedy = [int(logits[0, -1].argmax())]
        while len(greedy) < n_new:
            greedy.append(int(model(torch.tensor([[greedy[-1]]]), cache)[0, -1].argmax()))

        # speculative: one call per round for the last accepted token and the whole tree
        cache = mh.DynamicKVCache()
        logits = model(prompt, cache)
        out, rounds, drafted = [int(logits[0, -1].argmax())], 0, 0
        while len(out) < n_new:
            P = cache.length  # tokens stored; out[-1] is not yet
            tokens, parents = draft_tree(out[-1], table, args.width, args.depth)
            draft = mh.tree(torch.tensor(parents))
            ids = torch.tensor([[out[-1], *tokens]])  # (1, 1 + T): the last token, then the tree
            positions = torch.cat([torch.tensor([P]), P + 1 + draft.depths()[0]])  # drafts at P + 1 + depth
            logits = model(ids, cache, mask=draft, positions=positions)[0]  # (1 + T, vocab)
            path, bonus = accept(logits, tokens, parents)
            commit_path(cache, draft, path)  # the cache: ... out[-1], then the accepted drafts
            out += [tokens[i] for i in path] + [bonus]
            rounds, drafted = rounds + 1, drafted + len(path)
        out = out[:n_new]

    assert out == greedy, (out, greedy)
    print(f"{n_new} tokens in {rounds} target calls ({n_new / rounds:.2f} tokens per call; {drafted} drafts accepted)")
    print(f"tree of {len(tokens)} drafts ({args.width} wide, {args.depth} deep): equal to greedy decoding")
    return {"tokens": out, "greedy": greedy, "rounds": rounds, "accepted": drafted}


if __name__ == "__main__":
    main()
