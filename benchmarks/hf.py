"""A Hugging Face ``transformers`` model with ``attn_implementation`` ``eager``, ``sdpa`` and
``multihead`` (issue 13): prefill, decode steps, and a sliding-window prefill.

The models come from random configs (no downloads), fp32, batch 1:

* **Llama**: 4 layers, ``hidden_size=512``, 8 heads, 2 KV heads (head dim 64), MLP 1376,
  vocabulary 32000. Prefill of 1024 tokens; then 64 decode steps with HF's ``DynamicCache``
  from that 1024-token prefix (time per step);
* **Mistral**, the same sizes with ``sliding_window=w`` in every layer: prefill of 4096 tokens
  (``w`` = 1024 and 512; ``--quick``: 1024). ``multihead`` receives ``sliding_window(w - 1)``
  and skips the blocks outside the band; ``sdpa`` gets HF's dense ``(1, 1, L, L)`` bool mask.
  ``eager`` (its ``(8, 4096, 4096)`` scores per layer: 10 s of CPU here) is timed once, not in
  every round.

Each model is built once and switched with ``model.set_attn_implementation(...)``: the three
implementations run the same weights on the same tokens. Before timing, every implementation's
last hidden states (all positions, after the final norm) and its decode-step logits must agree
with ``eager``'s (relative max difference <= 1e-4), and the greedy tokens of the decode steps
must be the same; the decode steps are then timed teacher-forced on those tokens, so that every
implementation does the same work. Prefill asks for the logits of the last position only
(``logits_to_keep=1``, as ``generate`` does): the 1024 x 32000 LM head would otherwise be a
third of the time and the same for all three.

Timing (shared/BENCHMARKS.md): interleaved rounds, the implementations in turn, the order
rotating. Prefill: one forward of each per round. Decode: the three caches advance together and
every step is timed for each implementation in turn; after each round of 64 steps the caches are
cropped back to the prefix. The median sample is reported (one forward, one step), and ratios
of the medians: of wall time, of process CPU time
(all threads; it leaves out the time spent waiting for a core) and of the least wall times. On
a shared machine other processes only add time, and each round hits all three alike. The load
average is printed before and after every table.

    .venv/bin/python benchmarks/hf.py               # about 6 minutes on two cores
    .venv/bin/python benchmarks/hf.py --quick       # about 2 minutes
    .venv/bin/python benchmarks/hf.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import THREADS, context, machine_state, print_table, write_csv

IMPLS = ("eager", "sdpa", "multihead")
SIZES = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
TOLERANCE = 1e-4  # relative max difference to eager (fp32; 4 layers of reordered sums)


def build(kind: str, device: str, window: int | None = None):
    """A random model of the config ``kind`` (seeded: the same weights every run), in eval mode."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**SIZES)
    else:
        config = transformers.MistralConfig(**SIZES, sliding_window=window)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(device).eval()


