"""The Triton kernels of the ``triton_blocks`` backend: block-sparse flash attention, forward and
backward, iterating a tile plan (:mod:`multihead.backends.tile_plan`) and evaluating the mask of
partial tiles element by element from its mask program (:mod:`multihead.backends.mask_program`).

Imported only when the backend runs (``import multihead`` never imports triton). Triton decides at
import time whether its kernels are compiled for the GPU or run by its interpreter on CPU tensors
(``TRITON_INTERPRET=1``, read by ``triton.jit``); :data:`INTERPRETED` records which.

Notation (:mod:`multihead.conventions`): ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``,
``v (B, Hkv, Lk, Dv)``, ``G = Hq // Hkv``; query head ``h`` reads KV head ``h // G``, through
strides: K/V are never copied per query head. A program owns ``BM`` queries of one head (forward,
dQ) or ``BN`` keys of one KV head and every query head of its group (dK, dV), so no atomics.

The softmax runs in base 2 (``exp2``) on ``s · scale · log2(e)``, accumulated in fp32; the LSE
comes back in natural units. Every ``tl.dot`` casts its operands to ``DT`` with ``PREC``: the input
dtype at ``"tf32"`` (Triton's default; it governs fp32 inputs only) for fp16/bf16, fp32 at
``"ieee"`` for fp32 inputs (the test rule's baseline has no TF32 rounding), and fp32 at ``"ieee"``
for bf16 in the interpreter, whose bf16 ``tl.dot`` returns garbage (triton 3.9): a bf16 x bf16
product is exact in fp32, so that equals the tensor cores' result up to summation order.

A row that sees no key keeps ``m = -inf`` and ``l = 0``: its output is 0, its LSE ``-inf`` and its
gradients 0 (``conventions``: fully masked rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "LOG2E", "dot_operands", "forward", "backward_dq", "backward_dkdv"]

#: ``scale · log2(e)`` turns scores into the base-2 units of the kernels' ``exp2``.
LOG2E = 1.4426950408889634


@triton.jit
def _leaf(KIND: tl.constexpr, P, MD, b, offs_m, offs_n, q_ok, k_ok, BM: tl.constexpr, BN: tl.constexpr):
    """One leaf of the mask program at queries ``offs_m`` x keys ``offs_n`` of batch row ``b``, as
    0/1 ``(BM, BN)``. ``P``: the leaf's 8 int32 parameters, the first two the offsets it is read at
    (``Mask.shifted``); ``MD``: the int32 tables (offsets, lengths, ids) the parameters point into.
    The kinds and their parameters are written once, in mask_program.py."""
    qq = offs_m + tl.load(P)
    kk = offs_n + tl.load(P + 1)
    if KIND == 1:  # band: c - left <= key <= c + right, c = query + the batch row's offset
        left = tl.load(P + 2)
        has_left = tl.load(P + 3)
        right = tl.load(P + 4)
        has_right = tl.load(P + 5)
        c = (qq + tl.load(MD + tl.load(P + 6) + b))[:, None]
        ok = ((kk[None, :] >= c - left) | (has_left == 0)) & ((kk[None, :] <= c + right) | (has_right == 0))
    elif KIND == 2:  # key lengths: key < length of the batch row
        n = tl.load(MD + tl.load(P + 2) + b)
        ok = tl.broadcast_to((kk < n)[None, :], (BM, BN))
    elif KIND == 3:  # a bool table of valid keys (B, Lk)
        valid = tl.load(MD + tl.load(P + 2) + b * tl.load(P + 3) + kk, mask=k_ok, other=0)
        ok = tl.broadcast_to((valid != 0)[None, :], (BM, BN))
    else:  # 4 documents (ids equal), 5 document_causal (and place - count ordered)
        q_id = tl.load(MD + tl.load(P + 2) + b * tl.load(P + 3) + qq, mask=q_ok, other=-1)
        k_id = tl.load(MD + tl.load(P + 4) + b * tl.load(P + 5) + kk, mask=k_ok, other=-2)
        ok = q_id[:, None] == k_id[None, :]
        if KIND == 5:
            q_at = tl.load(MD + tl.load(P + 6) + b * tl.load(P + 3) + qq, mask=q_ok, other=0)
            k_at = tl.load(MD + tl.load(P + 7) + b * tl.load(P + 5) + kk, mask=k_ok, other=0)
            ok = ok & (k_at[None, :] <= q_at[:, None])
    return ok.to(tl.int64)


@triton.jit
def _visible(
    MP,
    MD,
    b,
    offs_m,
    offs_n,
    Lq,
    Lk,
    NLEAF: tl.constexpr,
    K0: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
    K3: tl.constexpr,
    K4: tl.constexpr,
    TABLE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """Which of queries ``offs_m`` x keys ``offs_n`` may attend: inside the call, and the mask's
    truth ``TABLE`` (bit ``i`` = the value of the whole expression when leaf ``j`` is bit ``j`` of
    ``i``) at the leaves' values: any ``& | ~`` of up to five leaves, with no code per expression."""
    q_ok = offs_m < Lq
    k_ok = offs_n < Lk
    ok = q_ok[:, None] & k_ok[None, :]
    if NLEAF > 0:
        idx = _leaf(K0, MP, MD, b, offs_m, offs_n, q_ok, k_ok, BM, BN)
        if NLEAF > 1:
            idx += 2 * _leaf(K1, MP + 8, MD, b, offs_m, offs_n, q_ok, k_ok, BM, BN)
        if NLEAF > 2:
            idx += 4 * _leaf(K2, MP + 16, MD, b, offs_m, offs_n, q_ok, k_ok, BM, BN)
        if NLEAF > 3:
            idx += 8 * _leaf(K3, MP + 24, MD, b, offs_m, offs_n, q_ok, k_ok, BM, BN)
        if NLEAF > 4:
            idx += 16 * _leaf(K4, MP + 32, MD, b, offs_m, offs_n, q_ok, k_ok, BM, BN)
        ok = ok & (((tl.full((BM, BN), TABLE, tl.int64) >> idx) & 1) != 0)
    return ok


