"""Decode with each KV cache: dynamic, static, sliding window, paged and quantized.

A small causal decoder (``multihead.models.CausalDecoder``, random weights, a sliding-window
attention of ``--window`` tokens so that every cache applies) decodes two prompts greedily, one
token per step, through ``DecoderCache``: one ``multihead.caches.KVCache`` per layer, handed to
each attention layer as ``kv_cache=``. The model and the loop are the same for every cache; only
what the cache keeps changes. Each run's logits are checked against the model without a cache
(the whole sequence recomputed, the ground truth), and the cache's bytes are printed.

    python examples/decode_with_caches.py              # 64 new tokens
    python examples/decode_with_caches.py --quick      # what the test suite runs

The lossless caches (dynamic, static, sliding, paged) give the uncached logits to float rounding;
the quantized one stores keys and values in 8 bits (KIVI's per-channel key scales), so its logits
move a little and the greedy tokens may part ways after a near tie.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # runnable from a clone

from multihead.caches import (  # noqa: E402
    DynamicKVCache,
    PagedKVCache,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from multihead.models import CausalDecoder, DecoderCache, DecoderConfig  # noqa: E402


def caches(config: DecoderConfig, batch: int, total: int) -> dict:
    """One factory per cache kind: each makes the per-layer cache for ``batch`` rows of ``total`` tokens."""
    Hkv, D = config.num_kv_heads or config.num_heads, config.d_model // config.num_heads
    page = 8  # tokens per page; the pool holds every row's pages with none to spare
    return {
        # grows as tokens come (amortised doubling): the simplest, and what generate(cache="dynamic") uses
        "dynamic": lambda: DynamicKVCache(),
        # allocated once for `total` slots: fixed shapes, what a compiled step needs
        "static": lambda: StaticKVCache(batch, total, Hkv, D),
        # a ring of the last window + 1 tokens: memory flat however long the text (sliding-window models only)
        "sliding": lambda: SlidingWindowKVCache(config.window, batch, Hkv, D),
        # fixed-size pages from a shared pool, found through a block table (vLLM's layout)
        "paged": lambda: PagedKVCache(batch * -(-total // page), page, Hkv, D, batch_size=batch),
        # 8-bit keys and values; the first `sinks` and last `residual` tokens stay in full precision
        "quantized": lambda: QuantizedKVCache(batch, total, Hkv, D, residual=8, sinks=2, group=8),
    }


@torch.no_grad()
def decode(model: CausalDecoder, prompt: torch.Tensor, new: int, cache: DecoderCache):
    """Greedy decoding: the prompt in one call (prefill), then one token per call. Returns the
    new tokens ``(B, new)`` and the logits each call ended with ``(B, new, V)``."""
    logits = model(prompt, cache)[:, -1]  # (B, V): the prefill fills the cache
    tokens, seen = [], []
    for _ in range(new):
        seen.append(logits)
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(token)
        logits = model(token, cache)[:, -1]  # the cache holds every earlier token: one new one goes in
    return torch.cat(tokens, 1), torch.stack(seen, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=64, help="tokens to generate")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--window", type=int, default=24, help="sliding-window attention: tokens before each query")
    parser.add_argument("--quick", action="store_true", help="short settings (the test suite's)")
    args = parser.parse_args(argv)
    if args.quick:
        args.new, args.prompt, args.window = 24, 12, 16

    torch.manual_seed(0)
    total = args.prompt + args.new
    config = DecoderConfig(50, total, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, window=args.window)
    model = CausalDecoder(config).eval()
    prompt = torch.randint(0, 50, (2, args.prompt), generator=torch.Generator().manual_seed(1))  # (B, P)

    results = {}
    print(f"{'cache':<10} {'max |logits - uncached|':>24} {'same tokens as uncached':>24} {'cache bytes':>12}")
    for name, make in caches(config, prompt.shape[0], total).items():
        cache = DecoderCache([make() for _ in model.blocks])
        tokens, logits = decode(model, prompt, args.new, cache)
        # The ground truth: the model without a cache, the whole sequence at once, on the same tokens.
        full = torch.cat([prompt, tokens[:, :-1]], 1)  # (B, P + new - 1)
        with torch.no_grad():
            reference = model(full)[:, args.prompt - 1 :]  # (B, new, V): the logits after each prefix
        greedy = reference.argmax(-1)  # what the uncached model picks after each of these prefixes
        diff = float((logits - reference).abs().max())
        agree = float((greedy == tokens).float().mean())
        results[name] = {"max_diff": diff, "agree": agree, "nbytes": cache.nbytes, "tokens": tokens,
                         "scale": float(reference.abs().max())}  # fmt: skip
        print(f"{name:<10} {diff:>24.2e} {agree:>23.0%} {cache.nbytes:>12,}")
    return results


if __name__ == "__main__":
    main()
