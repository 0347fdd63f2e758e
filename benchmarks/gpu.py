"""GPU benchmarks (CUDA only): ``multihead`` against PyTorch's fused kernels on one card.

Not part of ``run_all.py``'s suite (that one runs on CPU). Commands, from the repository root:

    python benchmarks/gpu.py                       # all four sections, default grid (~4.5 min on an H100)
    python benchmarks/gpu.py --only sweep          # one or more of: sweep structured tiles layer decode
    python benchmarks/gpu.py --only sweep --full   # the whole FlashAttention grid: 6 lengths (~4 min)
    python benchmarks/gpu.py --only sweep --passes fwd fwdbwd
    python benchmarks/gpu.py --budget 600          # seconds for the whole run (default 320)
    python benchmarks/gpu.py --dry-run             # every code path at tiny sizes, on CPU (no CUDA needed)

Measured on an H100 80GB (torch 2.11+cu130, triton 3.6, cold compile caches): sweep 88 s with
fwd and fwd+bwd, about 110 s with the default three passes (flex compiles included), structured
114 s, layer 4 s, decode 18 s; the default run is about 4.5 min.

Sections (each writes ``benchmarks/results/gpu_<section>.csv``, the GPU's name in every row):

* ``sweep``: the FlashAttention sweep, ``B·L = 16384`` tokens, hidden 2048 (``H = 2048/D``), D 64
  and 128, causal and not, bf16, passes fwd, bwd, fwd+bwd. Default: L in {1k, 4k, 16k};
  ``--full``: L in {512, 1k, 2k, 4k, 8k, 16k}. Contenders: ``multihead.attention``
  (auto), SDPA pinned to FLASH_ATTENTION / EFFICIENT_ATTENTION / CUDNN_ATTENTION (a kernel that
  refuses the input is "n/a" with its reason), compiled FlexAttention (block mask built once,
  outside the timed region) and multihead's own Triton kernels (``backend="triton_blocks"``).
  TFLOP/s with the FlashAttention count: forward ``4·B·L²·H·D``, halved when causal; backward
  2.5x, fwd+bwd 3.5x the forward. The forward is timed with grad enabled on inputs that require
  grad (as FlashAttention's own benchmark does), so one compiled flex graph serves every pass.
  ``bwd`` is the backward alone on a retained graph; compiled flex refuses ``retain_graph``, so
  its bwd is fwd+bwd minus fwd (said in the row's notes).
* ``structured``: sliding window (1024, 4096; causal) and packed documents (random lengths
  averaging 2k, causal within each) at L 8k / 16k / 32k, B=1 H=16 D=128 bf16, fwd and fwd+bwd:
  multihead with the mask object (auto, and forced to ``triton_blocks``), SDPA with a dense bool
  mask (EFFICIENT_ATTENTION), compiled flex with the same block structure, and multihead's dense
  causal run at the same L (passes: fwd and fwd+bwd unless ``--passes``). TFLOP/s per *unmasked*
  FLOP (``4·D·H·B·visible``, visible counted from the dense mask), and the ratio to the
  dense-causal TFLOP/s (``tb/dense causal``: triton_blocks', the issue-34 target >= 0.9;
  ``tb/flex``: triton_blocks over compiled flex, target >= 1.0).
* ``tiles``: the ``triton_blocks`` backend with each of ``TILE_CONFIGS`` (tiles, warps, stages)
  on causal, window 1024 and packed documents at L 16k, B=1 H=16 D=128 bf16, fwd and fwd+bwd:
  TFLOP/s per unmasked FLOP, from which its defaults are chosen.
* ``layer``: ``multihead.MultiHeadAttention`` at B=8 L=1024 E=768 H=12 causal, fwd and fwd+bwd,
  fp32 with TF32 on and bf16, against a fused-QKV + SDPA module and ``nn.MultiheadAttention``
  (need_weights=False, causal attn_mask); ms and tokens/s.
* ``decode``: one decode step, Hq=32 Hkv=8 D=128 bf16, cache 1k..128k, batch 1/8/64 (K/V over
  20 GiB skipped): multihead auto, SDPA ``enable_gqa=True``, compiled flex; GB/s of K/V read and
  % of the card's device-to-device copy bandwidth (read + write bytes) measured in the run (a
  pure read can come out slightly above 100% of it).

Every contender's output is checked against SDPA's math kernel in fp32 on a slice (relative to
the output's magnitude) before it is timed. Timer: ``triton.testing.do_bench`` (median) when
triton imports, else CUDA events (warm-up, median of 30). Each section, and each configuration
in it, is guarded: a failure prints its error and the run goes on. ``--budget`` splits the run's
seconds over the sections; a section past its share skips its remaining configurations (said
so), so the later sections still run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

from common import mh, print_table, write_csv
from layers import FusedSDPA  # the hand-written floor, as the CPU layer benchmark runs it

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # very old torch: the pinned-kernel contenders report n/a
    SDPBackend = sdpa_kernel = None

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    create_block_mask = flex_attention = None

try:
    from triton.testing import do_bench
except Exception:  # noqa: BLE001 (no triton, or a broken install: CUDA events instead)
    do_bench = None

SECTIONS = ("sweep", "structured", "tiles", "layer", "decode")
SHARES = {"sweep": 0.42, "structured": 0.33, "tiles": 0.15, "layer": 0.08, "decode": 0.17}  # of --budget
PASSES = ("fwd", "bwd", "fwdbwd")
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}  # FlashAttention's count, times the forward
GiB = 1 << 30


class Run:
    """Settings of this run: device, sizes (tiny under --dry-run), the GPU's name, deadlines."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.gpu = "dry-run (cpu)" if self.dry else torch.cuda.get_device_name()
        self.full = args.full
        self.passes = args.passes or list(PASSES)  # the sweep's
        self.struct_passes = args.passes or ["fwd", "fwdbwd"]
        self.deadline = float("inf")
        self.flex = None
        self.tag = "_dryrun" if self.dry else ""

    def over(self, what: str) -> bool:
        if time.time() > self.deadline:
            print(f"  skipped {what}: past this section's share of --budget", flush=True)
            return True
        return False

    def compiled_flex(self):
        """``torch.compile(flex_attention)``, compiled lazily per shape; never the eager fallback."""
        if flex_attention is None:
            raise RuntimeError("torch.nn.attention.flex_attention is not importable in this torch")
        if self.flex is None:
            import torch._dynamo.config as dynamo_config

            # Every (mask_mod, head dim, grad mode) is a new entry; past the limit dynamo would
            # silently run flex eagerly (the whole score matrix in memory), so raise the limits.
            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
                if hasattr(dynamo_config, name):
                    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
            self.flex = torch.compile(flex_attention)
        return self.flex

    def block_mask(self, mask_mod, L: int):
        return create_block_mask(mask_mod, None, None, L, L, device=self.device)


