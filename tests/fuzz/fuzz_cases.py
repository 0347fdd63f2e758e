"""Seeded random attention calls for the differential fuzzer.

``make_case(seed)`` decides everything with Python's ``random`` (cheap: pytest builds every id at
collection); ``case.build()`` draws the tensors from ``torch.Generator`` seeded by the same seed.
The same seed always gives the same call, so a case id (``seed17-sdpa-...``) reproduces it.

Masks are generated as a small expression tree (:class:`Node`). Each node builds the multihead
mask object *and* states its meaning independently, from docs/conventions.md (``allowed``): the
fuzzer checks one against the other (``test_mask_meaning``), so the oracle, which reads masks
through ``mask_mod``, does not take their meaning on trust.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

import multihead as mh

__all__ = ["make_case", "Case", "Built", "DTYPES", "resolve_index"]

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEADS = [(1, 1), (4, 4), (8, 2), (6, 3), (8, 1)]
# blocksparse runs 256-query blocks and batches the interior blocks of a band: both sides of it.
BLOCK_LENGTHS = [255, 256, 257, 511, 513]
SMALL_LENGTHS = [1, 2, 13, 17, 31, 64, 113, 127, 128]
HEAD_DIMS = [8, 16, 40, 59, 64, 128]
# B * Hq * Lq * Lk * (D + Dv) at most: keeps one case (oracle, baseline, backend, backward) to
# about a tenth of a second on two shared cores.
COST_CAP = 40_000_000


def _tensor_gen(sub: int) -> torch.Generator:
    return torch.Generator().manual_seed(sub)


# ============================================================================ mask expressions
class Node:
    """A mask expression over a frame of ``Lq x Lk`` positions (the whole attention it is read in)."""

    def build(self) -> mh.masks.Mask:
        raise NotImplementedError

    def expr(self) -> str:
        raise NotImplementedError

    def allowed(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor, Lq: int, Lk: int) -> Tensor:
        """Whether query position ``i`` may see key position ``j`` (conventions, not multihead)."""
        raise NotImplementedError

    def bottom_right(self) -> bool:
        """Whether the meaning depends on the frame's lengths."""
        return False


def _align_offset(align: str, Lq: int, Lk: int) -> int:
    return Lk - Lq if align == "bottom_right" else 0  # conventions: "Causal alignment"


def _short(align: str) -> str:
    return "" if align == "bottom_right" else ",tl"


@dataclass
class Band(Node):
    left: int | None  # None: causal (no left limit)
    right: int | None
    align: str

    def build(self):
        if self.left is None:
            return mh.causal(self.align)
        return mh.sliding_window(self.left, self.right, align=self.align)

    def expr(self):
        if self.left is None:
            return f"causal({'' if self.align == 'bottom_right' else 'tl'})"
        return f"sliding_window({self.left},{self.right}{_short(self.align)})"

    def allowed(self, b, h, i, j, Lq, Lk):
        c = i + _align_offset(self.align, Lq, Lk)  # the key query i lines up with
        ok = torch.ones((), dtype=torch.bool)
        if self.left is not None:
            ok = ok & (j >= c - self.left)
        if self.right is not None:
            ok = ok & (j <= c + self.right)
        return ok

    def bottom_right(self):
        return self.align == "bottom_right"


@dataclass
class KeyPad(Node):
    lengths: list | None  # per batch element (or one for all)
    table: tuple | None = None  # (rows, Lk, sub): a bool table, True = real key

    def _valid(self) -> Tensor:
        rows, Lk, sub = self.table
        return torch.rand(rows, Lk, generator=_tensor_gen(sub)) > 0.3

    def build(self):
        if self.lengths is not None:
            return mh.key_padding(torch.tensor(self.lengths, dtype=torch.int64))
        return mh.key_padding(self._valid())

    def expr(self):
        if self.lengths is not None:
            return f"key_padding({self.lengths})".replace(" ", "")
        return f"key_padding(<bool{self.table[0]}x{self.table[1]}>)"

    def allowed(self, b, h, i, j, Lq, Lk):
        if self.lengths is not None:
            n = torch.tensor(self.lengths, dtype=torch.int64)
            return j < n[b * 0 if len(self.lengths) == 1 else b]
        valid = self._valid()
        return valid[b * 0 if valid.shape[0] == 1 else b, j]


