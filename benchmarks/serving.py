"""Serving-side attention (issue 30): a prefix cache with cascade attention, StreamingLLM's sinks
+ window over a long stream, SnapKV's compressed prompt.

Attention and cache work only (no projections or model), fp32, ``Hq = 8``, ``Hkv = 2``,
``D = 64``, batch as stated; every contender is checked against the other on the same inputs
before it is timed. The load average is printed before and after each part.

* ``prefix``: 16 requests sharing a 4096-token prompt, each with 64 tokens of its own, then 128
  decode steps (each: append one token per request in one call, attend). A ``PrefixCache`` whose
  requests share the prompt's pages, attended with cascade (``prefix_attention``), against the
  same cache with nothing shared (each request stores the prompt: no common pages, so the step
  gathers each request's pages and attends to them). Tokens per second and pages held.
* ``stream``: ``SinksAndWindow(4, 1020)`` generating 65536 tokens one at a time: time per token
  and bytes held at checkpoints, against a full ``DynamicKVCache`` holding as many tokens
  (filled directly, then 64 steps timed at each checkpoint).
* ``snapkv``: a 16384-token prompt, ``SnapKV(compression_ratio=0.75)`` (a quarter kept): the
  selection's cost against the prompt's causal attention, and 128 decode steps against the full
  cache.
* ``tree``: a tree of 64 draft tokens (random parents, drafter order) verified in one call after a
  prefix of 4096 and 16384 keys, ``mask=tree(parents)``, against a 64-token chunk with
  ``causal()`` on the same keys (the issue's bound: at most 1.5x); ``auto`` and each backend that
  runs it; then ``commit_path`` of a depth-8 path on a ``DynamicKVCache`` against ``crop``.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import check_close, context, fastest_ms, machine_state, mh, print_table, used_backend, write_csv
from multihead.caches import PrefixCache, commit_path, prefix_attention
from multihead.caches.policies import SinksAndWindow, SnapKV

HQ, HKV, D = 8, 2, 64


def _elapsed(fn, repeat: int = 1) -> float:
    """Seconds of the fastest of ``repeat`` runs of ``fn()``."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------------------------- prefix
