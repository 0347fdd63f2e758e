"""Band runs (``multihead.backends.band_runs``): one kernel call for the interior blocks of a band
against one call per block, idle and under load; and the whole sliding-window attention, forward
and backward, as blocksparse runs it today against the prototype that uses band runs.

``B=1, H=8, D=64``, fp32, ``sliding_window(512)`` (bottom-right, causal right edge), blocks of
256 rows, L=16384 (4096 with ``--quick``). Contenders on the interior rows ``[q0, q1)``:

* ``one call``: :func:`run_forward` / :func:`run_backward`, the blocks folded into the batch;
* ``per-block loop``: the same kernel call with the same ``(block, span)`` mask, once per block
  (the same arithmetic, ``n`` parallel regions instead of one).

And the whole attention, forward and forward+backward: ``multihead.attention(...,
backend="blocksparse")`` against :func:`band_run_attention` (interior in one call, the edge rows
in one SDPA call each: at most three kernel calls, differentiable). Each set is timed with no
load added and while :func:`common.background_load` keeps every core busy, in interleaved rounds
(:func:`common.fastest_ms`); ratios are taken within a condition. ``--blocks 128 512`` also
times the one call at other block sizes.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from common import THREADS, background_load, check_close, context, fastest_ms, machine_state, mh, print_table, write_csv
from multihead.backends.band_runs import BandRun, interior_run, run_backward, run_forward

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def band_run_attention(q, k, v, window: int, block: int = 256):
    """``attention(q, k, v, mask=sliding_window(window))`` (bottom-right, ``Lq <= Lk``) in at most
    three kernel calls, differentiable: the interior query blocks in ONE call (band runs), the
    edge rows before and after them in one SDPA call each, with the mask of the keys they see::

        rows [0, q0)    keys [0, q0 + hi)       mask (q0, q0 + hi): the band, offset hi = Lk - Lq
        rows [q1, Lq)   keys [q1 + lo, Lk)      mask (Lq - q1, Lk - q1 - lo): offset hi - lo = window

    A sketch of how the blocksparse backend can use :mod:`multihead.backends.band_runs`.
    """
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    lo, hi = Lk - Lq - window, Lk - Lq  # query i sees keys i + lo .. i + hi
    run = interior_run(Lq, Lk, block=block, lo=lo, hi=hi)
    mask = mh.sliding_window(window)
    if run is None or Lq > Lk:
        return mh.attention(q, k, v, mask=mask)
    parts = []
    for rows, keys in ((slice(0, run.q0), slice(0, run.q0 + hi)), (slice(run.q1, Lq), slice(run.q1 + lo, Lk))):
        if rows.stop > rows.start:  # an edge: a (1, 1, rows, keys) bool mask, bottom-right in the edge's lengths
            edge = mask.materialize(1, 1, rows.stop - rows.start, keys.stop - keys.start)
            parts.append(F.scaled_dot_product_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], attn_mask=edge))
    parts.insert(1 if run.q0 > 0 else 0, _InteriorRun.apply(q, k, v, run, D**-0.5))  # (B, H, q1 - q0, D)
    return torch.cat(parts, dim=2)  # (B, H, Lq, D)


class _InteriorRun(torch.autograd.Function):
    """The rows of a :class:`BandRun` as an autograd node: forward and backward one call each."""

    @staticmethod
    def forward(ctx, q, k, v, run: BandRun, scale: float):
        out, lse = run_forward(q, k, v, run, scale)  # (B, Hq, q1 - q0, D), (B, Hq, q1 - q0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.run, ctx.scale = run, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq_rows, dk, dv = run_backward(grad_out, q, k, v, out, lse, ctx.run, ctx.scale)
        dq = torch.zeros_like(q)
        dq[:, :, ctx.run.q0 : ctx.run.q1] = dq_rows
        return dq, dk, dv, None, None


def per_block_forward(q, k, v, run: BandRun, scale: float):
    """The same rows with one kernel call per block (same mask, same arithmetic)."""
    mask = _mask(run, q.dtype)
    outs = [
        _flash(
            q[:, :, r : r + run.block],
            k[:, :, r + run.lo : r + run.lo + run.span],
            v[:, :, r + run.lo : r + run.lo + run.span],
            0.0,
            False,
            attn_mask=mask,
            scale=scale,
        )
        for r in range(run.q0, run.q1, run.block)
    ]
    return torch.cat([o for o, _ in outs], dim=2), torch.cat([lse for _, lse in outs], dim=2)


def per_block_backward(grad_out, q, k, v, out, lse, run: BandRun, scale: float):
    mask = _mask(run, q.dtype)
    dq, dk, dv = torch.zeros_like(out), torch.zeros_like(k), torch.zeros_like(v)
    for t, r in enumerate(range(run.q0, run.q1, run.block)):
        rows, local, keys = (
            slice(r, r + run.block),
            slice(t * run.block, (t + 1) * run.block),
            slice(r + run.lo, r + run.lo + run.span),
        )
        g_q, g_k, g_v = _flash_backward(
            grad_out[:, :, local],
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            out[:, :, local],
            lse[:, :, local],
            0.0,
            False,
            attn_mask=mask,
            scale=scale,
        )
        dq[:, :, local] = g_q
        dk[:, :, keys] += g_k
        dv[:, :, keys] += g_v
    return dq, dk, dv


def _mask(run: BandRun, dtype):
    s, c = torch.arange(run.block).unsqueeze(1), torch.arange(run.span).unsqueeze(0)
    visible = (c >= s) & (c <= s + run.hi - run.lo)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))[None, None]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="L=4096 instead of 16384, shorter timing")
    parser.add_argument("--load", choices=["python", "torch"], default="python", help="background load kind")
    parser.add_argument("--blocks", type=int, nargs="*", default=[], help="also time the one call at these block sizes")
    args = parser.parse_args(argv)
    L, window, block = (4096 if args.quick else 16384), 512, 256
    min_run_time, rounds = (0.3, 2) if args.quick else (1.0, 3)
    print(f"# band runs: L={L}, sliding_window({window}), block {block}, B=1 H=8 D=64 fp32  ({context()})")

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, 64, generator=gen) for _ in range(3))
    scale = 64**-0.5
    run = interior_run(L, L, block=block, lo=-window, hi=0)
    print(f"# interior run: rows [{run.q0}, {run.q1}), {run.blocks} blocks, keys [{run.k0}, {run.k1}), span {run.span}")
    mask = mh.sliding_window(window)
    out, lse = run_forward(q, k, v, run, scale)
    grad_rows = torch.randn(out.shape, generator=gen)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    grad_full = torch.randn(q.shape, generator=gen)

    # correctness first, on the inputs that are timed
    want = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    check_close("one call vs blocksparse", out, want[:, :, run.q0 : run.q1])
    check_close("per-block loop vs one call", per_block_forward(q, k, v, run, scale)[0], out)
    check_close("band_run_attention vs blocksparse", band_run_attention(q, k, v, window), want)
    one, loop = (
        run_backward(grad_rows, q, k, v, out, lse, run, scale),
        per_block_backward(grad_rows, q, k, v, out, lse, run, scale),
    )
    for name, a, b in zip(("dq", "dk", "dv"), one, loop):
        check_close(f"backward {name}: one call vs per-block loop", a, b, atol=1e-3)
    g_bs = torch.autograd.grad(mh.attention(qg, kg, vg, mask=mask, backend="blocksparse"), (qg, kg, vg), grad_full)
    g_br = torch.autograd.grad(band_run_attention(qg, kg, vg, window), (qg, kg, vg), grad_full)
    for name, a, b in zip(("dq", "dk", "dv"), g_br, g_bs):
        check_close(f"full backward {name}: band_run_attention vs blocksparse", a, b, atol=1e-3)

    contenders = {
        ("forward, interior rows", "one call"): lambda: run_forward(q, k, v, run, scale),
        ("forward, interior rows", "per-block loop"): lambda: per_block_forward(q, k, v, run, scale),
        ("backward, interior rows", "one call"): lambda: run_backward(grad_rows, q, k, v, out, lse, run, scale),
        ("backward, interior rows", "per-block loop"): lambda: per_block_backward(
            grad_rows, q, k, v, out, lse, run, scale
        ),
        ("forward, whole attention", "band_run_attention"): lambda: band_run_attention(q, k, v, window),
        ("forward, whole attention", "blocksparse today"): lambda: mh.attention(
            q, k, v, mask=mask, backend="blocksparse"
        ),
        ("fwd+bwd, whole attention", "band_run_attention"): lambda: band_run_attention(qg, kg, vg, window).backward(
            grad_full
        ),
        ("fwd+bwd, whole attention", "blocksparse today"): lambda: mh.attention(
            qg, kg, vg, mask=mask, backend="blocksparse"
        ).backward(grad_full),
    }
    for b in args.blocks:
        r = interior_run(L, L, block=b, lo=-window, hi=0)
        contenders[("forward, interior rows", f"one call, block {b}")] = lambda r=r: run_forward(q, k, v, r, scale)

    times, load_used = {}, {}
    for loaded in (False, True):
        condition = f"{args.load} x2" if loaded else "none added"
        print(f"# {condition}: {machine_state()}", flush=True)
        with background_load(args.load) if loaded else contextlib.nullcontext({}) as report:
            best = fastest_ms(
                contenders,
                rounds,
                min_run_time,
                log=lambda key, ms: print(f"  {condition:10s} {key[0]:26s} {key[1]:22s} {ms:9.1f} ms", flush=True),
            )
        times.update({(key, loaded): ms for key, ms in best.items()})
        load_used[loaded] = report.get("load_cpu", 0.0)

    rows = []
    for pass_, name in contenders:
        base = "one call" if "interior" in pass_ else "band_run_attention"
        rows.append(
            {
                "pass": pass_,
                "contender": name,
                "idle_ms": times[(pass_, name), False],
                "loaded_ms": times[(pass_, name), True],
                "idle / band run": times[(pass_, name), False] / times[(pass_, base), False],
                "loaded / band run": times[(pass_, name), True] / times[(pass_, base), True],
                "load_cores_used": load_used[True],
                "L": L,
                "window": window,
                "block": block,
                "threads": THREADS,
                "torch": torch.__version__,
            }
        )
    print_table(
        f"band runs, L={L} w={window}: fastest of {rounds} interleaved rounds, ms and ratio to the band-run "
        f"contender of the same pass (load: {args.load} x2, {load_used[True]:.2f} cores used by it)",
        [
            {c: r[c] for c in ("pass", "contender", "idle_ms", "loaded_ms", "idle / band run", "loaded / band run")}
            for r in rows
        ],
    )
    write_csv("band_prototype" + ("_quick" if args.quick else ""), rows)
    return rows


if __name__ == "__main__":
    main()