@dataclass
class Prefix(Node):
    n: int | list
    align: str

    def build(self):
        return mh.prefix_lm(
            self.n if isinstance(self.n, int) else torch.tensor(self.n, dtype=torch.int64), align=self.align
        )

    def expr(self):
        return f"prefix_lm({self.n}{_short(self.align)})".replace(" ", "")

    def allowed(self, b, h, i, j, Lq, Lk):
        n = torch.tensor([self.n] if isinstance(self.n, int) else self.n, dtype=torch.int64)
        in_prefix = j < n[b * 0 if n.numel() == 1 else b]
        return in_prefix | (j <= i + _align_offset(self.align, Lq, Lk))

    def bottom_right(self):
        return self.align == "bottom_right"


@dataclass
class Doc(Node):
    q_ids: list  # rows of ids (one row: shared by every batch element)
    kv_ids: list | None  # None: self-attention, the same ids

    def build(self):
        q = torch.tensor(self.q_ids, dtype=torch.int64)
        return mh.document(
            q if len(self.q_ids) > 1 else q[0],
            None if self.kv_ids is None else torch.tensor(self.kv_ids, dtype=torch.int64),
        )

    def expr(self):
        docs = len(set(x for row in self.q_ids for x in row))
        srt = all(row == sorted(row) for row in self.q_ids)
        kv = "" if self.kv_ids is None else f",kv<{len(self.kv_ids)}x{len(self.kv_ids[0])}>"
        return f"document(<{len(self.q_ids)}x{len(self.q_ids[0])},{docs}docs{'' if srt else ',unsorted'}>{kv})"

    def allowed(self, b, h, i, j, Lq, Lk):
        q = torch.tensor(self.q_ids, dtype=torch.int64)
        kv = q if self.kv_ids is None else torch.tensor(self.kv_ids, dtype=torch.int64)
        return q[b * 0 if q.shape[0] == 1 else b, i] == kv[b * 0 if kv.shape[0] == 1 else b, j]


def _mod3(b, h, q, kv):
    return (q + kv + h) % 3 != 0


def _even_keys(b, h, q, kv):
    return kv % 2 == 0  # broadcasts over b, h, q on purpose


def _near5(b, h, q, kv):
    return (q - kv).abs() <= 5


def _batch0_or_first4(b, h, q, kv):
    return (b == 0) | (kv < 4)


def _head_parity(b, h, q, kv):
    return (h % 2 == 0) | (kv <= q)


CUSTOM = {f.__name__.lstrip("_"): f for f in (_mod3, _even_keys, _near5, _batch0_or_first4, _head_parity)}


@dataclass
class Custom(Node):
    name: str

    def build(self):
        return mh.custom(CUSTOM[self.name], name=self.name)

    def expr(self):
        return f"custom({self.name})"

    def allowed(self, b, h, i, j, Lq, Lk):
        return CUSTOM[self.name](b, h, i, j)


@dataclass
class BoolT(Node):
    shape: tuple  # broadcastable to (B, H, Lq, Lk) of the frame, 2 to 4 dims
    p: float  # probability of True
    sub: int

    def tensor(self) -> Tensor:
        return torch.rand(*self.shape, generator=_tensor_gen(self.sub)) < self.p

    def build(self):
        return mh.masks.as_mask(self.tensor())

    def expr(self):
        return f"<bool{tuple(self.shape)}p{self.p}>".replace(" ", "")

    def allowed(self, b, h, i, j, Lq, Lk):
        t = self.tensor()
        t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
        idx = [x * 0 if n == 1 else x for x, n in zip((b, h, i, j), t.shape)]
        return t[idx[0], idx[1], idx[2], idx[3]]


@dataclass
class Op(Node):
    op: str  # "&", "|"
    parts: tuple

    def build(self):
        a, c = (p.build() for p in self.parts)
        if isinstance(self.parts[0], BoolT):  # a bool tensor on the left: coerced by __rand__/__ror__
            a = self.parts[0].tensor()
        return a & c if self.op == "&" else a | c

    def expr(self):
        return f"({self.parts[0].expr()}{self.op}{self.parts[1].expr()})"

    def allowed(self, *args):
        x, y = (p.allowed(*args) for p in self.parts)
        return x & y if self.op == "&" else x | y

    def bottom_right(self):
        return any(p.bottom_right() for p in self.parts)


@dataclass
class Inv(Node):
    inner: Node

    def build(self):
        return ~self.inner.build()

    def expr(self):
        return f"~{self.inner.expr()}"

    def allowed(self, *args):
        return ~self.inner.allowed(*args)

    def bottom_right(self):
        return self.inner.bottom_right()