def prefix_part(requests: int, prompt: int, own: int, steps: int, rounds: int) -> list[dict]:
    ps = 16
    g = torch.Generator().manual_seed(0)
    shared_kv = [torch.randn(1, HKV, prompt, D, generator=g) for _ in range(2)]
    own_kv = [torch.randn(1, HKV, requests * own, D, generator=g) for _ in range(2)]
    step_kv = [torch.randn(1, HKV, requests * steps, D, generator=g) for _ in range(2)]
    queries = torch.randn(steps, requests, HQ, 1, D, generator=g)
    pages = requests * -(-(prompt + own + steps) // ps) + 8

    def build(share: bool) -> tuple[PrefixCache, list[int]]:
        cache = PrefixCache(pages, ps, HKV, D)
        rids = []
        for b in range(requests):
            ids = list(range(prompt)) if share else [b * (prompt + 1) + 1 + t for t in range(prompt)]
            mine = [10**7 + b * own + t for t in range(own)]
            rid, cached = cache.admit(ids + mine)
            k = torch.cat([shared_kv[0][:, :, cached:], own_kv[0][:, :, b * own : (b + 1) * own]], 2)
            v = torch.cat([shared_kv[1][:, :, cached:], own_kv[1][:, :, b * own : (b + 1) * own]], 2)
            cache.append([rid], k, v, [(ids + mine)[cached:]])
            rids.append(rid)
        return cache, rids

    def decode(share: bool) -> tuple[list[torch.Tensor], int]:
        cache, rids = build(share)
        outs = []
        for s in range(steps):
            sl = slice(s * requests, (s + 1) * requests)
            cache.append(rids, step_kv[0][:, :, sl], step_kv[1][:, :, sl], [[5] for _ in rids])
            outs.append(prefix_attention(cache, queries[s], rids))
        held = cache.pool.num_pages - cache.free_pages
        return outs, held

    shared_out, shared_pages = decode(True)
    alone_out, alone_pages = decode(False)
    for s in (0, steps - 1):
        check_close(f"prefix step {s}", shared_out[s], alone_out[s])
    times = {"shared + cascade": float("inf"), "nothing shared": float("inf")}
    for _ in range(rounds):  # interleaved rounds, fastest kept
        times["shared + cascade"] = min(times["shared + cascade"], _elapsed(lambda: decode(True)))
        times["nothing shared"] = min(times["nothing shared"], _elapsed(lambda: decode(False)))
    page_bytes = 2 * HKV * ps * D * 4
    rows = []
    for name, held in (("shared + cascade", shared_pages), ("nothing shared", alone_pages)):
        rows.append(
            {
                "method": name,
                "s (build + decode)": round(times[name], 3),
                "tokens/s": round(requests * steps / times[name], 1),
                "pages held": held,
                "MB held": round(held * page_bytes / 1e6, 1),
                "x nothing shared": round(times["nothing shared"] / times[name], 2),
            }
        )
    return rows


# ---------------------------------------------------------------------------------- stream
def _step(cache, q, k, v):
    read = cache.update(k, v)
    return mh.attention(q, read.keys, read.values, mask=read.mask(None, True, HQ))


def stream_part(total: int, checkpoints: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, HQ, 1, D, generator=g),
        torch.randn(1, HKV, 1, D, generator=g),
        torch.randn(1, HKV, 1, D, generator=g),
    )
    policy = SinksAndWindow(4, 1020)
    cache = mh.DynamicKVCache(policy=policy)
    per_token: dict[int, float] = {}
    held: dict[int, int] = {}
    t = 0
    span = 256  # tokens timed before each checkpoint
    for point in checkpoints:
        while t < point - span:
            _step(cache, q, k, v)
            t += 1
        t0 = time.perf_counter()
        while t < point:
            _step(cache, q, k, v)
            t += 1
        per_token[point] = (time.perf_counter() - t0) / span * 1e3
        held[point] = cache.nbytes
    rows = []
    for point in checkpoints:
        full = mh.DynamicKVCache(capacity=point + 128)
        full.update(torch.randn(1, HKV, point - 64, D, generator=g), torch.randn(1, HKV, point - 64, D, generator=g))
        t0 = time.perf_counter()
        for _ in range(64):
            _step(full, q, k, v)
        full_ms = (time.perf_counter() - t0) / 64 * 1e3
        rows.append(
            {
                "tokens": point,
                "sinks+window ms/token": round(per_token[point], 3),
                "full ms/token": round(full_ms, 3),
                "sinks+window MB": round(held[point] / 1e6, 2),
                "full MB (K/V)": round(2 * HKV * point * D * 4 / 1e6, 2),
                "x full": round(full_ms / per_token[point], 2),
            }
        )
    return rows


# ---------------------------------------------------------------------------------- snapkv
def snapkv_part(prompt: int, steps: int, rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, HQ, prompt, D, generator=g)
    k, v = torch.randn(1, HKV, prompt, D, generator=g), torch.randn(1, HKV, prompt, D, generator=g)
    qs, ks, vs = (torch.randn(1, h, steps, D, generator=g) for h in (HQ, HKV, HKV))

    def prefill_attention():
        return mh.attention(q, k, v, mask=mh.causal())

    def select():
        cache = mh.DynamicKVCache(policy=SnapKV(compression_ratio=0.75))
        cache.observe(q)
        cache.update(k, v)
        return cache

    def store():
        cache = mh.DynamicKVCache(capacity=prompt + steps)
        cache.update(k, v)
        return cache

    attention_s = _elapsed(prefill_attention, rounds)
    select_s = _elapsed(select, rounds)
    store_s = _elapsed(store, rounds)

    def decode(cache):
        out = []
        for s in range(steps):
            sl = slice(s, s + 1)
            cache.observe(qs[:, :, sl])
            out.append(_step(cache, qs[:, :, sl], ks[:, :, sl], vs[:, :, sl]))
        return out

    compressed, full = select(), store()
    decode(compressed), decode(full)  # warm-up; outputs differ (a quarter of the prompt is kept)
    decode_s = {"snapkv": float("inf"), "full": float("inf")}
    for _ in range(rounds):
        decode_s["snapkv"] = min(decode_s["snapkv"], _elapsed(lambda: decode(select())) - select_s)
        decode_s["full"] = min(decode_s["full"], _elapsed(lambda: decode(store())) - store_s)
    kept = select().held
    return [
        {
            "prompt": prompt,
            "kept": kept,
            "prefill attention s": round(attention_s, 3),
            "selection s (update - plain store)": round(select_s - store_s, 4),
            "selection / prefill": round((select_s - store_s) / attention_s, 4),
            "snapkv decode tok/s": round(steps / decode_s["snapkv"], 1),
            "full decode tok/s": round(steps / decode_s["full"], 1),
            "x full": round(decode_s["full"] / decode_s["snapkv"], 2),
        }
    ]


