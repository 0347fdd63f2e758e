"""The ``decode`` backend: a few query tokens against a long KV cache, at the speed K/V are read.

A decode step reads the whole cache for one new token per sequence: its cost is moving ``K`` and
``V`` from memory, the arithmetic is a matrix-vector product. PyTorch's fused kernels are built
for long query blocks; with ``Lq`` of a few tokens and ``enable_gqa`` they read K/V at well
under half the memory bandwidth (``docs/performance.md``, "The decode path"). Here the
``G = Hq / Hkv`` query heads of each KV head are folded into the rows of ONE matmul per KV head,
so each KV head is read once, as it is, never expanded to ``Hq`` heads::

    q (B, Hq, Lq, D) -> (B, Hkv, G·Lq, D)      a view; query head h = kv·G + g (conventions.fold_query_heads)
    S = q Kᵀ            (B, Hkv, G·Lq, n)        one matmul per KV head over the n keys read
    S[~visible] = -inf                           visible (B|1, H|1, Lq, n): a small row mask, never Lq x Lk
    P = exp(S - max)    softmax dtype            fp32 for fp16/bf16 inputs (conventions.softmax_dtype)
    l = Σ P,  lse = max + log l,  O = P V / l  (B, Hkv, G·Lq, Dv) -> (B, Hq, Lq, Dv)

Which keys are read (``n`` above), decided once per call in :class:`_Plan`:

* no mask: every key;
* a structured mask (bands: ``causal``, ``sliding_window`` in either alignment or per sequence;
  ``key_padding``; their ``shifted`` blocks, ``&``, ``|``, ``~``): only ``mask.key_range`` (a
  window reads ``w + Lq`` keys, not ``Lk``); no mask at all when ``block_state`` says every key
  there is visible (``causal()`` with ``Lq == 1``);
* any other mask (a bool tensor such as a static cache's ``(B, 1, Lq, S)``, documents, positions,
  custom): evaluated on the rows of this call only, then the keys from the first to the last
  visible column are read (a static cache of ``S`` slots holding ``n`` tokens reads ``n`` keys).

Long key ranges with many query rows are split into chunks (split-K, as flash-decoding does) so
that the scores of a chunk stay within :data:`SCORES_PER_CHUNK` elements; the partial results
are joined by their log-sum-exp (:func:`multihead.merge_partials`).

Contract (:mod:`multihead.conventions`): fully masked rows give output 0 and LSE ``-inf``; the
LSE is returned from the same pass (fp32/fp64; for fp16/bf16 inputs, whose scores come from the
half GEMM rounded once, as exact as a naive computation in that dtype, ``attention()`` computes
the LSE from fp32 scores instead, so that it normalises the weights it recomputes).

A NaN or inf in a key or value that no query may see (``docs/conventions.md``: such a key can
hold anything, with or without ``check_finite``, as on ``sdpa`` and the reference): keys outside
the range read are never touched; inside it, a blocked key's score is replaced by ``-inf``
(``masked_fill``, NaN included), and a blocked value of NaN would make ``0 · NaN`` in ``P V``:
when a chunk's output is not finite, the values no row of the call sees are zeroed and ``P V``
redone (a look at the small output per masked chunk, not a pass over V on every call). With
autograd, keys and values no query sees are zeroed first, since ``dQ = dS K`` and ``dP = dO Vᵀ``
would compute ``0 · NaN``. A value that some row sees and another may not is ``0 · NaN`` for the
other row, as on the fused kernels (``check_finite=True`` marks exactly the rows that see it).
Under ``torch.compile`` there is no host synchronisation: every key is read, with the mask
evaluated on it, and the output is not looked at (``nonfinite.py``), so unused cache slots must
hold finite values (zeros). (``sdpa`` zeroes unseen keys there instead: one more pass over K/V,
which a memory-bound step cannot afford.)
Score modifiers and dropout are refused (``sdpa``/``blocksparse`` run them).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from multihead.backends import cpu_kernels, flash_pieces
from multihead.backends.base import Backend, Capabilities, Runner, named
from multihead.blocks import Block, Extent
from multihead.call import AttentionCall, AttentionResult
from multihead.conventions import fold_query_heads, group_query_heads, softmax_dtype, unfold_query_heads
from multihead.masks import BlockState, Mask
from multihead.merge import merge_partials
from multihead.scoring import unseen_keys

__all__ = ["DecodeBackend", "MAX_QUERIES", "AUTO_MAX_QUERIES", "AUTO_MIN_WORK", "SCORES_PER_CHUNK"]

#: The most query tokens a call may have: the scores of a chunk are ``B·Hq·Lq x chunk`` elements.
MAX_QUERIES = 64
#: ``auto`` takes this backend up to this many query tokens; measured (docs/performance.md).
AUTO_MAX_QUERIES = 8
#: ... and from this much work, ``B·Hq·Lk·D`` elements of K read per query head: below it SDPA's
#: one fused call costs less than the fold's ops (measured cold inside a Hugging Face model, one
#: thread, ``Hq=8, Hkv=2, D=64``: the fold loses at 1088 keys, ties at 2048 = 2^20, wins from 4096).
#: Eager calls only: under ``torch.compile`` the fold's ops fuse into a few Inductor kernels, and
#: ``sdpa`` there zeroes the unseen slots of a static cache (two copies of K/V per step), so a
#: compiled decode step takes this path at any size (measured: docs/performance.md#the-decode-path-decode).
AUTO_MIN_WORK = 1 << 20
#: Score elements (``B·Hq·Lq`` rows x keys) per chunk of the split-K loop: 64 MiB of fp32. Chunks
#: bound memory only: at one token the scores are ~2% of the K/V bytes, and each chunk adds a few
#: parallel regions, which cost more than they save on a shared machine (docs/performance.md).
SCORES_PER_CHUNK = 1 << 24
_MIN_CHUNK = 1024
#: fp32 query rows per KV head (``G·Lq``) padded with zero rows up to 6 before ``q Kᵀ`` when the
#: K/V of the call stream from memory: there MKL's fp32 GEMM against a transposed K reads 6 rows
#: faster than 4, while on K/V that stay in cache the padding costs more than it saves; 1 and 2
#: rows run at memory speed as they are (measured: docs/performance.md#the-decode-path-decode).
_PADDED_ROWS = {3: 6, 4: 6, 5: 6}
_PAD_MIN_BYTES = 128 << 20  # K/V bytes read by the call
# Mask kinds whose key_range and block_state are answered from a few integers (no data read).
_STRUCTURAL = frozenset({"band", "key_padding"})
_HALF = (torch.float16, torch.bfloat16)


class DecodeBackend(Backend):
    """The ``decode`` backend: few query tokens: each KV head's query heads folded into one matmul; K/V read
    once, never expanded. What it runs is declared in its ``capabilities``; why it refuses a call, in
    ``explain()``."""

    name = "decode"
    summary = "few query tokens: each KV head's query heads folded into one matmul; K/V read once, never expanded"
    capabilities = Capabilities(
        score_mods=frozenset(),
        dropout=False,
        native_lse=True,
        masks="every mask, as a row mask over the keys each call reads (bands and key padding by their key range)",
    )

    def __init__(self, chunk_size: int | None = None, kernel: str = "auto"):
        """``chunk_size``: keys per chunk; ``None``: as many as keep a chunk's scores within
        :data:`SCORES_PER_CHUNK` elements (at least 1024 keys). ``kernel``: ``"auto"`` runs
        multihead's CPU decode kernel (:mod:`~multihead.backends.cpu_kernels`) where it is built and
        takes the call (CPU, fp32/bf16/fp16, no autograd, eager), PyTorch's GEMMs elsewhere;
        ``"torch"`` always PyTorch's GEMMs."""
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(
                f"DecodeBackend: chunk_size must be a positive int (keys per chunk) or None, got {chunk_size!r}"
            )
        if kernel not in ("auto", "torch"):
            raise ValueError(f"DecodeBackend: kernel must be 'auto' or 'torch', got {kernel!r}")
        self.chunk_size = chunk_size
        self.kernel = kernel

    def _chunk(self, call: AttentionCall) -> int:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        return self.chunk_size or max(_MIN_CHUNK, SCORES_PER_CHUNK // (B * Hq * Lq))

    # ------------------------------------------------------------------------------- dispatch
    def refusals(self, call: AttentionCall) -> list[str]:
        reasons = super().refusals(call)
        Lq = call.shape[3]
        if not isinstance(Lq, int):  # a torch.SymInt: comparing it would fix the length of the traced graph
            reasons.append(
                f"Lq={Lq} is symbolic (torch.export's Dim, dynamic torch.compile): one graph for "
                "every length, and this path is for a few query tokens; sdpa traces into one"
            )
        elif Lq > MAX_QUERIES:
            reasons.append(
                f"{named('Lq', Lq)} > {MAX_QUERIES} query tokens: a decode path for a few new tokens; "
                "a prefill runs on a fused kernel (sdpa, blocksparse)"
            )
        return reasons

    def auto_refusals(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        if call.q.device.type != "cpu":
            return [f"measured on CPU only; on {call.q.device.type} the fused kernels are the default"]
        if Lq > AUTO_MAX_QUERIES:
            return [
                f"{named('Lq', Lq)} > {AUTO_MAX_QUERIES}: prefill-shaped, the fused kernels are faster here "
                "(docs/performance.md, the decode path)"
            ]
        if not torch.compiler.is_compiling() and B * Hq * Lk * D < AUTO_MIN_WORK:
            work = named("B·Hq·Lk·D", B * Hq * Lk * D)
            return [f"a tiny call ({work} < {AUTO_MIN_WORK}): one fused SDPA call costs less than the fold's few ops"]
        offset = None if call.mask is None else call.mask.causal_offset(Lq, Lk)
        sees_all = call.mask is None or (offset is not None and offset >= Lk - 1)
        # With two head sizes (MLA: V the first Dv features of K), sdpa's kernel first makes them one
        # (a wider output or a padded copy), and this path, reading them as they are, is faster.
        # measured: docs/performance.md#the-decode-path-decode
        if (
            Hq > Hkv
            and sees_all
            and D == Dv
            and call.score_mod is None
            and call.q.dtype not in _HALF
            and not torch.compiler.is_compiling()
            and not (self.kernel == "auto" and not call.requires_grad and cpu_kernels.supports(call.q, call.k, call.v))
        ):
            return [
                "every query sees every key (fp32) and the CPU decode kernel does not take the call: sdpa folds "
                "each KV head's query heads into the rows of one fused call, as this path's GEMMs do, and runs "
                "faster (docs/performance.md); fp16/bf16 steps and two head sizes (D != Dv) run here"
            ]
        return []

    def plan(self, call: AttentionCall) -> list[str]:
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        plan = _Plan(call, self._chunk(call), self.kernel)
        G = Hq // plan.kv_heads
        lines = []
        if plan.kv_heads != Hkv:
            lines.append(f"K/V heads are one head expanded (stride 0): read once as MQA, all {Hq} query heads folded")
        lines.append(
            f"heads: the {G} query head(s) of each of the {plan.kv_heads} KV head(s) folded into the rows of "
            f"one matmul per KV head ({G}x{Lq} = {G * Lq} rows x {D}) by {D} x keys; K/V never expanded"
        )
        lines.append(plan.note.format(mask=call.mask._describe()) if call.mask is not None else plan.note)
        n = plan.hi - plan.lo
        if n > 0:
            chunks = -(-n // plan.chunk)
            lines.append(
                f"keys read: {n} of {Lk} ([{plan.lo}, {plan.hi}))"
                + (
                    f" in {chunks} chunks of <= {plan.chunk}, joined by log-sum-exp (merge_partials)"
                    if chunks > 1
                    else ""
                )
            )
        if plan.pad:
            lines.append(
                f"{G * Lq} query rows padded with {plan.pad} zero rows for q Kᵀ: on K/V streamed from memory "
                f"MKL's fp32 GEMM reads {G * Lq + plan.pad} rows faster than {G * Lq} (measured, docs/performance.md)"
            )
        if plan.native:
            banded = plan.blocked is None or cpu_kernels.bands(plan.blocked, G, Lq, plan.hi - plan.lo) is not None
            if cpu_kernels.tiles(call.k.dtype, G * Lq, D, Dv, not banded):
                lines.append(
                    f"kernel: multihead's CPU decode kernel (cpu_decode.c, built for this CPU) on the AMX tiles "
                    f"({G * Lq} query rows per KV head over bf16"
                    + ("" if plan.blocked is None else "; the mask as one range of keys per row")
                    + "): each key and value read once as stored, q Kᵀ and "
                    "P V as tile products accumulated in fp32 (the weights as "
                    + (
                        "two bf16 terms: 16 bits, for a half-precision call"
                        if call.q.dtype in _HALF
                        else "three bf16 terms: fp32's precision"
                    )
                    + "), softmax in fp32, one pass per KV head"
                )
                return lines
            lines.append(
                "kernel: multihead's CPU decode kernel (cpu_decode.c, built for this CPU): each key and value read "
                "once as stored, converted to fp32 in registers; scores, softmax and P V in fp32, one pass per KV head"
            )
            return lines
        if call.q.device.type == "cpu" and self.kernel == "auto":
            why = cpu_kernels.unavailable() or "it does not take this call (autograd, compile, dtype or head size)"
            lines.append(f"kernel: PyTorch's GEMMs (the CPU decode kernel: {why})")
        precision = {
            torch.float16: "fp32 (inputs fp16; matmuls in fp16, scores upcast)",
            torch.bfloat16: "fp32 (inputs bf16; matmuls in bf16, scores upcast)",
        }
        lines.append(
            "softmax in "
            + precision.get(call.q.dtype, str(call.q.dtype).replace("torch.", ""))
            + (
                "; log-sum-exp from the same pass"
                if call.q.dtype not in precision
                else "; log-sum-exp, when asked for, from fp32 scores in one blockwise pass (the half scores would "
                "not normalise the fp32 weights)"
            )
        )
        return lines

    # ------------------------------------------------------------------------------- running
    def backward_from_lse(
        self, call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """On CPU: the flash kernel's backward given the merged ``(out, lse)``: the gradient of the
        same exact attention, with no forward to replay (:func:`multihead.backends.flash_pieces.call_backward`)."""
        return flash_pieces.call_backward(call, out, lse, dout, dlse)

    def forward(self, call: AttentionCall) -> AttentionResult:
        plan = _Plan(call, self._chunk(call), self.kernel)
        # fp16/bf16: the scores are the half GEMM's, each rounded once (2^-9 of a score of 10 moves
        # its weight by 2%). An LSE of those would not normalise the weights attention() recomputes
        # from fp32 scores (a differential fuzzer found rows that did not sum to 1), so none is returned
        # and attention() computes it from fp32 scores, one blockwise pass, when it is asked for.
        exact = softmax_dtype(call.q.dtype) == call.q.dtype
        out, lse = plan.run(call.q, call.k, call.v, call.scale, call.requires_grad, call.return_lse and exact)
        return AttentionResult(out, None, lse if exact else None)

    def runner(self, call: AttentionCall) -> Runner:
        """Calls that repeat (same shapes, strides, mask value, scale: :mod:`multihead.plans`) reuse
        the plan: the key range, the row mask and the padding are decided once."""
        plan, scale, grad = _Plan(call, self._chunk(call), self.kernel), call.scale, call.requires_grad

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return plan.run(q, k, v, scale, grad, False)[0]

        return Runner(run, self.name)


def _scores(
    qg: Tensor, k: Tensor, blocked: Tensor | None, scale: float, acc: torch.dtype, G: int, Lq: int, matmul=torch.matmul
) -> Tensor:
    """``(B, Hkv, G·Lq, n)`` scores in the softmax dtype, ``-inf`` where blocked (fp16/bf16: a
    transposed view of key-major scores)."""
    if qg.dtype in _HALF:
        # K Qᵀ: K is the GEMM's streamed left operand, as it lies (B, Hkv, n, D); oneDNN's half GEMM
        # read a transposed K (q Kᵀ) at about half that speed (docs/performance.md#the-decode-path-decode).
        scores = matmul(k, qg.transpose(-2, -1)).transpose(-2, -1)  # (B, Hkv, G·Lq, n), key-major
    else:
        scores = matmul(qg, k.transpose(-2, -1))  # one matmul per KV head: K read once, as it is
    if scores.shape[2] != G * Lq:  # zero rows padded for the GEMM's sake (_PADDED_ROWS)
        scores = scores[:, :, : G * Lq]
    if scores.dtype != acc:  # fp16/bf16: the GEMM accumulated in fp32 and rounded once; row-major
        # again (reductions along a key-major view's rows ran an order of magnitude slower)
        scores = scores.to(acc, memory_format=torch.contiguous_format)
    if scale != 1.0:
        scores = scores.mul_(scale)
    if blocked is not None:  # masked_fill, not an additive -inf: a NaN score of a blocked key is replaced too
        scores.unflatten(2, (G, Lq)).masked_fill_(blocked, float("-inf"))
    return scores


def _attend(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    blocked: Tensor | None,
    scale: float,
    acc: torch.dtype,
    G: int,
    Lq: int,
    half: bool,
    need_lse: bool,
    matmul=torch.matmul,
    native: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """One chunk of keys, no autograd: the output ``(B, Hkv, G·Lq, Dv)`` normalised over these keys
    (``acc`` dtype; 0 on rows that see none) and the LSE ``(B, Hkv, G·Lq)`` (``-inf`` there) when
    ``need_lse``. Fused passes: the per-call cost of a one-token step is a handful of ops.
    ``matmul``: the two GEMMs (:mod:`~multihead.backends.decode_blocks` runs K/V views one head at a time).
    ``native``: run multihead's CPU decode kernel where it takes the call (fp32 out and LSE, always)."""
    if native and cpu_kernels.supports(qg, k, v, blocked):
        return cpu_kernels.decode_partial(qg[:, :, : G * Lq], k, v, scale, G, Lq, blocked)
    scores = _scores(qg, k, blocked, scale, acc, G, Lq, matmul)
    lse = torch.logsumexp(scores, dim=-1) if need_lse else None  # -inf on rows that see no key
    probs = torch.softmax(scores, dim=-1)  # NaN on rows that see no key: zeroed below
    if blocked is not None:
        B, kv_heads, rows, n = probs.shape
        empty = blocked.all(dim=-1, keepdim=True)  # (B|1, Hkv|1, G|1, Lq, 1)
        probs.view(B, kv_heads, G, Lq, n).masked_fill_(empty, 0.0)
    out = matmul(probs.to(v.dtype) if half else probs, v)  # V read once
    if blocked is not None and not torch.compiler.is_compiling() and not bool(torch.isfinite(out).all()):
        # A key no row of the call may see can hold anything (a cache's unused or stale slot, a
        # padded key), but its weight 0 times a NaN value is NaN in P V. Zeroing such values costs a
        # pass over V, so it is done only when the small output shows a non-finite entry (a NaN that
        # some row does see stays NaN, as the kernel gives it).
        unseen = blocked.all(dim=3).all(dim=2).unsqueeze(-1)  # (B|1, Hkv|1, n, 1): no row of the call sees it
        if bool(unseen.any()):
            v = torch.where(unseen, torch.zeros((), dtype=v.dtype, device=v.device), v)
            out = matmul(probs.to(v.dtype) if half else probs, v)
    return (out.to(acc) if half else out), lse


def _attend_with_grad(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    blocked: Tensor | None,
    scale: float,
    acc: torch.dtype,
    G: int,
    Lq: int,
    half: bool,
    need_lse: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`_attend` for autograd: exact zeros (never NaN) in the backward of fully masked rows."""
    scores = _scores(qg, k, blocked, scale, acc, G, Lq)
    peak = scores.amax(dim=-1, keepdim=True).detach()  # (B, Hkv, G·Lq, 1)
    peak = peak.masked_fill(torch.isneginf(peak), 0.0)  # rows that see no key: exp(-inf - 0) = 0
    probs = scores.sub_(peak).exp_()  # in place: autograd keeps exp's output, nothing changes it after
    total = probs.sum(dim=-1, keepdim=True)
    empty = total == 0
    safe = total.masked_fill(empty, 1.0)  # fully masked rows: 0 / 1, no 0/0
    lse = torch.where(empty, float("-inf"), peak + torch.log(safe)).squeeze(-1)
    if half:  # normalised before the cast: the output is rounded once, by the matmul
        out = torch.matmul((probs / safe).to(v.dtype), v).to(acc)
    else:
        out = torch.matmul(probs, v) / safe
    return out, lse


class _Plan:
    """What one call reads and how, decided once (``forward``, ``runner`` and ``plan`` agree); it
    holds no tensor of the call, only the row mask derived from the mask's value.

    Keys ``[lo, hi)`` are read (``lo == hi``: no row sees any key); ``blocked`` is ``None`` or
    ``(B|1, kv_heads|1, G|1, Lq, n)``, True where a query row may not see the key."""

    def __init__(self, call: AttentionCall, chunk: int, kernel: str = "auto"):
        B, Hq, Hkv, Lq, Lk, D, Dv = call.shape
        self.shape, self.chunk = call.shape, chunk
        # multihead's CPU kernel where it takes the call (checked again per chunk: the same answer)
        self.native = kernel == "auto" and not call.requires_grad and cpu_kernels.supports(call.q, call.k, call.v)
        # K/V expanded from one head (k1.expand(B, Hkv, ...)): every KV head is the same memory,
        # so it is MQA: one head read once, all Hq query heads folded into its rows.
        self.kv_heads = 1 if Hkv > 1 and call.k.stride(1) == 0 and call.v.stride(1) == 0 else Hkv
        self.lo, self.hi, visible, self.note = _visible_keys(call.mask, call.extent, call.q.device)
        self.read = (self.lo, self.hi)
        if self.hi <= self.lo:  # no row sees any key: one key, all blocked, so the result (0, -inf) keeps the graph
            self.lo = self.hi = 0
            self.read = (0, 1)
            visible = torch.zeros((1, 1, Lq, 1), dtype=torch.bool, device=call.q.device)
        self.blocked = None
        if visible is not None:
            # (B|1, H|1, Lq, n) -> (B|1, Hkv|1, G|1, Lq, n): query head h = kv·G + g
            self.blocked = group_query_heads(~visible, self.kv_heads)
        # MKL's fp32 GEMM: 3 to 5 query rows padded with zero rows (_PADDED_ROWS) when K/V stream from memory
        rows = (Hq // self.kv_heads) * Lq
        kv_bytes = B * self.kv_heads * (self.read[1] - self.read[0]) * (D + Dv) * call.k.element_size()
        self.pad = (
            _PADDED_ROWS.get(rows, rows) - rows
            if (call.q.dtype == torch.float32 and kv_bytes >= _PAD_MIN_BYTES and not self.native)
            else 0
        )

    def run(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, requires_grad: bool, return_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``(output (B, Hq, Lq, Dv), lse (B, Hq, Lq) | None)``."""
        B, Hq, Hkv, Lq, Lk, D, Dv = self.shape
        kv_heads = self.kv_heads
        G = Hq // kv_heads
        if kv_heads != Hkv:
            k, v = k[:, :1], v[:, :1]
        lo, hi = self.read
        if (lo, hi) != (0, Lk):
            k, v = k[:, :, lo:hi], v[:, :, lo:hi]
        acc = softmax_dtype(q.dtype)
        half = acc != q.dtype  # fp16/bf16: matmuls in the input dtype, softmax in fp32
        qg = fold_query_heads(q, kv_heads, Hq)  # (B, Hkv, G·Lq, D): query head h = kv·G + g, rows (g, i)
        if not half:  # folded into the G·Lq query rows instead of the G·Lq·n scores
            qg, scale = qg * scale, 1.0
        if self.pad:  # zero rows, dropped from the scores
            qg = torch.cat([qg, qg.new_zeros(B, kv_heads, self.pad, D)], dim=2)
        blocked = self.blocked  # (B|1, Hkv|1, G|1, Lq, n) bool, True = masked; None: nothing
        if blocked is not None and requires_grad:
            # dQ = dS · K computes 0 · NaN for a blocked key holding NaN, and P V (and dP = dO Vᵀ)
            # 0 · NaN for a blocked value holding one: zero the keys and values no query sees.
            unseen = unseen_keys(~blocked.flatten(1, 2), kv_heads)  # (B|1, Hkv|1, n, 1)
            k = torch.where(unseen, torch.zeros((), dtype=k.dtype, device=k.device), k)
            v = torch.where(unseen, torch.zeros((), dtype=v.dtype, device=v.device), v)
        n, step = k.shape[2], self.chunk
        # Without autograd, each chunk runs on fused softmax/logsumexp passes; with it, a plain
        # softmax whose backward stays finite on fully masked rows (softmax's own gives NaN there).
        attend = _attend_with_grad if requires_grad else functools.partial(_attend, native=self.native)
        need_lse = return_lse or n > step
        if n <= step:  # one chunk, unsliced (a guard on n when traced with a symbolic Lk: no loop over it)
            out, lse = attend(qg, k, v, blocked, scale, acc, G, Lq, half, need_lse)
        else:
            outs: list[Tensor] = []
            lses: list[Tensor] = []
            for c0 in range(0, n, step):
                c1 = min(c0 + step, n)
                bc = None if blocked is None else blocked[..., c0:c1]
                out, lse = attend(qg, k[:, :, c0:c1], v[:, :, c0:c1], bc, scale, acc, G, Lq, half, need_lse)
                assert lse is not None  # need_lse: chunks are merged by their LSE
                outs.append(out)
                lses.append(lse)
            out, lse = merge_partials(outs, lses)
        out = unfold_query_heads(out if out.dtype == q.dtype else out.to(q.dtype), Hq)  # (B, Hq, Lq, Dv)
        return out, (unfold_query_heads(lse, Hq) if return_lse and lse is not None else None)  # (B, Hq, Lq)


def _visible_keys(mask: Mask | None, extent: Extent, device) -> tuple[int, int, Tensor | None, str]:
    """``(lo, hi, visible, note)``: the keys ``[lo, hi)`` any row of the call may see (``lo >= hi``:
    none), the bool mask on them (``(B|1, H|1, Lq, hi - lo)``, ``None`` when all are visible), and
    a line for ``explain()``."""
    Lq, Lk = extent.lengths
    if mask is None:
        return 0, Lk, None, "mask: none"
    what = "{mask}"  # filled in by plan() only: describing a mask may read its tensors (a host sync)
    offset = mask.causal_offset(Lq, Lk)  # the common decode step, answered first: O(1), no tensor
    if offset is not None and offset >= Lk - 1:
        return 0, Lk, None, f"mask {what}: a causal diagonal at or past the last key for every row: no mask"
    if torch.compiler.is_compiling():  # no host synchronisation, no data-dependent range
        return (
            0,
            Lk,
            mask.materialize_block(extent, extent.whole(), device),
            f"mask {what}: evaluated on every key (under torch.compile)",
        )
    lo, hi = mask.key_range(extent, extent.whole())
    keys = Block(0, Lq, lo, hi)
    if hi <= lo:
        return 0, 0, None, f"mask {what}: no query sees any key (output 0, LSE -inf)"
    if mask.kinds() <= _STRUCTURAL:
        state = mask.block_state(extent, keys)
        if state is BlockState.EMPTY:
            return 0, 0, None, f"mask {what}: no query sees any key (output 0, LSE -inf)"
        if state is BlockState.FULL:
            return lo, hi, None, f"mask {what}: every key in its range [{lo}, {hi}) visible: no mask"
        visible = mask.materialize_block(extent, keys, device)
        return (
            lo,
            hi,
            visible,
            (f"mask {what}: keys [{lo}, {hi}) from its structure; a row mask of shape {tuple(visible.shape)} on them"),
        )
    visible = mask.materialize_block(extent, keys, device)
    seen = visible.any(dim=2).any(dim=1).any(dim=0).nonzero()  # columns some row may see
    if seen.numel() == 0:
        return 0, 0, None, f"mask {what}: no query sees any key (output 0, LSE -inf)"
    first, last = seen[[0, -1], 0].tolist()
    visible = visible[..., first : last + 1]
    if bool(visible.all()):  # a full ring, a paged read of filled slots: nothing to mask
        return lo + first, lo + last + 1, None, f"mask {what}: evaluated on these {Lq} row(s); every key read visible"
    return (
        lo + first,
        lo + last + 1,
        visible,
        (
            f"mask {what}: evaluated on these {Lq} row(s); keys [{lo + first}, {lo + last + 1}) from the first to the "
            f"last visible one; a row mask of shape {tuple(visible.shape)} on them"
        ),
    )