@dataclass
class Shift(Node):
    """The call is the block at ``(q0, k0)`` of a whole attention ``wq x wk`` the inner mask is
    generated for: call query ``i`` is position ``i + q0``, key ``j`` is ``j + k0``."""

    inner: Node
    q0: int
    k0: int
    wq: int
    wk: int
    lengths: bool  # pass q_len=/kv_len= (required when the inner mask is bottom-right)

    def build(self):
        inner = self.inner.build()
        if self.lengths:
            return inner.shifted(self.q0, self.k0, q_len=self.wq, kv_len=self.wk)
        return inner.shifted(self.q0, self.k0)

    def expr(self):
        lens = f",q_len={self.wq},kv_len={self.wk}" if self.lengths else ""
        return f"{self.inner.expr()}.shifted({self.q0},{self.k0}{lens})"

    def allowed(self, b, h, i, j, Lq, Lk):
        # A block is read at the whole attention's positions and lengths, never its own.
        return self.inner.allowed(b, h, i + self.q0, j + self.k0, self.wq, self.wk)


@dataclass
class At(Node):
    """The call's query ``i`` is position ``qpos[i]`` (or ``qpos[b, i]``) of a whole ``wq x wk``."""

    inner: Node
    qpos: list  # rows of positions
    kpos: list
    wq: int
    wk: int

    def build(self):
        qp, kp = torch.tensor(self.qpos, dtype=torch.int64), torch.tensor(self.kpos, dtype=torch.int64)
        qp = qp[0] if qp.shape[0] == 1 else qp
        kp = kp[0] if kp.shape[0] == 1 else kp
        return self.inner.build().at(qp, kp, q_len=self.wq, kv_len=self.wk)

    def expr(self):
        return (
            f"{self.inner.expr()}.at(<q{len(self.qpos)}x{len(self.qpos[0])}>,<kv{len(self.kpos)}x"
            f"{len(self.kpos[0])}>,q_len={self.wq},kv_len={self.wk})"
        )

    def allowed(self, b, h, i, j, Lq, Lk):
        qp, kp = torch.tensor(self.qpos, dtype=torch.int64), torch.tensor(self.kpos, dtype=torch.int64)
        qi = qp[b * 0 if qp.shape[0] == 1 else b, i]
        kj = kp[b * 0 if kp.shape[0] == 1 else b, j]
        return self.inner.allowed(b, h, qi, kj, self.wq, self.wk)


def _broadcast_shape(rng: random.Random, full: tuple) -> tuple:
    """A random shape broadcastable to ``full = (B, H, Lq, Lk)``: 2 to 4 dims, each 1 or full."""
    ndim = rng.choice([2, 3, 4, 4])
    return tuple(n if rng.random() < 0.6 else 1 for n in full[4 - ndim :])


def _ids(rng: random.Random, L: int, docs: int, sort: bool) -> list:
    ids = [rng.randrange(docs) for _ in range(L)]
    return sorted(ids) if sort else ids


def _leaf(rng: random.Random, B: int, H: int, Lq: int, Lk: int, allow_tensor: bool) -> Node:
    kinds = ["causal", "causal", "window", "window", "padding", "document", "prefix", "custom"]
    if allow_tensor:
        kinds.append("tensor")
    kind = rng.choice(kinds)
    align = rng.choice(["bottom_right", "bottom_right", "top_left"])
    if kind == "causal":
        return Band(None, 0, align)
    if kind == "window":
        left = rng.choice([0, 1, 3, 17, 64, 100, 300])
        right = rng.choice([0, 0, 0, 2, 40, None])
        return Band(left, right, align)
    if kind == "padding":
        if rng.random() < 0.25:
            return KeyPad(None, (rng.choice([1, B]), Lk, rng.randrange(1 << 30)))
        rows = rng.choice([1, B, B])
        # 0 (a batch element that sees nothing) and beyond Lk (every key: one mask for all steps).
        lengths = [rng.choice([0, Lk, Lk + 3, rng.randint(0, Lk), rng.randint(0, Lk)]) for _ in range(rows)]
        return KeyPad(lengths)
    if kind == "document":
        docs = rng.randint(1, 4)
        rows = rng.choice([1, B])
        sort = rng.random() < 0.8
        q_ids = [_ids(rng, Lq, docs, sort) for _ in range(rows)]
        if Lq == Lk and rng.random() < 0.5:
            return Doc(q_ids, None)
        return Doc(q_ids, [_ids(rng, Lk, docs, sort) for _ in range(rng.choice([1, rows]))])
    if kind == "prefix":
        n = rng.randint(0, Lk) if rng.random() < 0.7 else [rng.randint(0, Lk) for _ in range(B)]
        return Prefix(n, align)
    if kind == "custom":
        return Custom(rng.choice(sorted(CUSTOM)))
    return BoolT(_broadcast_shape(rng, (B, H, Lq, Lk)), rng.choice([0.3, 0.7, 0.95]), rng.randrange(1 << 30))