# --------------------------------------------------------------------------------------------
# timing, checks, formatting


def bench_ms(run: Run, fn, grad_to_none=None) -> float:
    """Median milliseconds of ``fn()``: do_bench, CUDA events, or (dry run) perf_counter."""
    if run.dry:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    if do_bench is not None:
        try:
            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
        except TypeError:  # a triton without return_mode
            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.5])[0])
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        for t in grad_to_none or ():
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest absolute value of the reference."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def short(e: BaseException, n: int = 110) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= n else text[: n - 3] + "..."


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(run: Run) -> None:
    if not run.dry:
        torch.cuda.synchronize()


def explain_lines(q, k, v, mask) -> tuple[str, str, str]:
    """The ``backend:`` and ``PyTorch kernel:`` lines of ``multihead.explain`` for this call, and
    the whole plan (the chosen backend's ``  - `` lines) joined by ``|``."""
    text = str(mh.explain(q, k, v, mask=mask, probe=False))
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("backend:")), len(lines))
    plan = []
    for ln in lines[start + 1 :]:
        if not ln.startswith("  - "):
            break
        plan.append(ln[4:].strip())
    backend = next(
        (ln.split("backend:", 1)[1].split("(")[0].strip() for ln in text.splitlines() if ln.startswith("backend:")), "?"
    )
    kernel = next(
        (ln.split("PyTorch kernel:", 1)[1].strip() for ln in text.splitlines() if "PyTorch kernel:" in ln), ""
    )
    return backend, kernel, " | ".join(plan)


def time_passes(run: Run, fn, passes, inputs, dout) -> tuple[dict, str]:
    """Milliseconds of each pass of ``fn`` (which returns the output) and a note. ``bwd``: the
    backward alone on a retained graph; where that fails (a compiled graph may refuse
    ``retain_graph``), fwd+bwd minus fwd, said in the note."""
    ms, note = {}, ""

    def fwd():
        return fn()

    def fwdbwd():
        fn().backward(dout)

    for p in passes:
        if p == "fwd":
            ms[p] = bench_ms(run, fwd)
        elif p == "fwdbwd":
            ms[p] = bench_ms(run, fwdbwd, grad_to_none=inputs)
        elif p == "bwd":
            try:
                out = fn()
                ms[p] = bench_ms(run, lambda: out.backward(dout, retain_graph=True), grad_to_none=inputs)
                del out
            except Exception as e:  # noqa: BLE001
                f = ms.get("fwd") or bench_ms(run, fwd)
                fb = ms.get("fwdbwd") or bench_ms(run, fwdbwd, grad_to_none=inputs)
                ms[p], note = fb - f, f"bwd = fwdbwd - fwd ({short(e, 60)})"
    for t in inputs:
        t.grad = None
    return ms, note


