"""End to end decoding through an fp32, a bf16 and an int8 KV cache (issue 29, "End to end").

The model is ``CausalDecoder`` with 12 layers, ``d_model=768``, 12 heads (GPT-2 small's shape as in
``generate.py``; seeded random weights, vocabulary 4096), batch 1, greedy decoding of 200 new tokens
after a 2048-token prompt (``--quick``: 2 layers, a 1536-token prompt, 32 new tokens: long enough
that ``auto`` still takes ``decode`` for the steps). Contenders:

* ``fp32``: the fp32 model over fp32 ``StaticKVCache`` s;
* ``bf16``: the same weights in bf16 over bf16 ``StaticKVCache`` s;
* ``int8``: the bf16 model over ``QuantizedKVCache(format="int8", dtype=bf16)`` s (defaults:
  ``residual=64, sinks=4``: the newest and the first tokens stay in bf16).

Every cache is sized to the text (prompt + new tokens), so that it holds what it reads. Each round
runs every contender once: a fresh cache, the prompt's prefill (timed apart), then the one-token
steps (timed); rounds interleave the contenders and each keeps its fastest prefill and decode
(load on this shared machine hits them alike). A contender must produce the same tokens in every
round (checked); against fp32 its tokens may differ, since the weights and the cache are rounded
(bf16 and int8 against fp32, int8 against bf16: how many are equal, where the first difference is).

In the same run: the load before and after, the memory read bandwidth and the fp32 / bf16 matmul
peaks (``decode.matmul_peaks``), and per step the bytes a step must read (every ``nn.Linear``
weight once, plus the K/V it attends over at the mean length), as GB/s and a fraction of the read
bandwidth; beside each step's time, the time of every ``nn.Linear`` of its model applied to one
token in the same rounds (the weights read once: the floor under any step of that model). The
backend and kernel one layer's decode step runs on (``explain``) are printed.

Usage: ``python benchmarks/generate_caches.py`` (``BENCH_THREADS=1`` on a loaded machine).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from common import context, machine_state, memory_read_gbps, print_table, write_csv
from decode import matmul_peaks
from multihead.caches import QuantizedKVCache, StaticKVCache
from multihead.layers.projection import project
from multihead.models import CausalDecoder, DecoderConfig
from multihead.models.decoder import DecoderCache

VOCAB, E, HEADS = 4096, 768, 12
CONTENDERS = ("fp32", "bf16", "int8")


def _new_cache(name: str, model: CausalDecoder, slots: int) -> DecoderCache:
    """One cache per layer, ``slots`` slots each, in the model's dtype."""
    c = model.config
    dtype = model.tok_emb.weight.dtype
    make = {
        "int8": lambda: QuantizedKVCache(1, slots, HEADS, E // HEADS, format="int8", dtype=dtype),
    }.get(name, lambda: StaticKVCache(1, slots, HEADS, E // HEADS, dtype=dtype))
    return DecoderCache([make() for _ in range(c.num_layers)])


def decode(name: str, model: CausalDecoder, prompt: torch.Tensor, new: int) -> dict:
    """Prefill ``prompt (1, P)`` into a fresh cache, then ``new - 1`` one-token greedy steps (the first
    token comes from the prefill, as in ``CausalDecoder.generate``). Returns the tokens and times."""
    cache = _new_cache(name, model, prompt.shape[1] + new)
    t0 = time.perf_counter()
    last = model(prompt, cache)[:, -1]  # (1, V)
    t1 = time.perf_counter()
    tokens = [int(last.argmax(-1))]
    for _ in range(new - 1):
        last = model(torch.tensor([[tokens[-1]]]), cache)[:, -1]
        tokens.append(int(last.argmax(-1)))
    t2 = time.perf_counter()
    return {"tokens": tokens, "prefill s": t1 - t0, "decode s": t2 - t1, "cache bytes": cache.nbytes, "cache": cache}


def _linears_s(linears: list[torch.nn.Linear], tokens: int) -> float:
    """Seconds per token of every ``Linear`` applied to one token as the model applies it
    (``layers.projection.project``: a bf16 one on the one-token kernel): the model's weights read
    once, the floor under any decode step of this model."""
    xs = [torch.randn(1, 1, m.in_features, dtype=m.weight.dtype) for m in linears]
    t = time.perf_counter()
    for _ in range(tokens):
        for m, x in zip(linears, xs):
            project(m, x)
    return (time.perf_counter() - t) / tokens


def _agreement(a: list[int], b: list[int]) -> str:
    same = [x == y for x, y in zip(a, b)]
    first = same.index(False) if False in same else None
    return f"{sum(same)}/{len(same)}, first difference " + ("none" if first is None else f"at token {first}")


def _dispatch(name: str, model: CausalDecoder, cache: DecoderCache) -> str:
    """What one layer's next decode step runs on (``explain`` updates the cache and rolls it back)."""
    dtype = model.tok_emb.weight.dtype
    report = model.blocks[0].attn.explain(torch.randn(1, 1, E, dtype=dtype), kv_cache=cache[0])
    kernel = next((line for line in report.plan if line.startswith(("kernel:", "PyTorch kernel"))), "kernel: ?")
    return f"{name}: backend {report.backend}, {kernel.split(':', 1)[0]}: {kernel.split(':', 1)[1].strip()[:60]}"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 layers, 1536-token prompt, 32 new tokens, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, quick 1)")
    args = parser.parse_args(argv)
    layers, prompt_len, new, rounds = (2, 1536, 32, 1) if args.quick else (12, 2048, 200, 3)
    rounds = args.rounds or rounds
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, max_len=prompt_len + new, d_model=E, num_layers=layers, num_heads=HEADS)
    fp32 = CausalDecoder(config).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    models = {"fp32": fp32, "bf16": bf16, "int8": bf16}
    prompt = torch.randint(VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    print(
        f"# end to end decoding: {layers} layers, d_model {E}, {HEADS} heads, batch 1, prompt {prompt_len}, "
        f"{new} new tokens, greedy ({context()})"
    )
    print(f"before: {machine_state()}")
    read_gbps = memory_read_gbps()
    peaks = matmul_peaks(0.2 if args.quick else 0.5)
    print(
        f"ceilings measured now: memory read {read_gbps:.1f} GB/s, matmul fp32 {peaks['float32']:.0f} GFLOP/s, "
        f"bf16 {peaks['bfloat16']:.0f} GFLOP/s"
    )

    linears = {name: [m for m in model.modules() if isinstance(m, torch.nn.Linear)] for name, model in models.items()}
    floor = {"fp32": float("inf"), "bf16": float("inf")}
    best: dict[str, dict] = {}
    with torch.no_grad():
        for r in range(rounds):
            for name in floor:  # the weights read once: every Linear on one token (20 tokens, per token)
                floor[name] = min(floor[name], _linears_s(linears[name], 20))
            for name in CONTENDERS:
                run = decode(name, models[name], prompt, new)
                if name not in best:
                    best[name] = run
                    print(_dispatch(name, models[name], run["cache"]), flush=True)
                elif run["tokens"] != best[name]["tokens"]:
                    raise AssertionError(f"{name}: round {r} decoded other tokens than round 0")
                for key in ("prefill s", "decode s"):
                    best[name][key] = min(best[name][key], run[key])
                print(f"round {r} {name}: prefill {run['prefill s']:.2f} s, decode {run['decode s']:.2f} s", flush=True)
    after = machine_state()
    print(f"after: {after}")

    steps = new - 1
    weight_bytes = {name: sum(m.weight.numel() * m.weight.element_size() for m in ms) for name, ms in linears.items()}
    mean_fill = (prompt_len + new / 2) / (prompt_len + new)  # a step reads the filled slots only
    rows = []
    for name in CONTENDERS:
        run = best[name]
        step_bytes = weight_bytes[name] + run["cache bytes"] * mean_fill
        step_s = run["decode s"] / steps
        rows.append(
            {
                "cache": name,
                "decode tok/s": steps / run["decode s"],
                "x fp32": best["fp32"]["decode s"] / run["decode s"],
                "x bf16": best["bf16"]["decode s"] / run["decode s"],
                "prefill s": run["prefill s"],
                "cache MiB": run["cache bytes"] / 2**20,
                "weights MiB": weight_bytes[name] / 2**20,
                "step ms": step_s * 1e3,
                "weights-only ms": floor["fp32" if name == "fp32" else "bf16"] * 1e3,
                "step GB/s": step_bytes / step_s / 1e9,
                "of read BW": step_bytes / step_s / 1e9 / read_gbps,
                "tokens vs fp32": _agreement(run["tokens"], best["fp32"]["tokens"]),
                "tokens vs bf16": _agreement(run["tokens"], best["bf16"]["tokens"]) if name == "int8" else "",
            }
        )
    print_table(
        f"Decode steps after a {prompt_len}-token prompt, fastest of {rounds} interleaved rounds "
        f"(read bandwidth {read_gbps:.1f} GB/s measured in this run); {after}",
        rows,
    )
    print(f"int8 vs bf16 tokens: {rows[2]['tokens vs bf16']}")
    write_csv("generate_caches" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