def _positions(rng: random.Random, L: int, rows: int) -> tuple[list, int]:
    """Rows of ``L`` positions and the whole length they live in."""
    style = rng.choice(["strided", "random", "sorted", "ring"])
    if style == "strided":
        step, off = rng.choice([1, 2, 3]), rng.randint(0, 5)
        whole = off + step * (L - 1) + 1 + rng.randint(0, 4)
        return [[off + step * x for x in range(L)] for _ in range(rows)], whole
    whole = L + rng.randint(0, L + 3)
    if style == "ring":  # a ring buffer: slot s holds position start + ((s - r) mod L)
        out = []
        for _ in range(rows):
            r, start = rng.randrange(L), rng.randint(0, whole - L)
            out.append([start + (s - r) % L for s in range(L)])
        return out, whole
    out = [[rng.randrange(whole) for _ in range(L)] for _ in range(rows)]
    return ([sorted(r) for r in out] if style == "sorted" else out), whole


def _mask_node(rng: random.Random, B: int, H: int, Lq: int, Lk: int, depth: int, allow_tensor: bool) -> Node:
    r = rng.random()
    if depth >= 2 or r < 0.45:
        return _leaf(rng, B, H, Lq, Lk, allow_tensor)
    if r < 0.70:
        parts = (
            _mask_node(rng, B, H, Lq, Lk, depth + 1, allow_tensor),
            _mask_node(rng, B, H, Lq, Lk, depth + 1, allow_tensor),
        )
        return Op(rng.choice(["&", "&", "|"]), parts)
    if r < 0.78:
        return Inv(_mask_node(rng, B, H, Lq, Lk, depth + 1, allow_tensor))
    if r < 0.90 or 0 in (Lq, Lk):
        q0, k0 = rng.randint(0, 2 * Lq), rng.randint(0, 2 * Lk)
        wq, wk = q0 + Lq + rng.randint(0, Lq), k0 + Lk + rng.randint(0, Lk)
        inner = _mask_node(rng, B, H, wq, wk, depth + 1, allow_tensor=False)
        return Shift(inner, q0, k0, wq, wk, lengths=inner.bottom_right() or rng.random() < 0.5)
    rows = rng.choice([1, B])
    qpos, wq = _positions(rng, Lq, rows)
    kpos, wk = _positions(rng, Lk, rows)
    return At(_mask_node(rng, B, H, wq, wk, depth + 1, allow_tensor=False), qpos, kpos, wq, wk)


# ============================================================================ the case
LAYOUTS_Q = ["contig"] * 5 + ["heads", "lastT", "step2", "packed"]
LAYOUTS_KV = LAYOUTS_Q + ["expand", "expand"]


