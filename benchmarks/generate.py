"""Token generation with a decoder built from ``multihead`` layers: no cache, ``DynamicKVCache``,
``StaticKVCache`` eager and compiled, in tokens per second.

The model is ``CausalDecoder`` with 12 layers, ``d_model=768``, 12 heads (GPT-2 small's shape,
random weights, vocabulary 4096), fp32, batch 1. Each method decodes greedily from one prompt of
16 tokens for 200 new tokens (``--quick``: 4 layers, 64 new tokens), and every method must produce
the same tokens (checked). Methods run in interleaved rounds, keeping each one's fastest run, so
that load on this shared machine hits them alike; the table gives tokens/s and the ratios the issue
sets targets for (static >= 1.15x dynamic eager; compiled static >= 1.5x static eager). The
compiled step is compiled (and warmed up) before timing: its compile time is printed apart.
In the same rounds it times the floor of any decode step: every ``nn.Linear`` of the model applied
to one token, which reads the model's weights once; the ratio of a static eager step to it is the
most any compiler could gain on this machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import context, machine_state, print_table, write_csv
from multihead.models import CausalDecoder, DecoderConfig


def greedy_without_cache(model, prompt, n):
    ids = prompt
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.shape[1] :]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 layers, 64 new tokens, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    layers, new, rounds = (4, 64, 2) if args.quick else (12, 200, 3)
    rounds = args.rounds or rounds
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=4096, max_len=16 + new, d_model=768, num_layers=layers, num_heads=12)
    model = CausalDecoder(config).eval()
    prompt = torch.randint(4096, (1, 16), generator=torch.Generator().manual_seed(1))
    print(
        f"# generation: {layers} layers, d_model 768, 12 heads, fp32, batch 1, prompt 16, {new} new tokens "
        f"({context()}); {machine_state()}"
    )

    t0 = time.perf_counter()
    with torch.no_grad():
        expected = model.generate(prompt, new, compile=True)  # compiles the static step (and warms it up)
    print(f"# compile + first compiled run: {time.perf_counter() - t0:.1f} s")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    tokens_in = {m: torch.randn(1, 1, m.in_features) for m in linears}
    methods = {
        "no cache": lambda: greedy_without_cache(model, prompt, new),
        "DynamicKVCache": lambda: model.generate(prompt, new, cache="dynamic"),
        "StaticKVCache eager": lambda: model.generate(prompt, new, cache="static"),
        "StaticKVCache compiled": lambda: model.generate(prompt, new, cache="static", compile=True),
    }
    best = {name: float("inf") for name in methods}
    floor = float("inf")
    with torch.no_grad():
        for _ in range(rounds):
            for name, run in methods.items():
                t = time.perf_counter()
                tokens = run()
                best[name] = min(best[name], time.perf_counter() - t)
                if not torch.equal(tokens, expected):
                    raise AssertionError(f"{name}: generated other tokens than the compiled static cache")
            # The floor of any decode step: every Linear of the model on one token, i.e. its weights
            # read once from memory (as many steps as the methods decode), timed in the same rounds.
            t = time.perf_counter()
            for _ in range(new):
                for m in linears:
                    m(tokens_in[m])
            floor = min(floor, time.perf_counter() - t)
    rows = [
        {
            "method": name,
            "tokens/s": new / s,
            "x no cache": best["no cache"] / s,
            "x dynamic": best["DynamicKVCache"] / s,
            "x static eager": best["StaticKVCache eager"] / s,
        }
        for name, s in best.items()
    ]
    print_table(f"tokens/s, fastest of {rounds} interleaved rounds; {machine_state()}", rows)
    static, compiled = rows[2]["x dynamic"], rows[3]["x static eager"]
    print(
        f"static / dynamic eager: {static:.2f}x (target >= 1.15); compiled / static eager: {compiled:.2f}x "
        f"(target >= 1.5)"
    )
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    eager_ms, floor_ms = best["StaticKVCache eager"] / new * 1e3, floor / new * 1e3
    print(
        f"the weights alone (every Linear on one token, {weight_bytes / 2**20:.0f} MiB): {floor_ms:.1f} ms per token "
        f"({weight_bytes / (floor / new) / 1e9:.1f} GB/s), against {eager_ms:.1f} ms for a static eager step: no step "
        f"that reads these weights can be more than {eager_ms / floor_ms:.2f}x faster than static eager"
    )
    write_csv("generate" + ("_quick" if args.quick else ""), rows)
    write_csv(
        "generate_slots" + ("_quick" if args.quick else ""), _slots_sweep(model, prompt, weight_bytes, args.quick)
    )
    return rows


def _slots_sweep(model, prompt, weight_bytes, quick) -> list[dict]:
    """A compiled step has fixed shapes, so it reads every slot of its static cache; an eager step
    reads only the filled ones. One step's time with caches larger than the text, in one run: the
    compiled step must stay at memory speed (weights + all K/V slots read once per token)."""
    steps = 16 if quick else 48
    E, layers = model.config.d_model, model.config.num_layers
    step = torch.compile(model._step, fullgraph=True, dynamic=False)  # one graph per cache size

    def per_token(fn, slots):
        kv = model.new_cache("static", batch_size=1, max_len=slots)
        last = model(prompt, kv)[:, -1]
        t = time.perf_counter()
        for _ in range(steps):
            last = fn(last.argmax(-1).view(1, 1), kv)
        return (time.perf_counter() - t) / steps

    rows = []
    with torch.no_grad():
        for slots in (prompt.shape[1] + steps + 1, 2048, 8192):
            per_token(step, slots)  # compiles for this size
            eager, compiled = min(((per_token(model._step, slots), per_token(step, slots)) for _ in range(2)), key=sum)
            kv_bytes = 2 * layers * slots * E * 4
            rows.append(
                {
                    "slots": slots,
                    "eager ms": eager * 1e3,
                    "compiled ms": compiled * 1e3,
                    "eager / compiled": eager / compiled,
                    "compiled GB/s": (weight_bytes + kv_bytes) / compiled / 1e9,
                }
            )
    print_table(
        f"one step with a static cache of `slots` slots, {steps} tokens after the prompt; the compiled step "
        f"reads all slots (its GB/s: weights + every slot's K/V); {machine_state()}",
        rows,
    )
    return rows


if __name__ == "__main__":
    main()
