"""Accuracy of the quantized KV caches against the fp32 cache (``QuantizedKVCache``, int8 and fp8).

1. One attention step (``Hq=32, Hkv=8, D=128``, a 2k-token cache whose keys have outlier channels,
   as real keys do): max and mean output error of each format against the fp32 cache, beside the
   error of a plain bf16 cache (the rounding every half-precision cache already accepts).
2. A small decoder (``CausalDecoder``: 4 layers, ``d_model=256``, 8 query heads, 2 KV heads;
   seeded random weights, whose near-flat logits make greedy decoding sensitive to any change):
   200 greedy tokens after a 1024-token prompt with each cache; the tokens equal to the fp32 cache's
   and the first step where they differ, and the largest logit difference while they agree.

Usage: ``python benchmarks/kv_quantization.py`` (about a minute on 2 threads).
"""

from __future__ import annotations

import torch

from common import THREADS, context, machine_state, mh, print_table, write_csv
from multihead.backends.decode_blocks import decode_blocks
from multihead.caches import DynamicKVCache, QuantizedKVCache
from multihead.models.decoder import CausalDecoder, DecoderCache, DecoderConfig

HQ, HKV, D, L = 32, 8, 128, 2048
FORMATS = {"int8": dict(format="int8"), "fp8": dict(format="fp8")}


def attention_error() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    outliers = torch.ones(D)
    outliers[torch.randperm(D, generator=gen)[:6]] = 12.0  # a few channels with a wide range (KIVI's finding)
    k = torch.randn(1, HKV, L, D, generator=gen) * outliers
    v = torch.randn(1, HKV, L, D, generator=gen)
    q = torch.randn(1, HQ, 1, D, generator=gen) / 4
    ref = mh.reference_attention(q.double(), k.double(), v.double()).output
    rows = []
    for name, dtype, options in [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None)] + [
        (f"{fmt} (fp32 compute)", torch.float32, opts) for fmt, opts in FORMATS.items()
    ]:
        if options is None:
            out = mh.attention(q.to(dtype), k.to(dtype), v.to(dtype))
        else:
            cache = QuantizedKVCache(1, L, HKV, D, dtype=dtype, **options)
            cache.update(k[:, :, :-1], v[:, :, :-1])
            read = cache.update(k[:, :, -1:], v[:, :, -1:])
            out = decode_blocks(q, read.blocks, read.mask(None, True, HQ))
        err = (out.double() - ref).abs()
        rows.append(
            {
                "cache": name,
                "max err": float(err.max()),
                "mean err": float(err.mean()),
                "|out| max": float(ref.abs().max()),
            }
        )
    return rows


def greedy_agreement(new_tokens: int = 200, prompt_len: int = 1024) -> list[dict]:
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=512, max_len=L + new_tokens, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2
    )
    model = CausalDecoder(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    runs = {}
    makers = {"fp32": lambda: DynamicKVCache()} | {
        fmt: (lambda opts=opts: QuantizedKVCache(1, config.max_len, 2, 32, **opts)) for fmt, opts in FORMATS.items()
    }
    for name, make in makers.items():
        cache = DecoderCache([make() for _ in range(config.num_layers)])
        tokens, logits = [], []
        with torch.no_grad():
            last = model(prompt, cache)[:, -1]
            for _ in range(new_tokens):
                token = last.argmax(-1, keepdim=True)  # (1, 1)
                tokens.append(int(token))
                logits.append(last[0])
                last = model(token, cache)[:, -1]
        runs[name] = (tokens, torch.stack(logits), cache.nbytes)
        print(f"{name}: {len(tokens)} tokens decoded", flush=True)
    base_tokens, base_logits, _ = runs["fp32"]
    fp32_bytes = 2 * config.num_layers * 2 * (prompt_len + new_tokens) * 32 * 4  # K and V of every token, fp32
    rows = []
    for name, (tokens, logits, nbytes) in runs.items():
        same = [a == b for a, b in zip(tokens, base_tokens)]
        first = same.index(False) if False in same else None
        upto = len(same) if first is None else first + 1  # logits compared while the inputs agree
        rows.append(
            {
                "cache": name,
                "tokens equal": f"{sum(same)}/{new_tokens}",
                "first difference": "none" if first is None else first,
                "max |logit diff| while equal": float((logits[:upto] - base_logits[:upto]).abs().max()),
                "cache MiB": nbytes / 2**20,
                "vs fp32 bytes": nbytes / fp32_bytes,
            }
        )
    return rows


def main() -> None:
    print(f"# quantized KV caches: accuracy  ({context()}, {THREADS} threads)")
    print(f"before: {machine_state()}")
    errors = attention_error()
    print_table(
        f"One step, Hq={HQ} Hkv={HKV} D={D}, {L} cached tokens: output error against the fp64 reference", errors
    )
    agreement = greedy_agreement()
    print_table("Greedy decoding, 200 tokens after a 1024-token prompt: against the fp32 cache", agreement)
    print(f"after: {machine_state()}")
    write_csv("kv_quantization_error", errors)
    write_csv("kv_quantization_greedy", agreement)


if __name__ == "__main__":
    main()