@dataclass
class Case:
    seed: int
    dtype: str
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    layouts: tuple  # of q, k, v
    mask_kind: str  # "none", "object", "bool", "float"
    node: Node | None = None  # mask_kind == "object"
    tensor_shape: tuple = ()  # mask_kind in ("bool", "float")
    tensor_p: float = 0.0  # bool: P(True); float: P(-inf)
    empty_rows: bool = False  # bool/float tensor: some whole rows blocked
    tensor_fp32: bool = False  # float mask in fp32 rather than the input dtype
    tensor_far: float = 0.0  # float mask: subtracted from some query rows (every row if Lq broadcasts)
    mods: tuple = ()  # ("bias", shape, fp32, requires_grad, far) / ("softcap", cap)
    scale: float | None = None
    q_mult: float = 1.0
    return_lse: bool = False
    return_weights: bool = False
    weights_heads: object = None
    weights_rows: object = None
    grad: bool = False
    nan_unseen: bool = False  # keys that no query may see hold NaN
    nan_input: str | None = None  # "q", "k" or "v": one element is NaN (visible or not)
    # Issue 28, items 11-14 (drawn after everything above, so the cases before them are unchanged):
    # a position bias first in the modifiers, ("alibi", symmetric, align, slope factor) or
    # ("t5", bidirectional, num_buckets, max_distance, align, table requires grad);
    position: tuple | None = None
    bias_scale: float = 2.0  # the standard deviation of "bias" modifiers (large: scores ~300)
    q_no_grad: bool = False  # with grad: only k and v (and the modifiers' tensors) require it

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def mask_expr(self) -> str:
        if self.mask_kind == "none":
            return "nomask"
        if self.mask_kind == "object":
            return self.node.expr()
        extra = ",emptyrows" if self.empty_rows else ""
        if self.mask_kind == "bool":
            return f"bool{tuple(self.tensor_shape)}p{self.tensor_p}{extra}".replace(" ", "")
        dt = "fp32" if self.tensor_fp32 else self.dtype
        far = f",far-{self.tensor_far:g}" if self.tensor_far else ""
        return f"additive{tuple(self.tensor_shape)}{dt}ninf{self.tensor_p}{extra}{far}".replace(" ", "")

    def id(self, backend: str) -> str:
        lay = ",".join(f"{n}:{l}" for n, l in zip("qkv", self.layouts) if l != "contig")
        parts = [
            f"seed{self.seed}",
            backend,
            self.dtype,
            f"B{self.B}",
            f"H{self.Hq}x{self.Hkv}",
            f"L{self.Lq}x{self.Lk}",
            f"D{self.D}v{self.Dv}",
        ]
        if lay:
            parts.append(lay)
        parts.append(self.mask_expr())
        if self.position is not None and self.position[0] == "alibi":
            _, sym, align, steep = self.position
            parts.append(f"alibi({'sym' if sym else 'paper'}{_short(align)}{f',x{steep:g}' if steep != 1 else ''})")
        elif self.position is not None:
            _, bi, nb, md, align, grad = self.position
            parts.append(f"t5({'bi' if bi else 'uni'},{nb},{md}{_short(align)}{',grad' if grad else ''})")
        if self.bias_scale != 2.0:
            parts.append(f"bias*{self.bias_scale:g}")
        for m in self.mods:
            if m[0] == "bias":
                far = f"far-{m[4]:g}" if m[4] else ""
                parts.append(f"bias{tuple(m[1])}{'fp32' if m[2] else ''}{'grad' if m[3] else ''}{far}".replace(" ", ""))
            else:
                parts.append(f"softcap({m[1]})")
        if self.scale is not None:
            parts.append(f"scale={self.scale}")
        if self.q_mult != 1.0:
            parts.append(f"q*{self.q_mult}")
        if self.return_lse:
            parts.append("lse")
        if self.return_weights:
            parts.append(f"weights(h={_show(self.weights_heads)},r={_show(self.weights_rows)})")
        if self.grad:
            parts.append("grad(kv)" if self.q_no_grad else "grad")
        if self.nan_unseen:
            parts.append("nan_unseen_keys")
        if self.nan_input:
            parts.append(f"nan_in_{self.nan_input}")
        return "-".join(parts)

    def build(self) -> Built:
        return _build(self)


def _show(sel) -> str:
    if sel is None:
        return "all"
    if isinstance(sel, slice):
        return (
            f"{'' if sel.start is None else sel.start}:{'' if sel.stop is None else sel.stop}"
            f"{'' if sel.step is None else ':' + str(sel.step)}"
        )
    if isinstance(sel, tuple) and sel and sel[0] == "tensor":
        return f"tensor{list(sel[1])}".replace(" ", "")
    return str(sel).replace(" ", "")


def _selection(rng: random.Random, n: int):
    style = rng.choice(["all", "all", "int", "neg", "list", "slice", "tensor"])
    if style == "all":
        return None
    if style == "int":
        return rng.randrange(n)
    if style == "neg":
        return -rng.randint(1, n)
    if style == "list":
        return sorted(rng.sample(range(n), rng.randint(1, min(n, 3))))
    if style == "slice":
        start = rng.randrange(n)
        return slice(start, rng.randint(start + 1, n), rng.choice([None, 1, 2]))
    return ("tensor", tuple(rng.randrange(n) for _ in range(rng.randint(1, 3))))  # may repeat


def resolve_index(sel, n: int) -> list:
    """The rows a ``weights_heads``/``weights_rows`` selection names (independently of multihead)."""
    if sel is None:
        return list(range(n))
    if isinstance(sel, int):
        return [sel % n]
    if isinstance(sel, slice):
        return list(range(n))[sel]
    if isinstance(sel, tuple) and sel and sel[0] == "tensor":
        return [i % n for i in sel[1]]
    return [i % n for i in sel]


