"""Stream generation with a constant-memory cache: StreamingLLM's sinks + window.

A causal layer with rotary positions decodes a long stream one token at a time through
``DynamicKVCache(policy=SinksAndWindow(sinks, window, positions="cache", rotary=rope))``: the
cache holds the first ``sinks`` tokens and the last ``window``, positions are the cache's slots
(StreamingLLM's treatment, so no query is ever further than ``sinks + window`` from a key), and
its bytes stay flat however long the stream runs. The first steps are checked against the same
layer without a cache and the mask ``sliding_window(window) | key_padding(sinks)``, where the two
treatments agree (before the first eviction moves a key).

    python examples/streaming.py --tokens 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # runnable from a clone

import multihead as mh  # noqa: E402
from multihead.caches.policies import SinksAndWindow  # noqa: E402
from multihead.positions import RotaryEmbedding  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens to stream")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=252)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    d_model, heads, kv_heads = 256, 8, 2
    rope = RotaryEmbedding(d_model // heads)
    layer = mh.MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads, causal=True, rope=rope).eval()
    policy = SinksAndWindow(args.sinks, args.window, positions="cache", rotary=rope)
    cache = mh.DynamicKVCache(policy=policy)
    stream = torch.randn(1, args.tokens, d_model)  # stand-ins for the embeddings of generated tokens

    check = min(args.tokens, args.sinks + args.window)
    with torch.no_grad():
        reference = layer(stream[:, :check], mask=mh.sliding_window(args.window) | mh.key_padding(args.sinks))
        start = time.perf_counter()
        for t in range(args.tokens):
            out = layer(stream[:, t : t + 1], kv_cache=cache)
            if t < check:
                torch.testing.assert_close(out, reference[:, t : t + 1], rtol=1e-4, atol=1e-5)
            if (t + 1) & t == 0 or t + 1 == args.tokens:  # powers of two, and the end
                rate = (t + 1) / (time.perf_counter() - start)
                print(
                    f"{t + 1:>7} tokens: cache holds {cache.held:>4} tokens, {cache.nbytes:>8} bytes, "
                    f"{rate:8.1f} tokens/s"
                )
    print(f"policy {policy!r}: memory flat at {cache.held} tokens after {args.tokens} streamed")


if __name__ == "__main__":
    main()