@triton.jit
def _modified(x, h, offs_m, offs_n, RB, srbh, cap, Lq, Lk, HAS_REL: tl.constexpr, HAS_CAP: tl.constexpr,
              CAP_FIRST: tl.constexpr):  # fmt: skip
    """The scaled scores ``x (BM, BN)`` after the score program (score_program.py): a relative bias
    ``RB[h, kv - q + Lq - 1]`` and ``cap · tanh(x / cap)`` in the program's order, and the
    derivative of the result by ``x`` (softcap's ``1 - tanh²``; the bias adds 1). A ``-inf`` stays
    ``-inf`` through the softcap (``Chain``'s rule)."""
    grad = tl.full(x.shape, 1.0, tl.float32)
    if HAS_CAP:
        if CAP_FIRST:
            t = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)  # tanh(x / cap), saturating without NaN
            x = tl.where(x == float("-inf"), float("-inf"), cap * t)
            grad = 1.0 - t * t
    if HAS_REL:
        inside = (offs_m < Lq)[:, None] & (offs_n < Lk)[None, :]
        x = x + tl.load(RB + h * srbh + (offs_n[None, :] - offs_m[:, None] + Lq - 1), mask=inside, other=0.0)
    if HAS_CAP:
        if not CAP_FIRST:
            t = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)
            x = tl.where(x == float("-inf"), float("-inf"), cap * t)
            grad = 1.0 - t * t
    return x, grad