def _lengths(rng: random.Random) -> tuple[int, int]:
    r = rng.random()
    if r < 0.03:  # empty: Lk = 0 (every row sees nothing) or Lq = 0 (an empty output)
        return rng.choice([(0, 5), (7, 0), (1, 0), (0, 0)])
    if r < 0.30:  # around blocksparse's blocks, both sides
        return rng.choice(BLOCK_LENGTHS + [1, 64]), rng.choice(BLOCK_LENGTHS + [1, 100])
    if r < 0.42:  # one query against many keys (decoding)
        return 1, rng.choice([1, 17, 255, 256, 257, 513, 1000])
    if r < 0.50:  # many queries, one key
        return rng.choice([2, 17, 257]), 1
    pick = lambda: rng.choice(SMALL_LENGTHS) if rng.random() < 0.5 else rng.randint(1, 70)  # noqa: E731
    return pick(), pick()


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    dtype = rng.choice(["fp64", "fp32", "fp32", "bf16", "fp16"])
    Lq, Lk = _lengths(rng)
    for _ in range(50):
        B = rng.choice([1, 2, 3])
        Hq, Hkv = rng.choice(HEADS)
        D = rng.choice(HEAD_DIMS)
        Dv = D if rng.random() < 0.6 else rng.choice(HEAD_DIMS)
        if B * Hq * Lq * Lk * (D + Dv) <= COST_CAP:
            break
    else:
        B, (Hq, Hkv), D, Dv = 1, rng.choice(HEADS[:3]), 8, rng.choice([8, 16])
    layouts = (rng.choice(LAYOUTS_Q), rng.choice(LAYOUTS_KV), rng.choice(LAYOUTS_KV))
    case = Case(seed, dtype, B, Hq, Hkv, Lq, Lk, D, Dv, layouts, mask_kind="none")

    r = rng.random()
    if r < 0.12:
        case.mask_kind = "none"
    elif r < 0.72:
        case.mask_kind, case.node = "object", _mask_node(rng, B, Hq, Lq, Lk, 0, allow_tensor=True)
    elif r < 0.86:
        case.mask_kind = "bool"
        case.tensor_shape = _broadcast_shape(rng, (B, Hq, Lq, Lk))
        case.tensor_p = rng.choice([0.2, 0.6, 0.9, 1.0])
    else:
        case.mask_kind = "float"
        case.tensor_shape = _broadcast_shape(rng, (B, Hq, Lq, Lk))
        case.tensor_p = rng.choice([0.0, 0.2, 0.6])
        case.tensor_fp32 = dtype in ("bf16", "fp16") and rng.random() < 0.5
        case.tensor_far = _far(rng, "fp32" if case.tensor_fp32 else dtype)
    if case.mask_kind in ("bool", "float") and case.tensor_shape[-1] > 1:
        case.empty_rows = rng.random() < 0.3

    case.grad = rng.random() < 0.5
    mods = []
    for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
        if rng.random() < 0.75:  # softcap makes sdpa and blocksparse refuse: rarer
            fp32 = dtype in ("bf16", "fp16") and rng.random() < 0.4
            mods.append(
                (
                    "bias",
                    _broadcast_shape(rng, (B, Hq, Lq, Lk)),
                    fp32,
                    case.grad and rng.random() < 0.6,
                    _far(rng, "fp32" if fp32 else dtype),
                )
            )
        else:
            mods.append(("softcap", rng.choice([1.5, 5.0, 30.0])))
    case.mods = tuple(mods)
    if rng.random() < 0.15:
        case.scale = rng.choice([0.05, 0.3, 1.0, 2.5, 0.0, -0.5])
    if rng.random() < 0.15:
        case.q_mult = rng.choice([4.0, 12.0])
    case.return_lse = rng.random() < 0.35
    case.return_weights = rng.random() < 0.3
    if case.return_weights:
        case.weights_heads = _selection(rng, Hq)
        case.weights_rows = _selection(rng, Lq) if Lq else None
    case.nan_unseen = case.mask_kind != "none" and rng.random() < 0.15
    if not case.grad and rng.random() < 0.08:  # the policy for gradients of NaN inputs is not written
        case.nan_input = rng.choice(["q", "k", "v"])
    _precision_draws(rng, case)
    return case