def measure(run: Run, contenders: dict, check, passes, inputs, dout) -> tuple[dict, dict]:
    """Check each contender (``check(out)`` returns the relative error or raises), then time its
    passes. Returns ``{name: {pass: ms}}`` and ``{name: reason or note}``."""
    times, notes = {}, {}
    for name, fn in contenders.items():
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn()  # SDPA says why a pinned kernel refuses only in warnings
            err = check(out)
            del out
            times[name], note = time_passes(run, fn, passes, inputs, dout)
            if note:
                notes[name] = note
            print(
                f"    {name}: err {err:.1e}, " + ", ".join(f"{p} {t:.3f} ms" for p, t in times[name].items()),
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 (a refusing kernel or a failed check: n/a, go on)
            why = " ".join(dict.fromkeys(" ".join(str(w.message).split()) for w in caught))
            notes[name] = "n/a: " + short(e) + (f" [{why[:300]}]" if why else "")
            print(f"    {name}: n/a ({short(e, 300)})" + (f"\n      warnings: {why[:600]}" if why else ""), flush=True)
            for t in inputs:
                t.grad = None
            free()
    return times, notes


def checker(ref: torch.Tensor, take, tol: float):
    def check(out: torch.Tensor) -> float:
        err = rel_err(take(out), ref)
        if not err <= tol:
            raise AssertionError(f"relative error {err:.2e} > {tol:.0e} against the fp32 math result")
        return err

    return check


def pinned_sdpa(kernel_name: str, q, k, v, **kw):
    """``F.scaled_dot_product_attention`` allowed only ``SDPBackend.<kernel_name>``."""
    if sdpa_kernel is None:
        raise RuntimeError("torch.nn.attention.sdpa_kernel is not available")
    backend = getattr(SDPBackend, kernel_name)

    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    return fn


def math_ref(q, k, v, **kw) -> torch.Tensor:
    """SDPA's math kernel in fp32: the reference every contender is checked against."""
    q, k, v = (t.detach().float() for t in (q, k, v))
    if sdpa_kernel is None:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def write(run: Run, section: str, rows: list[dict]) -> None:
    if not rows:
        print(f"(no rows for {section}: no CSV written)")
        return
    cols = list(dict.fromkeys(c for r in rows for c in r))  # union of columns, in first-seen order
    write_csv(f"gpu_{section}{run.tag}", [{c: r.get(c) for c in cols} for r in rows])


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------
# 1. the FlashAttention sweep


def causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


SWEEP_CONTENDERS = ("multihead", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex", "triton_blocks")


def sweep(run: Run) -> list[dict]:
    tokens, hidden = (256, 128) if run.dry else (16384, 2048)
    if run.dry:
        lengths = [64, 128]
    elif run.full:
        lengths = [512, 1024, 2048, 4096, 8192, 16384]
    else:
        lengths = [1024, 4096, 16384]
    print(f"B*L = {tokens} tokens, hidden {hidden}, bf16, passes {run.passes}, L {lengths}")
    rows = []
    for D in (128, 64):
        for causal in (True, False):
            for L in lengths:
                what = f"D={D} causal={causal} L={L}"
                if run.over(what):
                    continue
                print(f"  {what}", flush=True)
                try:
                    rows += sweep_config(run, tokens // L, hidden // D, L, D, causal)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    print(f"  {what} failed: {short(e, 300)}", flush=True)
                free()
    for D in (128, 64):
        table = [
            {
                "L": r["L"],
                "causal": r["causal"],
                "pass": r["pass"],
                **{c: r[f"{c}_TFLOPs"] if r[f"{c}_TFLOPs"] is not None else "n/a" for c in SWEEP_CONTENDERS},
                "fastest": r["fastest"],
                "mh/fastest": r["multihead/fastest"],
                "mh backend": r["mh_backend"],
            }
            for r in rows
            if r["D"] == D
        ]
        print_table(f"sweep D={D}: TFLOP/s (mh/fastest: multihead's time over the fastest's, 1.00 = fastest)", table)
    write(run, "sweep", rows)
    return rows


def sweep_config(run: Run, B: int, H: int, L: int, D: int, causal: bool) -> list[dict]:
    gen = torch.Generator(device=run.device).manual_seed(L * 1009 + D * 2 + causal)
    q, k, v, dout = (torch.randn(B, H, L, D, device=run.device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    mask = mh.causal() if causal else None
    ref = math_ref(q[:1, :2], k[:1, :2], v[:1, :2], is_causal=causal)  # fp32 reference on a slice
    check = checker(ref, lambda out: out[:1, :2], 3e-2)
    mh_backend, mh_kernel, mh_plan = explain_lines(q, k, v, mask)
    print(f"    multihead explain: backend: {mh_backend}; PyTorch kernel: {mh_kernel or '-'}", flush=True)
    if mh_backend != "sdpa":
        print(f"      plan: {mh_plan}", flush=True)
    contenders = {
        "multihead": lambda: mh.attention(q, k, v, mask=mask),
        "sdpa_flash": pinned_sdpa("FLASH_ATTENTION", q, k, v, is_causal=causal),
        "sdpa_efficient": pinned_sdpa("EFFICIENT_ATTENTION", q, k, v, is_causal=causal),
        "sdpa_cudnn": pinned_sdpa("CUDNN_ATTENTION", q, k, v, is_causal=causal),
        "triton_blocks": lambda: mh.attention(q, k, v, mask=mask, backend="triton_blocks"),
    }
    try:
        flex = run.compiled_flex()
        block_mask = run.block_mask(causal_mod, L) if causal else None  # once, outside the timed region
        contenders["flex"] = lambda: flex(q, k, v, block_mask=block_mask)
    except Exception as e:  # noqa: BLE001
        contenders["flex"] = _raiser(e)
    t0 = time.time()
    times, notes = measure(run, contenders, check, run.passes, inputs, dout)
    print(f"    ({time.time() - t0:.1f} s)", flush=True)
    fwd_flops = 4 * B * L * L * H * D / (2 if causal else 1)
    rows = []
    for p in run.passes:
        ms = {c: times.get(c, {}).get(p) for c in SWEEP_CONTENDERS}
        measured = {c: t for c, t in ms.items() if t is not None}
        fastest = min(measured, key=measured.get) if measured else None
        row = {"gpu": run.gpu, "D": D, "H": H, "B": B, "L": L, "causal": causal, "pass": p}
        for c in SWEEP_CONTENDERS:
            row[f"{c}_ms"] = ms[c]
            row[f"{c}_TFLOPs"] = tflops(PASS_FLOPS[p] * fwd_flops, ms[c])
        row["fastest"] = fastest
        row["multihead/fastest"] = ms["multihead"] / measured[fastest] if ms["multihead"] and fastest else None
        row["mh_backend"], row["mh_kernel"], row["mh_plan"] = mh_backend, mh_kernel, mh_plan
        row["notes"] = "; ".join(f"{c}: {n}" for c, n in notes.items())
        rows.append(row)
    return rows


def _raiser(e: BaseException):
    def fn():
        raise e

    return fn


# --------------------------------------------------------------------------------------------
# 2. structured masks: sliding window, packed documents

_DOC: dict[str, torch.Tensor] = {}  # the document ids the flex mask_mod reads (one function: no recompiles)


def document_mod(b, h, q_idx, kv_idx):
    ids = _DOC["ids"]
    return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)


def window_mod(w: int):
    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= w)

    return mod


def doc_ids(L: int, mean: int, device, seed: int) -> torch.Tensor:
    """Packed documents with lengths uniform in [mean/8, 2·mean - mean/8] (average ``mean``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < L:
        n = int(torch.randint(mean // 8, 2 * mean - mean // 8 + 1, (1,), generator=gen))
        lengths.append(min(n, L - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)


def dense_mask(kind: str, L: int, device, w: int = 0, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The ``(L, L)`` bool mask (True = may attend), built without L² integer intermediates."""
    allowed = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    if kind == "window":
        allowed &= ~torch.ones(L, L, dtype=torch.bool, device=device).tril(-w - 1)
    elif kind == "documents":
        allowed &= ids[:, None] == ids[None, :]
    return allowed


STRUCT_CONTENDERS = ("multihead", "sdpa_dense_mask", "flex", "triton_blocks")
DENSE_MASK_LIMIT = 4 * GiB  # bytes of the bool mask (SDPA's efficient kernel adds a bf16 copy)


def structured(run: Run) -> list[dict]:
    if run.dry:
        lengths, H, D, windows, doc_mean = [128, 256], 2, 32, [16, 32], 32
    else:
        lengths, H, D, windows, doc_mean = [8192, 16384, 32768], 16, 128, [1024, 4096], 2048
    print(f"B=1 H={H} D={D} bf16, passes {run.struct_passes}, L {lengths}, windows {windows}, documents ~{doc_mean}")
    rows = []
    for L in lengths:
        cases = [("dense causal", {})] + [(f"window {w}", {"w": w}) for w in windows]
        cases += [(f"documents ~{doc_mean}", {"ids": doc_ids(L, doc_mean, run.device, seed=L)})]
        for name, spec in cases:
            what = f"L={L} {name}"
            if run.over(what):
                continue
            print(f"  {what}", flush=True)
            try:
                rows += structured_config(run, L, H, D, name, spec)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                print(f"  {what} failed: {short(e, 300)}", flush=True)
            free()
    # ratio to multihead's dense causal TFLOP/s at the same L and pass
    dense = {(r["L"], r["pass"]): r["multihead_TFLOPs"] for r in rows if r["mask"] == "dense causal"}
    for r in rows:
        base = dense.get((r["L"], r["pass"]))
        for c in STRUCT_CONTENDERS:
            t = r.get(f"{c}_TFLOPs")
            r[f"{c}/dense_causal"] = t / base if t and base else None
    table = [
        {
            "L": r["L"],
            "mask": r["mask"],
            "visible %": 100 * r["visible"] / r["L"] ** 2,
            "pass": r["pass"],
            **{c: r[f"{c}_TFLOPs"] if r[f"{c}_TFLOPs"] is not None else "n/a" for c in STRUCT_CONTENDERS},
            "mh/dense causal": r["multihead/dense_causal"],
            "tb/dense causal": r["triton_blocks/dense_causal"],
            "tb/flex": r["triton_blocks_TFLOPs"] / r["flex_TFLOPs"]
            if r.get("triton_blocks_TFLOPs") and r.get("flex_TFLOPs")
            else None,
            "mh backend": r["mh_backend"],
        }
        for r in rows
    ]
    print_table("structured: TFLOP/s per unmasked FLOP (mh/dense causal: ratio to dense-causal TFLOP/s)", table)
    write(run, "structured", rows)
    return rows


def structured_config(run: Run, L: int, H: int, D: int, name: str, spec: dict) -> list[dict]:
    gen = torch.Generator(device=run.device).manual_seed(L + len(name))
    q, k, v, dout = (torch.randn(1, H, L, D, device=run.device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    if name == "dense causal":
        kind, mask, mask_mod = "causal", mh.causal(), causal_mod
    elif "w" in spec:
        kind, mask, mask_mod = "window", mh.sliding_window(spec["w"]), window_mod(spec["w"])
    else:
        kind, mask, mask_mod = "documents", mh.document_causal(spec["ids"]), document_mod
        _DOC["ids"] = spec["ids"]
    allowed = dense_mask(kind, L, run.device, w=spec.get("w", 0), ids=spec.get("ids"))
    visible = int(allowed.sum())
    ref = math_ref(q[:, :1], k[:, :1], v[:, :1], attn_mask=allowed)  # fp32, head 0
    check = checker(ref, lambda out: out[:, :1], 3e-2)
    mh_backend, mh_kernel, mh_plan = explain_lines(q, k, v, mask)
    print(f"    multihead explain: backend: {mh_backend}; PyTorch kernel: {mh_kernel or '-'}", flush=True)
    if mh_backend != "sdpa":
        print(f"      plan: {mh_plan}", flush=True)
    contenders = {
        "multihead": lambda: mh.attention(q, k, v, mask=mask),
        "triton_blocks": lambda: mh.attention(q, k, v, mask=mask, backend="triton_blocks"),
    }
    if kind != "causal":
        if L * L <= DENSE_MASK_LIMIT:
            contenders["sdpa_dense_mask"] = pinned_sdpa("EFFICIENT_ATTENTION", q, k, v, attn_mask=allowed)
            if run.dry:  # no efficient kernel on CPU: the default choice, so the path still runs
                contenders["sdpa_dense_mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        try:
            flex = run.compiled_flex()
            block_mask = run.block_mask(mask_mod, L)
            contenders["flex"] = lambda: flex(q, k, v, block_mask=block_mask)
        except Exception as e:  # noqa: BLE001
            contenders["flex"] = _raiser(e)
    else:
        del allowed  # the dense causal row is multihead's own run; no need for the mask
    t0 = time.time()
    times, notes = measure(run, contenders, check, run.struct_passes, inputs, dout)
    print(f"    ({time.time() - t0:.1f} s)", flush=True)
    rows = []
    for p in run.struct_passes:
        flops = PASS_FLOPS[p] * 4 * D * H * visible  # B = 1
        row = {"gpu": run.gpu, "L": L, "H": H, "D": D, "mask": name, "visible": visible, "pass": p}
        for c in STRUCT_CONTENDERS:
            ms = times.get(c, {}).get(p)
            row[f"{c}_ms"], row[f"{c}_TFLOPs"] = ms, tflops(flops, ms)
        row["mh_backend"], row["mh_kernel"], row["mh_plan"] = mh_backend, mh_kernel, mh_plan
        row["notes"] = "; ".join(f"{c}: {n}" for c, n in notes.items())
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# 2b. the triton_blocks backend's tiles and launch settings

#: triton_blocks.Tiles(forward, dkdv, warps, stages) as tuples: the backend's defaults first, then
#: shapes worth trying on Hopper for head dim 128 (benchmarks/triton_compile.py: their spills).
TILE_CONFIGS = [
    ((128, 64), (32, 64), (8, 8, 8), (3, 2, 3)),
    ((128, 128), (32, 64), (8, 8, 8), (2, 2, 3)),
    ((64, 64), (32, 64), (4, 8, 8), (3, 3, 3)),
    ((128, 64), (32, 64), (8, 8, 4), (3, 2, 3)),
    ((128, 64), (32, 128), (8, 8, 8), (3, 2, 2)),
    ((128, 64), (16, 64), (8, 8, 4), (3, 2, 3)),
    ((128, 64), (64, 64), (8, 8, 8), (3, 2, 3)),
]


def tiles(run: Run) -> list[dict]:
    """``triton_blocks`` with each of :data:`TILE_CONFIGS` on a causal, a windowed and a packed-
    documents call (B=1 H=16 D=128 bf16, L 16k), fwd and fwd+bwd: TFLOP/s per unmasked FLOP, so
    that the backend's defaults are chosen by measurement."""
    from multihead.backends.triton_blocks import Tiles, TritonBlocksBackend

    L, H, D = (256, 2, 32) if run.dry else (16384, 16, 128)
    gen = torch.Generator(device=run.device).manual_seed(7)
    q, k, v, dout = (torch.randn(1, H, L, D, device=run.device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    ids = doc_ids(L, 32 if run.dry else 2048, run.device, seed=L)
    masks = {
        "causal": (mh.causal(), dense_mask("causal", L, run.device)),
        "window 1024": (mh.sliding_window(1024), dense_mask("window", L, run.device, w=1024)),
        "documents": (mh.document_causal(ids), dense_mask("documents", L, run.device, ids=ids)),
    }
    rows = []
    for name, (mask, allowed) in masks.items():
        visible = int(allowed.sum())
        ref = math_ref(q[:, :1], k[:, :1], v[:, :1], attn_mask=allowed)
        check = checker(ref, lambda out: out[:, :1], 3e-2)
        for config in TILE_CONFIGS:
            what = f"{name} tiles {config}"
            if run.over(what):
                continue
            tiles = Tiles(*config)
            backend = mh.get_backend("triton_blocks")  # the default, put back after the trial
            mh.register_backend(TritonBlocksBackend(tiles))
            try:
                print(f"  {what}", flush=True)
                contenders = {"triton_blocks": lambda: mh.attention(q, k, v, mask=mask, backend="triton_blocks")}
                times, notes = measure(run, contenders, check, run.struct_passes, inputs, dout)
            finally:
                mh.register_backend(backend)
            for p in run.struct_passes:
                ms = times.get("triton_blocks", {}).get(p)
                flops = PASS_FLOPS[p] * 4 * D * H * visible
                rows.append(
                    {
                        "gpu": run.gpu,
                        "L": L,
                        "mask": name,
                        "pass": p,
                        "forward": "x".join(map(str, tiles.forward)),
                        "dkdv": "x".join(map(str, tiles.dkdv)),
                        "warps": "/".join(map(str, tiles.warps)),
                        "stages": "/".join(map(str, tiles.stages)),
                        "ms": ms,
                        "TFLOPs": tflops(flops, ms),
                        "notes": notes.get("triton_blocks", ""),
                    }
                )
            free()
    print_table(
        "triton_blocks tiles: TFLOP/s per unmasked FLOP",
        [{k: r[k] for k in ("mask", "pass", "forward", "dkdv", "warps", "stages", "TFLOPs")} for r in rows],
    )  # fmt: skip
    write(run, "tiles", rows)
    return rows


# --------------------------------------------------------------------------------------------
# 3. the layer


def layer(run: Run) -> list[dict]:
    B, L, E, H = (2, 64, 64, 4) if run.dry else (8, 1024, 768, 12)
    print(f"B={B} L={L} E={E} H={H} causal; fwd (no_grad, eval) and fwdbwd (train, input grad too)")
    rows = []
    for label, dtype in (("fp32+tf32", torch.float32), ("bf16", torch.bfloat16)):
        if run.over(label):
            continue
        print(f"  {label}", flush=True)
        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        try:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dtype == torch.float32
            rows += layer_config(run, B, L, E, H, label, dtype)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            print(f"  {label} failed: {short(e, 300)}", flush=True)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        free()
    print_table("layer: ms (tokens/s); ratio = multihead's time over the fused SDPA module's", rows)
    write(run, "layer", rows)
    return rows


def layer_config(run: Run, B: int, L: int, E: int, H: int, label: str, dtype) -> list[dict]:
    torch.manual_seed(0)
    ours = mh.MultiHeadAttention(E, H, causal=True)
    twin = mh.MultiHeadAttention(E, H)
    twin.load_state_dict(ours.state_dict())
    torch_mha = twin.to_torch()  # PyTorch's class takes its causal mask at call time
    fused = FusedSDPA(E, H)
    with torch.no_grad():
        fused.qkv.weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        fused.qkv.bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        fused.out.load_state_dict(ours.out_proj.state_dict())
    mods = {"multihead": ours, "multihead_compiled": ours, "fused_sdpa": fused, "nn_mha": torch_mha}
    for m in mods.values():
        m.to(device=run.device, dtype=dtype)
    blocked = torch.ones(L, L, dtype=torch.bool, device=run.device).triu(1)  # PyTorch's polarity: True = blocked
    compiled = torch.compile(ours)  # the same module: its Python path traced away
    calls = {
        "multihead": lambda x: ours(x),
        "multihead_compiled": lambda x: compiled(x),
        "fused_sdpa": lambda x: fused(x),
        "nn_mha": lambda x: torch_mha(x, x, x, attn_mask=blocked, is_causal=True, need_weights=False)[0],
    }
    x = torch.randn(B, L, E, device=run.device, dtype=dtype)
    xg = x.clone().requires_grad_()
    dout = torch.randn_like(x)
    params = [p for m in mods.values() for p in m.parameters()]
    tol = 2e-2 if dtype == torch.float32 else 5e-2  # TF32 / bf16 projections, relative to the output's magnitude
    for m in mods.values():
        m.eval()
    with torch.no_grad():
        ref = calls["fused_sdpa"](x)
        errs = {name: rel_err(fn(x), ref) for name, fn in calls.items()}
    print("    max error relative to the fused module's output: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    bad = [n for n, e in errs.items() if not e <= tol]
    rows = []
    for p in ("fwd", "fwdbwd"):
        row = {"gpu": run.gpu, "dtype": label, "pass": p, "B": B, "L": L, "E": E, "H": H}
        for name, call in calls.items():
            ms = None
            if name in bad:
                row["notes"] = (row.get("notes", "") + f"{name}: n/a, error {errs[name]:.1e} > {tol:.0e}; ").strip()
            else:
                try:
                    if p == "fwd":
                        mods[name].eval()

                        def fn(call=call):
                            with torch.no_grad():
                                return call(x)

                        ms = bench_ms(run, fn)
                    else:
                        mods[name].train()
                        ms = bench_ms(run, lambda call=call: call(xg).backward(dout), grad_to_none=[xg, *params])
                except Exception as e:  # noqa: BLE001
                    row["notes"] = (row.get("notes", "") + f"{name}: n/a, {short(e)}; ").strip()
            row[f"{name}_ms"] = ms
            row[f"{name}_tok/s"] = None if ms is None else B * L / (ms * 1e-3)
        m_ms, f_ms = row["multihead_ms"], row["fused_sdpa_ms"]
        row["multihead/fused_sdpa"] = m_ms / f_ms if m_ms and f_ms else None
        c_ms = row["multihead_compiled_ms"]
        row["multihead_compiled/fused_sdpa"] = c_ms / f_ms if c_ms and f_ms else None
        shown = {n: row[f"{n}_ms"] for n in calls}
        print(
            f"    {p}: " + ", ".join(f"{n} {'n/a' if t is None else f'{t:.3f} ms'}" for n, t in shown.items()),
            flush=True,
        )
        rows.append(row)
    for t in [xg, *params]:
        t.grad = None
    return rows


# --------------------------------------------------------------------------------------------
# 4. the decode step


def copy_bandwidth(run: Run) -> float:
    """GB/s of a device-to-device copy, read + write bytes (BENCHMARKS.md's ceiling for decode)."""
    n = (1 << 20) if run.dry else GiB
    src = torch.empty(n, dtype=torch.uint8, device=run.device).fill_(1)
    dst = torch.empty_like(src)
    ms = bench_ms(run, lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


DECODE_CONTENDERS = ("multihead", "sdpa_gqa", "flex")


def decode(run: Run) -> list[dict]:
    if run.dry:
        Hq, Hkv, D, caches, batches, limit = 8, 2, 32, [64, 256], [1, 2], GiB
    else:
        Hq, Hkv, D, caches, batches, limit = 32, 8, 128, [1024, 4096, 16384, 65536, 131072], [1, 8, 64], 20 * GiB
    copy_gbps = copy_bandwidth(run)
    print(f"Hq={Hq} Hkv={Hkv} D={D} bf16, Lq=1; device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    rows = []
    for B in batches:
        for Lk in caches:
            kv_bytes = 2 * B * Hkv * Lk * D * 2
            what = f"B={B} Lk={Lk} ({kv_bytes / GiB:.2f} GiB K/V)"
            if kv_bytes > limit:
                print(f"  skipped {what}: K/V over {limit / GiB:.0f} GiB")
                continue
            if run.over(what):
                continue
            print(f"  {what}", flush=True)
            try:
                rows.append(decode_config(run, B, Lk, Hq, Hkv, D, kv_bytes, copy_gbps))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                print(f"  {what} failed: {short(e, 300)}", flush=True)
            free()
    table = [
        {
            "B": r["B"],
            "Lk": r["Lk"],
            "K/V MiB": r["KV_bytes"] / 2**20,
            **{
                c: "n/a" if r[f"{c}_GBps"] is None else f"{r[f'{c}_GBps']:.0f} ({r[f'{c}_%copy']:.0f}%)"
                for c in DECODE_CONTENDERS
            },
            "mh/sdpa_gqa": r["multihead/sdpa_gqa"],
            "mh backend": r["mh_backend"],
        }
        for r in rows
    ]
    print_table(f"decode: K/V GB/s (% of the {copy_gbps:.0f} GB/s copy bandwidth); mh/sdpa_gqa: time ratio", table)
    write(run, "decode", rows)
    return rows


def decode_config(run: Run, B: int, Lk: int, Hq: int, Hkv: int, D: int, kv_bytes: int, copy_gbps: float) -> dict:
    gen = torch.Generator(device=run.device).manual_seed(B * 100003 + Lk)
    q = torch.randn(B, Hq, 1, D, device=run.device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(B, Hkv, Lk, D, device=run.device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    G = Hq // Hkv
    # fp32 reference for batch element 0: K/V repeated to Hq heads for that one sequence only
    ref = math_ref(q[:1], k[:1].repeat_interleave(G, dim=1), v[:1].repeat_interleave(G, dim=1))
    check = checker(ref, lambda out: out[:1], 3e-2)
    mh_backend, mh_kernel, mh_plan = explain_lines(q, k, v, None)
    print(f"    multihead explain: backend: {mh_backend}; PyTorch kernel: {mh_kernel or '-'}", flush=True)
    if mh_backend != "sdpa":
        print(f"      plan: {mh_plan}", flush=True)
    contenders = {
        "multihead": lambda: mh.attention(q, k, v, mask=None),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    try:
        flex = run.compiled_flex()
        contenders["flex"] = lambda: flex(q, k, v, enable_gqa=True)
    except Exception as e:  # noqa: BLE001
        contenders["flex"] = _raiser(e)
    with torch.no_grad():
        times, notes = measure(run, contenders, check, ["fwd"], [], None)
    row = {"gpu": run.gpu, "B": B, "Lk": Lk, "Hq": Hq, "Hkv": Hkv, "D": D, "KV_bytes": kv_bytes, "copy_GBps": copy_gbps}
    for c in DECODE_CONTENDERS:
        ms = times.get(c, {}).get("fwd")
        row[f"{c}_us"] = None if ms is None else ms * 1e3
        row[f"{c}_GBps"] = None if ms is None else kv_bytes / (ms * 1e-3) / 1e9
        row[f"{c}_%copy"] = None if ms is None else 100 * row[f"{c}_GBps"] / copy_gbps
    m, s = times.get("multihead", {}).get("fwd"), times.get("sdpa_gqa", {}).get("fwd")
    row["multihead/sdpa_gqa"] = m / s if m and s else None
    row["mh_backend"], row["mh_kernel"], row["mh_plan"] = mh_backend, mh_kernel, mh_plan
    row["notes"] = "; ".join(f"{c}: {n}" for c, n in notes.items())
    return row


# --------------------------------------------------------------------------------------------


def header(run: Run) -> None:
    import platform

    if run.dry:
        print(f"# gpu benchmarks, DRY RUN on CPU (tiny sizes; timings mean nothing): torch {torch.__version__}")
        return
    driver = "?"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    except Exception:  # noqa: BLE001
        pass
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not importable"
    props = torch.cuda.get_device_properties(0)
    print(f"# gpu benchmarks: {run.gpu} ({props.total_memory / GiB:.0f} GiB, {props.multi_processor_count} SMs)")
    print(
        f"driver {driver}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}, triton {triton_version}, python {platform.python_version()}"
    )
    print(f"timer: {'triton.testing.do_bench (median)' if do_bench else 'CUDA events, median of 30'}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    parser.add_argument("--full", action="store_true", help="sweep: all six lengths and all three passes")
    parser.add_argument("--passes", nargs="+", choices=PASSES, help="sweep and structured: passes to time")
    parser.add_argument("--budget", type=float, default=320.0, help="seconds for the whole run (default 320)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: every code path, no CUDA")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False here); "
            "use --dry-run to exercise the code paths on CPU"
        )
    started, results = time.time(), {}
    run = Run(args)
    header(run)
    sections = [s for s in SECTIONS if not args.only or s in args.only]
    for i, name in enumerate(sections):
        remaining = args.budget - (time.time() - started)
        share = SHARES[name] / sum(SHARES[s] for s in sections[i:])
        run.deadline = time.time() + max(remaining, 0) * share
        print(f"\n# {name}  (share of the budget: {max(remaining, 0) * share:.0f} s)", flush=True)
        t0 = time.time()
        try:
            results[name] = globals()[name](run)
        except Exception as e:  # noqa: BLE001 (one section's failure must not cost the others)
            traceback.print_exc()
            print(f"section {name} failed: {short(e, 300)}", flush=True)
        free()
        print(f"({name}: {time.time() - t0:.0f} s)", flush=True)
    print(f"\ntotal {time.time() - started:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