def tokens(n: int, device: str, seed: int = 1) -> torch.Tensor:
    return torch.randint(SIZES["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def check_hidden(model, ids: torch.Tensor) -> dict[str, float]:
    """Every implementation's last hidden states against eager's: relative max difference."""
    out = {}
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        out[impl] = model.model(ids).last_hidden_state
    errors = {impl: _relative(out[impl], out["eager"]) for impl in IMPLS[1:]}
    for impl, err in errors.items():
        if not err <= TOLERANCE:
            raise AssertionError(
                f"{impl}: hidden states differ from eager by {err:.2e} (relative) > {TOLERANCE:.0e}; "
                f"not timing a wrong result"
            )
    return errors


Samples = dict[str, list[float]]


def timed_rounds(fns: dict, rounds: int, device: str, log=None) -> tuple[Samples, Samples]:
    """Wall seconds and process CPU seconds of each ``fns[impl]()`` in ``rounds`` interleaved
    rounds (after one warm-up each), the order rotating. CPU time (all threads) does not count
    the time the process waits for a core, so it moves less with the load than wall time does."""
    for fn in fns.values():
        fn()
    wall: Samples = {key: [] for key in fns}
    cpu: Samples = {key: [] for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for i in range(len(keys)):
            key = keys[(r + i) % len(keys)]
            fn = fns[key]
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            _sync(device)
            wall[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
        if log is not None:
            log(r, {key: (wall[key][-1], cpu[key][-1]) for key in fns})
    return wall, cpu


def prefill_fns(model, ids: torch.Tensor, impls=IMPLS) -> dict:
    def run(impl):
        def fn():
            model.set_attn_implementation(impl)
            return model(ids, logits_to_keep=1, use_cache=False)

        return fn

    return {impl: run(impl) for impl in impls}


def timed_once(fn, device: str) -> tuple[float, float]:
    """Wall and CPU seconds of one ``fn()``."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


class Decoder:
    """64 teacher-forced decode steps after a prefix, with HF's ``DynamicCache``: the prefix is
    prefilled once per implementation, and each timed run crops the cache back to it."""

    def __init__(self, model, prompt: torch.Tensor, steps: int):
        from transformers import DynamicCache

        self.model, self.prompt, self.steps = model, prompt, steps
        self.caches = {}
        for impl in IMPLS:
            model.set_attn_implementation(impl)
            cache = DynamicCache(config=model.config)
            first = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            self.caches[impl] = (cache, first)

    def greedy(self, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy tokens (steps,) and their logits (steps, V) of ``impl`` from the prefix."""
        self.model.set_attn_implementation(impl)
        cache, logits = self.caches[impl]
        picked, all_logits = [], []
        for _ in range(self.steps):
            token = logits.argmax(-1, keepdim=True)  # (1, 1)
            picked.append(token)
            logits = self.model(token, past_key_values=cache, use_cache=True).logits[:, -1]
            all_logits.append(logits)
        cache.crop(-self.steps)  # back to the prefix
        return torch.cat(picked, dim=1)[0], torch.cat(all_logits)

    def lockstep(self, forced: torch.Tensor, rounds: int, device: str, log=None) -> tuple[Samples, Samples]:
        """Wall and CPU seconds of every step of every implementation: the three caches advance
        together, each step timed for each implementation in turn (the order rotating), so that
        the load of a shared machine at that moment falls on all three alike. After each round
        of the steps every cache is cropped back to the prefix."""
        wall: Samples = {impl: [] for impl in IMPLS}
        cpu: Samples = {impl: [] for impl in IMPLS}
        for r in range(rounds + 1):  # round 0 warms up (allocator, plans) and is not kept
            for t in range(self.steps):
                token = forced[t].view(1, 1)
                for i in range(len(IMPLS)):
                    impl = IMPLS[(t + r + i) % len(IMPLS)]
                    self.model.set_attn_implementation(impl)
                    _sync(device)
                    t0, c0 = time.perf_counter(), time.process_time()
                    self.model(token, past_key_values=self.caches[impl][0], use_cache=True)
                    _sync(device)
                    if r > 0:
                        wall[impl].append(time.perf_counter() - t0)
                        cpu[impl].append(time.process_time() - c0)
            for cache, _ in self.caches.values():
                cache.crop(-self.steps)  # back to the prefix
            if log is not None and r > 0:
                n = self.steps
                log(r - 1, {impl: (sum(wall[impl][-n:]) / n, sum(cpu[impl][-n:]) / n) for impl in IMPLS})
        return wall, cpu


def summarise(case: str, samples: tuple[Samples, Samples]) -> dict:
    """Median wall milliseconds of one sample (a forward, a step), and the ratios of the medians,
    of wall time and of CPU time."""
    wall, cpu = samples
    med = {impl: statistics.median(s) * 1e3 for impl, s in wall.items()}
    med_cpu = {impl: statistics.median(s) * 1e3 for impl, s in cpu.items()}
    row: dict = {"case": case}
    for impl in IMPLS:
        row[f"{impl} ms"] = med[impl]
    row["multihead/sdpa"] = med["multihead"] / med["sdpa"]
    row["eager/multihead"] = med["eager"] / med["multihead"]
    row["eager/sdpa"] = med["eager"] / med["sdpa"]
    row["cpu multihead/sdpa"] = med_cpu["multihead"] / med_cpu["sdpa"]
    row["cpu eager/multihead"] = med_cpu["eager"] / med_cpu["multihead"]
    row["least multihead/sdpa"] = min(wall["multihead"]) / min(wall["sdpa"])
    row["rounds"] = len(wall["sdpa"])  # eager: one run in the window cases
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 16 decode steps, one window")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    parser.add_argument("--only", nargs="*", choices=("prefill", "decode", "window"), help="run only these parts")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    try:
        import transformers
    except ImportError:
        print("transformers not installed: skipped (pip install -e '.[hf]')")
        return []
    import multihead.integrations.hf as mh_hf

    mh_hf.register()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = 16 if args.quick else 64
    windows = (1024,) if args.quick else (1024, 512)
    parts = args.only or ("prefill", "decode", "window")
    print(
        f"# Hugging Face models, attn_implementation eager / sdpa / multihead ({context()}; "
        f"transformers {transformers.__version__}; device {args.device}, fp32, batch 1)"
    )
    print(f"sizes: {SIZES}")

    def log(r, times):
        print(
            f"  round {r}: " + ", ".join(f"{k} {w * 1e3:.1f} ms (cpu {c * 1e3:.0f})" for k, (w, c) in times.items()),
            flush=True,
        )

    rows = []
    with torch.no_grad():
        if "prefill" in parts or "decode" in parts:
            model = build("llama", args.device)
            ids = tokens(1024, args.device)
            errors = check_hidden(model, ids)
            print(
                "\nLlama, 1024 tokens: hidden states vs eager (relative max difference): "
                + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
            )
            if "prefill" in parts:
                print(f"prefill 1024 tokens, {rounds} rounds; {machine_state()}")
                samples = timed_rounds(prefill_fns(model, ids), rounds, args.device, log)
                rows.append(summarise("prefill 1024", samples) | {"load": machine_state()})
                print(f"after: {machine_state()}")
            if "decode" in parts:
                decoder = Decoder(model, ids, steps)
                picked, want = decoder.greedy("eager")
                for impl in IMPLS[1:]:
                    got_tokens, got = decoder.greedy(impl)
                    err = _relative(got, want)
                    if not torch.equal(got_tokens, picked) or not err <= TOLERANCE:
                        raise AssertionError(
                            f"{impl}: decode steps differ from eager (tokens equal: "
                            f"{torch.equal(got_tokens, picked)}, logits {err:.2e} relative)"
                        )
                    print(f"decode {steps} steps, {impl}: the same greedy tokens as eager, logits {err:.1e} relative")
                print(f"decode {steps} steps from 1024 tokens, {rounds} rounds; {machine_state()}")
                samples = decoder.lockstep(picked, rounds, args.device, log)
                case = f"decode step ({steps} x {rounds}) after 1024"
                rows.append(summarise(case, samples) | {"load": machine_state()})
                print(f"after: {machine_state()}")
            del model
        if "window" in parts:
            ids = tokens(4096, args.device, seed=2)
            for w in windows:
                model = build("mistral", args.device, window=w)
                errors = check_hidden(model, ids)
                print(
                    f"\nMistral sliding_window={w}, 4096 tokens: hidden states vs eager: "
                    + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
                )
                print(f"prefill 4096 tokens, window {w}, {rounds} rounds of sdpa and multihead; {machine_state()}")
                wall, cpu = timed_rounds(prefill_fns(model, ids, IMPLS[1:]), rounds, args.device, log)
                wall["eager"], cpu["eager"] = ([x] for x in timed_once(prefill_fns(model, ids)["eager"], args.device))
                print(f"  eager, once: {wall['eager'][0] * 1e3:.0f} ms (cpu {cpu['eager'][0] * 1e3:.0f})")
                rows.append(summarise(f"prefill 4096, window {w}", (wall, cpu)) | {"load": machine_state()})
                print(f"after: {machine_state()}")
                del model
    table = [{k: v for k, v in r.items() if k != "load"} for r in rows]
    print_table(
        f"Hugging Face model, median ms of {rounds} interleaved rounds ({THREADS} threads, {args.device}); "
        f"{machine_state()}",
        table,
    )
    for r in rows:
        if r["case"].startswith("prefill 1024"):
            print(
                f"prefill 1024: multihead {r['multihead/sdpa']:.3f}x sdpa (target <= 1.05), "
                f"{r['eager/multihead']:.2f}x faster than eager (target >= 1.3; sdpa: {r['eager/sdpa']:.2f}x)"
            )
        elif r["case"].startswith("decode"):
            print(f"decode step: multihead {r['multihead/sdpa']:.3f}x sdpa (target <= 1: no slower)")
        else:
            print(f"{r['case']}: multihead {r['multihead/sdpa']:.3f}x sdpa (target < 1: faster)")
    if rows:
        write_csv(
            "hf"
            + ("_quick" if args.quick else "")
            + ("" if args.device == "cpu" else f"_{args.device}")
            + ("" if THREADS == 2 else f"_{THREADS}threads"),
            rows,
        )
    return rows


if __name__ == "__main__":
    main()