def _precision_draws(rng: random.Random, case: Case) -> None:
    """The families of issue 28, items 11-14, which the draws above never made: ALiBi in the
    paper's form without a causal mask (its bias grows for keys after the query) and steep slopes;
    T5 tables, short-range ones (most distances in the last bucket) on short key ranges, trainable;
    biases large enough that ``q·k`` and the bias both decide the softmax (scores ~300) with the
    weights returned; elementwise modifiers on calls where no query sees a key, with gradients
    asked of k and v only."""
    r = rng.random()
    if r < 0.10:
        align = rng.choice(["bottom_right", "bottom_right", "top_left"])
        case.position = ("alibi", rng.random() < 0.25, align, rng.choice([1.0, 1.0, 8.0]))
    elif r < 0.18:
        align = rng.choice(["bottom_right", "bottom_right", "top_left"])
        buckets, distance = rng.choice([(8, 10), (8, 12), (16, 40), (32, 128)])
        grad = case.grad and rng.random() < 0.7
        case.position = ("t5", rng.random() < 0.7, buckets, distance, align, grad)
        if case.mask_kind == "none" and not case.mods and case.Lq and case.Lk > 1 and rng.random() < 0.5:
            case.Lk = rng.choice([1, 2, 3, 5])  # short key ranges (no mask or bias was drawn for the old Lk)
    if any(m[0] == "bias" for m in case.mods) and rng.random() < 0.15:
        case.bias_scale = rng.choice([100.0, 300.0])
        case.q_mult = rng.choice([case.q_mult, 12.0])
        if not case.return_weights:
            case.return_weights, case.weights_heads, case.weights_rows = True, None, None
    if (
        case.Lq
        and case.Lk
        and case.B * case.Hq * case.Lq * case.Lk * (case.D + case.Dv) <= COST_CAP
        and rng.random() < 0.03
    ):
        # No query sees any key; an elementwise modifier sends blocksparse to its PyTorch path.
        case.mask_kind, case.node = "object", KeyPad([0])
        case.mods = case.mods + (("softcap", rng.choice([1.5, 30.0])),)
        case.nan_unseen = False
    if case.grad and not case.nan_input and rng.random() < 0.1:
        case.q_no_grad = True


def _far(rng: random.Random, dtype: str) -> float:
    """Now and then a large negative offset on some rows of a bias: rows whose every visible score
    is far below fp32's exp range (-88), which only a max-subtracted softmax survives. Kept finite
    in the tensor's dtype (fp16 ends at 65504)."""
    if rng.random() > 0.15:
        return 0.0
    return rng.choice([100.0, 1e4] + ([] if dtype == "fp16" else [1e5]))


# ============================================================================ tensors
@dataclass
class Built:
    """One call's tensors: ``leaves`` (what gradients land on, in the input dtype) and the
    arguments of ``multihead.attention`` made from them."""

    leaves: dict  # name -> leaf tensor ("q", "k", "v", "bias0", ...)
    q: Tensor
    k: Tensor
    v: Tensor
    mask: object
    score_mod: list | None
    kwargs: dict = field(default_factory=dict)
    dout: Tensor | None = None  # the cotangent of the output, input dtype


def layout(x: Tensor, kind: str, size: tuple) -> Tensor:
    """``x`` viewed with the memory layout ``kind`` (values unchanged, differentiable)."""
    if kind == "heads":  # stored (B, L, H, D), as split from a (B, L, E) projection
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "lastT":  # stored (B, H, D, L): the last dim has stride L
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "step2":  # every other element of a twice-as-wide buffer whose others are NaN
        junk = torch.full_like(x, float("nan"))
        return torch.stack([x, junk], dim=-1).flatten(-2)[..., ::2]
    if kind == "packed":  # the first D columns of a wider (packed QKV-like) buffer
        junk = torch.full(x.shape[:-1] + (3,), float("nan"), dtype=x.dtype)
        return torch.cat([x, junk], dim=-1)[..., : x.shape[-1]]
    if kind == "expand":  # one head stored, seen as Hkv heads with stride 0
        return x.expand(size)
    return x


def _far_rows(t: Tensor, far: float, gen: torch.Generator) -> Tensor:
    """``t`` with ``far`` subtracted from about half of its query rows (all when it has one)."""
    if not far:
        return t
    rows = torch.rand(t.shape[-2] if t.dim() >= 2 else 1, generator=gen) < 0.5
    if t.dim() < 2 or t.shape[-2] == 1:
        rows[:] = True
    return t - far * rows.to(t.dtype).unsqueeze(-1)