@triton.jit
def forward(
    Q,
    K,
    V,
    O,
    LSE,
    PTR,
    COLS,
    MP,
    MD,
    RB,
    srbh,
    cap,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sob,
    soh,
    som,
    sod,
    H,
    G,
    Lq,
    Lk,
    qk_scale,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    NLEAF: tl.constexpr,
    K0: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
    K3: tl.constexpr,
    K4: tl.constexpr,
    TABLE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
    MODS: tl.constexpr,
    HAS_REL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    CAP_FIRST: tl.constexpr,
):
    """Grid ``(query tiles, B·Hq)``. ``PTR (tiles, 4)``: the query tile's partial key tiles
    ``COLS[PTR[0]:PTR[1]]`` (mask evaluated) and full ones ``COLS[PTR[2]:PTR[3]]`` (no mask).
    Writes ``O`` (input dtype) and ``LSE (B·Hq, Lq)`` fp32, natural log."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: b · stride and bh · Lq may pass 2**31
    b = bh // H
    h = bh % H
    kh = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q_ok = offs_m < Lq
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=q_ok[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    k_base = K + b * skb + kh * skh
    v_base = V + b * svb + kh * svh
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.full((BM,), 0.0, tl.float32)
    acc = tl.full((BM, BDV), 0.0, tl.float32)
    row = PTR + pid_m * 4
    for j in tl.static_range(2):  # partial tiles (the mask evaluated), then full ones
        for i in range(tl.load(row + 2 * j), tl.load(row + 2 * j + 1)):
            offs_n = tl.load(COLS + i) * BN + tl.arange(0, BN)
            k_ok = offs_n < Lk
            kt = tl.load(
                k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
                mask=k_ok[None, :] & (offs_d < D)[:, None],
                other=0.0,
            )  # (BD, BN)
            s = tl.dot(q.to(DT), kt.to(DT), input_precision=PREC)  # (BM, BN)
            if MODS:
                s, _ = _modified(s * scale, h, offs_m, offs_n, RB, srbh, cap, Lq, Lk, HAS_REL, HAS_CAP, CAP_FIRST)
                s = s * 1.4426950408889634  # log2 units
            else:
                s = s * qk_scale
            if j == 0:
                ok = _visible(MP, MD, b, offs_m, offs_n, Lq, Lk, NLEAF, K0, K1, K2, K3, K4, TABLE, BM, BN)
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: exp2(-inf - 0) = 0
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                mask=k_ok[:, None] & (offs_dv < DV)[None, :],
                other=0.0,
            )  # (BN, BDV)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DT), v.to(DT), input_precision=PREC)
            m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]  # a row that saw nothing has acc = 0: output 0
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(
        O + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
        out.to(O.dtype.element_ty),
        mask=q_ok[:, None] & (offs_dv < DV)[None, :],
    )
    tl.store(LSE + bh * Lq + offs_m, lse, mask=q_ok)


@triton.jit
def backward_dq(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    PTR,
    COLS,
    MP,
    MD,
    RB,
    srbh,
    cap,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdqb,
    sdqh,
    sdqm,
    sdqd,
    H,
    G,
    Lq,
    Lk,
    qk_scale,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    NLEAF: tl.constexpr,
    K0: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
    K3: tl.constexpr,
    K4: tl.constexpr,
    TABLE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
    MODS: tl.constexpr,
    HAS_REL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    CAP_FIRST: tl.constexpr,
):
    """Grid ``(query tiles, B·Hq)``, the forward's plan: ``dQ = scale · dS K`` with
    ``dS = P ∘ (dP - delta)``, ``dP = dO Vᵀ``, ``delta = rowsum(dO ∘ O) - dLSE``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: b · stride and bh · Lq may pass 2**31
    b = bh // H
    h = bh % H
    kh = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q_ok = offs_m < Lq
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=q_ok[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
        mask=q_ok[:, None] & (offs_dv < DV)[None, :],
        other=0.0,
    )
    lse = tl.load(LSE + bh * Lq + offs_m, mask=q_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + bh * Lq + offs_m, mask=q_ok, other=0.0)
    k_base = K + b * skb + kh * skh
    v_base = V + b * svb + kh * svh
    dq = tl.full((BM, BD), 0.0, tl.float32)
    row = PTR + pid_m * 4
    for j in tl.static_range(2):  # partial tiles (the mask evaluated), then full ones
        for i in range(tl.load(row + 2 * j), tl.load(row + 2 * j + 1)):
            offs_n = tl.load(COLS + i) * BN + tl.arange(0, BN)
            k_ok = offs_n < Lk
            kt = tl.load(
                k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
                mask=k_ok[None, :] & (offs_d < D)[:, None],
                other=0.0,
            )  # (BD, BN)
            vt = tl.load(
                v_base + offs_n[None, :] * svn + offs_dv[:, None] * svd,
                mask=k_ok[None, :] & (offs_dv < DV)[:, None],
                other=0.0,
            )  # (BDV, BN)
            s = tl.dot(q.to(DT), kt.to(DT), input_precision=PREC)
            if MODS:
                s, dmod = _modified(s * scale, h, offs_m, offs_n, RB, srbh, cap, Lq, Lk, HAS_REL, HAS_CAP, CAP_FIRST)
                s = s * 1.4426950408889634
            else:
                s = s * qk_scale
            if j == 0:
                ok = _visible(MP, MD, b, offs_m, offs_n, Lq, Lk, NLEAF, K0, K1, K2, K3, K4, TABLE, BM, BN)
            else:
                ok = q_ok[:, None] & k_ok[None, :]
            p = tl.math.exp2(tl.where(ok, s, float("-inf")) - lse2[:, None])  # (BM, BN)
            dp = tl.dot(do.to(DT), vt.to(DT), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            if MODS:
                ds = ds * dmod  # through softcap: d cap·tanh(x/cap) / dx
            dq += tl.dot(ds.to(kt.dtype).to(DT), tl.trans(kt).to(DT), input_precision=PREC)
    tl.store(
        DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
        (dq * scale).to(DQ.dtype.element_ty),
        mask=q_ok[:, None] & (offs_d < D)[None, :],
    )


@triton.jit
def backward_dkdv(
    Q,
    K,
    V,
    DO,
    DK,
    DV_,
    LSE,
    DELTA,
    PTR,
    ROWS,
    MP,
    MD,
    RB,
    srbh,
    cap,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdkb,
    sdkh,
    sdkn,
    sdkd,
    sdvb,
    sdvh,
    sdvn,
    sdvd,
    H,
    HKV,
    G,
    Lq,
    Lk,
    qk_scale,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    NLEAF: tl.constexpr,
    K0: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
    K3: tl.constexpr,
    K4: tl.constexpr,
    TABLE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
    MODS: tl.constexpr,
    HAS_REL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    CAP_FIRST: tl.constexpr,
):
    """Grid ``(key tiles, B·Hkv)``, the transposed plan (``PTR`` per key tile, query tiles in
    ``ROWS``): ``dV = Σ Pᵀ dO`` and ``dK = scale · Σ dSᵀ Q`` over the ``G`` query heads of the KV
    head, summed here (GQA without copies or atomics)."""
    pid_n = tl.program_id(0)
    bkh = tl.program_id(1).to(tl.int64)  # int64: b · stride and bh · Lq may pass 2**31
    b = bkh // HKV
    kh = bkh % HKV
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    k_ok = offs_n < Lk
    kt = tl.load(
        K + b * skb + kh * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
        mask=k_ok[None, :] & (offs_d < D)[:, None],
        other=0.0,
    )  # (BD, BN)
    vt = tl.load(
        V + b * svb + kh * svh + offs_n[None, :] * svn + offs_dv[:, None] * svd,
        mask=k_ok[None, :] & (offs_dv < DV)[:, None],
        other=0.0,
    )  # (BDV, BN)
    dk = tl.full((BN, BD), 0.0, tl.float32)
    dv = tl.full((BN, BDV), 0.0, tl.float32)
    row = PTR + pid_n * 4
    for g in range(G):
        h = kh * G + g
        bh = b * H + h
        for j in tl.static_range(2):  # partial tiles (the mask evaluated), then full ones
            for i in range(tl.load(row + 2 * j), tl.load(row + 2 * j + 1)):
                offs_m = tl.load(ROWS + i) * BM + tl.arange(0, BM)
                q_ok = offs_m < Lq
                q = tl.load(
                    Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=q_ok[:, None] & (offs_d < D)[None, :],
                    other=0.0,
                )
                do = tl.load(
                    DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                    mask=q_ok[:, None] & (offs_dv < DV)[None, :],
                    other=0.0,
                )
                lse = tl.load(LSE + bh * Lq + offs_m, mask=q_ok, other=float("-inf"))
                lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
                delta = tl.load(DELTA + bh * Lq + offs_m, mask=q_ok, other=0.0)
                s = tl.dot(q.to(DT), kt.to(DT), input_precision=PREC)
                if MODS:
                    s, dmod = _modified(
                        s * scale, h, offs_m, offs_n, RB, srbh, cap, Lq, Lk, HAS_REL, HAS_CAP, CAP_FIRST
                    )
                    s = s * 1.4426950408889634
                else:
                    s = s * qk_scale
                if j == 0:
                    ok = _visible(MP, MD, b, offs_m, offs_n, Lq, Lk, NLEAF, K0, K1, K2, K3, K4, TABLE, BM, BN)
                else:
                    ok = q_ok[:, None] & k_ok[None, :]
                p = tl.math.exp2(tl.where(ok, s, float("-inf")) - lse2[:, None])  # (BM, BN)
                dv += tl.dot(tl.trans(p.to(do.dtype)).to(DT), do.to(DT), input_precision=PREC)
                dp = tl.dot(do.to(DT), vt.to(DT), input_precision=PREC)
                ds = p * (dp - delta[:, None])
                if MODS:
                    ds = ds * dmod
                dk += tl.dot(tl.trans(ds.to(q.dtype)).to(DT), q.to(DT), input_precision=PREC)
    tl.store(
        DK + b * sdkb + kh * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
        (dk * scale).to(DK.dtype.element_ty),
        mask=k_ok[:, None] & (offs_d < D)[None, :],
    )
    tl.store(
        DV_ + b * sdvb + kh * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :] * sdvd,
        dv.to(DV_.dtype.element_ty),
        mask=k_ok[:, None] & (offs_dv < DV)[None, :],
    )


def dot_operands(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """``(DT, PREC)`` of every ``tl.dot`` for inputs of ``dtype`` (see the module's docstring)."""
    if dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16):
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


#: Whether these kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module was
#: imported): CPU tensors then, CUDA tensors otherwise.
INTERPRETED = type(forward).__name__ == "InterpretedFunction"