# ---------------------------------------------------------------------------------- tree
def _drafts(T: int, g: torch.Generator) -> torch.Tensor:
    """A drafter's tree: node ``i`` hangs under a random one of the 8 nodes before it (-1 for the first)."""
    return torch.tensor([-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=g)) for i in range(1, T)])


def tree_part(prefixes: list[int], T: int, rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    parents = _drafts(T, g)
    draft = mh.tree(parents)
    rows = []
    for P in prefixes:
        q = torch.randn(1, HQ, T, D, generator=g)
        k, v = torch.randn(1, HKV, P + T, D, generator=g), torch.randn(1, HKV, P + T, D, generator=g)
        dense = draft.materialize(1, 1, T, P + T)
        want = mh.attention(q.double(), k.double(), v.double(), mask=dense, backend="reference").float()
        fns = {"chunk causal (auto)": lambda: mh.attention(q, k, v, mask=mh.causal())}
        for backend in ("auto", "sdpa", "blocksparse", "decode"):
            got = mh.attention(q, k, v, mask=draft, backend=backend)
            check_close(f"tree {backend}", got, want)
            fns[f"tree ({backend})"] = lambda b=backend: mh.attention(q, k, v, mask=draft, backend=b)
        ms = fastest_ms(fns, rounds)
        base = ms["chunk causal (auto)"]
        chunk_backend = used_backend(q, k, v, mask=mh.causal())
        for name, t in ms.items():
            ran = (
                used_backend(q, k, v, mask=draft) if name == "tree (auto)" else chunk_backend if "chunk" in name else ""
            )
            rows.append(
                {"prefix": P, "T": T, "call": name, "ran": ran, "ms": round(t, 3), "x chunk": round(t / base, 2)}
            )
        # commit: a depth-8 path of the tree kept, against a plain crop of the drafts
        node, path = T - 1, []
        while node != -1:
            path.append(node)
            node = int(parents[node])
        path = path[::-1][:8]

        def verified(cache_k=k, cache_v=v):
            cache = mh.DynamicKVCache(capacity=P + T)
            cache.update(cache_k, cache_v)
            return cache

        commit_ms = fastest_ms(
            {"commit": lambda: commit_path(verified(), draft, path), "crop": lambda: verified().crop(P)}, rounds
        )
        rows.append(
            {
                "prefix": P,
                "T": T,
                "call": f"commit_path (depth {len(path)})",
                "ran": "DynamicKVCache",
                "ms": round(commit_ms["commit"], 3),
                "x chunk": round(commit_ms["commit"] / base, 2),
            }
        )
        rows.append(
            {
                "prefix": P,
                "T": T,
                "call": "the same cache, crop(P) only",
                "ran": "DynamicKVCache",
                "ms": round(commit_ms["crop"], 3),
                "x chunk": round(commit_ms["crop"] / base, 2),
            }
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one round")
    parser.add_argument("--only", choices=["prefix", "stream", "snapkv", "tree"], default=None)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds, fastest kept")
    args = parser.parse_args(argv)
    print(context())
    rounds = args.rounds
    parts = {
        "prefix": lambda: prefix_part(16, 1024 if args.quick else 4096, 64, 32 if args.quick else 128, rounds),
        "stream": lambda: stream_part(
            8192 if args.quick else 65536, [1024, 4096, 8192] if args.quick else [1024, 8192, 16384, 32768, 65536]
        ),
        "snapkv": lambda: snapkv_part(4096 if args.quick else 16384, 32 if args.quick else 128, rounds),
        "tree": lambda: tree_part([1024] if args.quick else [4096, 16384], 64, rounds),
    }
    for name, run in parts.items():
        if args.only not in (None, name):
            continue
        print(f"\n{name}: before, {machine_state()}", flush=True)
        rows = run()
        print(f"{name}: after, {machine_state()}")
        print_table(f"serving: {name}", rows)
        write_csv(f"serving_{name}{'_quick' if args.quick else ''}", rows)


if __name__ == "__main__":
    main()