def _build(case: Case) -> Built:
    T = case.torch_dtype
    gen = torch.Generator().manual_seed(case.seed)
    B, Hq, Hkv, Lq, Lk, D, Dv = case.B, case.Hq, case.Hkv, case.Lq, case.Lk, case.D, case.Dv
    sizes = {"q": (B, Hq, Lq, D), "k": (B, Hkv, Lk, D), "v": (B, Hkv, Lk, Dv)}
    leaves, views = {}, {}
    for (name, size), kind in zip(sizes.items(), case.layouts):
        leaf_size = (size[0], 1) + size[2:] if kind == "expand" else size
        x = torch.randn(*leaf_size, generator=gen, dtype=torch.float64)
        if name == "q":
            x = x * case.q_mult
        leaves[name] = x.to(T).requires_grad_(case.grad and not (name == "q" and case.q_no_grad))
    dout = torch.randn(B, Hq, Lq, Dv, generator=gen, dtype=torch.float64).to(T) if case.grad else None

    if case.mask_kind == "none":
        mask = None
    elif case.mask_kind == "object":
        mask = case.node.build()
    elif case.mask_kind == "bool":
        mask = torch.rand(*case.tensor_shape, generator=gen) < case.tensor_p
        if case.empty_rows:
            mask = mask.clone()
            mask[..., : max(1, mask.shape[-2] // 3), :] = False
    else:
        values = _far_rows(
            torch.randn(*case.tensor_shape, generator=gen, dtype=torch.float64) * 1.5, case.tensor_far, gen
        )
        blocked = torch.rand(*case.tensor_shape, generator=gen) < case.tensor_p
        if case.empty_rows:
            blocked[..., : max(1, blocked.shape[-2] // 3), :] = True
        mask = values.masked_fill(blocked, float("-inf")).to(torch.float32 if case.tensor_fp32 else T)

    score_mod = []
    if case.position is not None and case.position[0] == "alibi":
        _, sym, align, steep = case.position
        slopes = None if steep == 1 else [x * steep for x in mh.positions.alibi_slopes(Hq).tolist()]
        score_mod.append(mh.positions.ALiBi(Hq, slopes=slopes, symmetric=sym, align=align))
    elif case.position is not None:
        _, bi, nb, md, align, grad = case.position
        table = torch.randn(nb, Hq, generator=gen, dtype=torch.float64).to(T).requires_grad_(grad)
        leaves["t5"] = table
        score_mod.append(
            mh.positions.BucketedBias(table, bidirectional=bi, num_buckets=nb, max_distance=md, align=align)
        )
    for n, m in enumerate(case.mods):
        if m[0] == "bias":
            t = _far_rows(torch.randn(*m[1], generator=gen, dtype=torch.float64) * case.bias_scale, m[4], gen)
            t = t.to(torch.float32 if m[2] else T)
            leaves[f"bias{n}"] = t.requires_grad_(m[3])
            score_mod.append(mh.scores.bias(t))
        else:
            score_mod.append(mh.scores.softcap(m[1]))

    if case.nan_unseen and mask is not None:
        # Keys no query of their KV head may see "can hold anything" (conventions): NaN.
        from fuzz_oracle import visible

        seen = visible(mask, B, Hq, Lq, Lk).reshape(B, Hkv, Hq // Hkv, Lq, Lk).any(2).any(2)  # (B, Hkv, Lk)
        with torch.no_grad():
            for name in ("k", "v"):
                leaf = leaves[name]
                unseen = ~seen if leaf.shape[1] == Hkv else ~seen.any(1, keepdim=True)
                leaf.masked_fill_(unseen.unsqueeze(-1), float("nan"))

    if case.nan_input and leaves[case.nan_input].numel():
        leaf = leaves[case.nan_input]
        where = tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in leaf.shape)
        with torch.no_grad():
            leaf[where] = float("nan")
    for (name, size), kind in zip(sizes.items(), case.layouts):
        views[name] = layout(leaves[name], kind, size)
    kwargs = {}
    if case.scale is not None:
        kwargs["scale"] = case.scale
    if case.return_lse:
        kwargs["return_lse"] = True
    if case.return_weights:
        kwargs["return_weights"] = True
        for key, sel in (("weights_heads", case.weights_heads), ("weights_rows", case.weights_rows)):
            if sel is not None:
                kwargs[key] = torch.tensor(sel[1]) if isinstance(sel, tuple) else sel
    return Built(leaves, views["q"], views["k"], views["v"], mask, score_mod or None, kwargs, dout)
