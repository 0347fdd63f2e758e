"""``torch.compile``: the functional API and the layer, forward and backward, trace into ONE graph.

Every compiled function here is built with ``fullgraph=True``, which raises on any graph break,
and counted with a compile counter (one count per graph dynamo hands to the compiler):

* a second call with the same shapes (new values, new mask lengths or document ids) compiles nothing;
* with ``dynamic=True``, changing ``Lq``/``Lk`` costs at most one recompilation (the first
  compilation may count twice: dynamo restarts once to specialize a float, before any call runs);
* outputs and gradients follow the relative rule of ``shared/TESTING.md`` against the fp64 oracle.

Which backends compile is read from ``Capabilities.compiles``; a backend that declares it does not
gives a reason, and the declaration is checked (forcing it under ``fullgraph=True`` raises).

The default tier compiles with ``aot_eager`` (dynamo and AOTAutograd, so the backward is traced
too, without code generation): a graph break or a guard is found the same as with Inductor, in
seconds. The slow tier runs every mask kind of ``tests/helpers.py`` on every compiling backend,
forward and backward, flex, and Inductor for a few cases.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import multihead as mh
from helpers import MASK_KINDS, assert_relative, make_mask, naive_attention
from multihead.backends import Capabilities
from multihead.positions import ALiBi, RotaryEmbedding
from multihead.validation import validate_call

COMPILING = [n for n in mh.available_backends() if mh.get_backend(n).capabilities.compiles]
NOT_COMPILING = [
    n
    for n in mh.available_backends()
    if not mh.get_backend(n).capabilities.compiles and "cpu" in mh.get_backend(n).capabilities.device_types
]
# flex compiles flex_attention into the caller's graph: 10-60 s per mask on 2 cores (slow tier).
SLOW_BACKENDS = {"flex"}
B, Hq, Hkv, D = 2, 4, 2, 16


def compiled(fn, *, dynamic: bool = False, compiler: str = "aot_eager"):
    """``torch.compile(fn, fullgraph=True)`` and its counter (``counter.frame_count``: graphs compiled)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(compiler)
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=dynamic), counter


def qkv(Lq: int, Lk: int, seed: int, *, grad: bool = True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(grad) for s in shapes]


def factor(backend: str, gradients: bool) -> float:
    names = COMPILING if backend == "auto" else [backend]  # auto may choose any of them
    return max(mh.get_backend(n).capabilities.tolerance_factor(torch.float32, gradients) for n in names)


def skip_if_refused(backend: str, q, k, v, mask, score_mod) -> None:
    if backend == "auto":
        return
    call = validate_call(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=None,
        dropout_p=0.0,
        dropout_mask=None,
        return_weights=False,
        return_lse=False,
    )
    reasons = mh.get_backend(backend).refusals(call)
    if reasons:
        pytest.skip(f"{backend} refuses: " + "; ".join(reasons))


def check_relative(fn_out, q, k, v, mask, score_mod, backend: str, grad: bool, what: str) -> None:
    """Output (and gradients of q, k, v for a fixed cotangent) against the fp64 oracle, with the
    naive fp32 computation as the baseline."""
    out, grads = fn_out
    ref_in = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    base_in = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    ref = mh.reference_attention(*ref_in, mask=mask, score_mod=score_mod).output
    bound = None if score_mod is None else mh.scores.as_score_mod(score_mod).for_lengths(q.shape[2], k.shape[2])
    base = naive_attention(*base_in, mask, score_mod=bound)
    assert_relative(out, ref, base, factor(backend, False), f"{what}: output")
    if not grad:
        return
    cotangent = _cotangent(out)
    ref.backward(cotangent.double())
    base.backward(cotangent)
    magnitude = max(float(t.grad.abs().max()) for t in ref_in)
    for name, g, r, b in zip("qkv", grads, ref_in, base_in):
        assert_relative(g, r.grad, b.grad, factor(backend, True), f"{what}: grad {name}", magnitude=magnitude)


def _cotangent(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=out.dtype)


def run(fn, q, k, v, *args):
    """``fn(q, k, v, *args)``, and the gradients of q, k, v for the fixed cotangent when they require it."""
    out = fn(q, k, v, *args)
    if not q.requires_grad:
        return out.detach(), None
    grads = torch.autograd.grad(out, (q, k, v), _cotangent(out))
    return out.detach(), grads


# ------------------------------------------------------------------------- the functional API
# (name, mask builder (B, Lq, Lk) -> mask, score modifier): fixed masks, read as constants.
def _lengths(Lk):
    return torch.tensor([Lk, 0] if B == 2 else [Lk] * B)  # the second batch element sees no key


FUNCTIONAL = {
    "causal+alibi": (lambda Lq, Lk: mh.causal(), ALiBi(Hq)),
    "sliding_window": (lambda Lq, Lk: mh.sliding_window(8), None),
    "key_padding_empty_row": (lambda Lq, Lk: mh.key_padding(_lengths(Lk)), None),
    "causal&window|prefix": (lambda Lq, Lk: mh.causal() & mh.sliding_window(8) | mh.prefix_lm(3), None),
    "custom+softcap": (lambda Lq, Lk: mh.custom(lambda b, h, q, kv: (q + kv + h) % 3 != 0), mh.scores.softcap(2.0)),
    "additive_tensor": (
        lambda Lq, Lk: torch.randn(1, Hq, Lq, Lk, generator=torch.Generator().manual_seed(4)).masked_fill(
            ~mh.causal().materialize(1, 1, Lq, Lk), float("-inf")
        ),
        None,
    ),
}
# A representative set for the default tier; every pairing runs in the slow tier.
DEFAULT_CASES = [
    ("auto", "causal+alibi"),
    ("auto", "sliding_window"),
    ("auto", "key_padding_empty_row"),
    ("auto", "causal&window|prefix"),
    ("sdpa", "additive_tensor"),
    ("reference", "custom+softcap"),
]


def _functional_case(backend, name, Lq=37, Lk=53, grad=True, compiler="aot_eager"):
    make, score_mod = FUNCTIONAL[name]
    mask = make(Lq, Lk)
    q, k, v = qkv(Lq, Lk, 0, grad=grad)
    skip_if_refused(backend, q, k, v, mask, score_mod)

    def fn(q, k, v):
        return mh.attention(q, k, v, mask=mask, score_mod=score_mod, backend=backend)

    step, counter = compiled(fn, compiler=compiler)
    check_relative(run(step, q, k, v), q, k, v, mask, score_mod, backend, grad, f"{backend} {name}")
    first = counter.frame_count
    assert first == 1  # fullgraph=True: one graph or an exception
    q2, k2, v2 = qkv(Lq, Lk, 1, grad=grad)  # same shapes, new values: no recompilation
    check_relative(run(step, q2, k2, v2), q2, k2, v2, mask, score_mod, backend, grad, f"{backend} {name}, 2nd call")
    assert counter.frame_count == first, "a second call with the same shapes recompiled"


@pytest.mark.parametrize("backend, name", DEFAULT_CASES, ids=[f"{b}-{n}" for b, n in DEFAULT_CASES])
def test_functional_compiles_in_one_graph_forward_and_backward(backend, name):
    _functional_case(backend, name)


def test_masks_built_inside_from_tensors_change_without_recompiling():
    """A training step builds its masks from the batch: ``key_padding(lengths) & causal()`` and
    ``document(ids)`` made inside the compiled function from tensor arguments. New lengths and new
    document boundaries (same shapes) run the same graph, and the results follow the new masks."""
    Lq = Lk = 41

    def fn(q, k, v, lengths, ids):
        mask = mh.key_padding(lengths) & mh.causal() | mh.document(ids)
        return mh.attention(q, k, v, mask=mask)

    step, counter = compiled(fn)
    for seed in range(3):
        gen = torch.Generator().manual_seed(10 + seed)
        lengths = torch.randint(1, Lk + 1, (B,), generator=gen)
        ids = torch.sort(torch.randint(0, 4, (B, Lk), generator=gen)).values
        q, k, v = qkv(Lq, Lk, seed)
        got = run(step, q, k, v, lengths, ids)
        mask = mh.key_padding(lengths) & mh.causal() | mh.document(ids)
        check_relative(got, q, k, v, mask, None, "auto", True, f"masks of call {seed}")
    assert counter.frame_count == 1


def test_decode_step_compiles():
    """The decode backend (a few query tokens against the cache), forward and backward."""
    Lq, Lk = 3, 300
    mask = mh.causal() & mh.key_padding(torch.tensor([300, 120]))
    q, k, v = qkv(Lq, Lk, 2)
    skip_if_refused("decode", q, k, v, mask, None)
    step, counter = compiled(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend="decode"))
    check_relative(run(step, q, k, v), q, k, v, mask, None, "decode", True, "decode step")
    q, k, v = qkv(Lq, Lk, 3)
    check_relative(run(step, q, k, v), q, k, v, mask, None, "decode", True, "decode step, 2nd call")
    assert counter.frame_count == 1


def test_a_changed_length_recompiles_at_most_once_with_dynamic_true():
    """``dynamic=True``: Lq and Lk change (bottom-right causal with Lq != Lk, a window and a
    padding mask built from the call's own lengths) and the graph serves them all: at most one
    recompilation after the first compilation, results right for every length."""

    def fn(q, k, v):
        Lk = k.shape[2]
        mask = mh.causal() & mh.key_padding(torch.tensor([Lk, Lk // 2])) | mh.sliding_window(2, 2)
        return mh.attention(q, k, v, mask=mask)

    step, counter = compiled(fn, dynamic=True)
    first = None
    for Lq, Lk in ((37, 53), (50, 77), (20, 20)):
        q, k, v = qkv(Lq, Lk, Lq)
        got = run(step, q, k, v)
        first = counter.frame_count if first is None else first
        mask = mh.causal() & mh.key_padding(torch.tensor([Lk, Lk // 2])) | mh.sliding_window(2, 2)
        check_relative(got, q, k, v, mask, None, "auto", True, f"Lq={Lq} Lk={Lk}")
    assert counter.frame_count - first <= 1, f"{counter.frame_count - first} recompilations"


# ------------------------------------------------------------------------------------ the layer
def _layer(seed=0):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=RotaryEmbedding(8))


def _layer_run(layer, x, **kwargs):
    """The output and the gradients of x and of every parameter, for a fixed cotangent."""
    layer.zero_grad()
    x = x.detach().requires_grad_()
    out = layer(x, **kwargs)
    out.backward(_cotangent(out))
    return out.detach(), [x.grad] + [p.grad.clone() for p in layer.parameters()]


def _check_layer(compiled_run, layer, x, what, **kwargs):
    """The compiled layer's error against the same layer in fp64 is at most F times the eager fp32
    layer's (the relative rule, with eager fp32 as the baseline)."""
    eager = _layer_run(layer, x, **kwargs)
    ref_layer = copy.deepcopy(layer).double()
    ref_kwargs = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kwargs.items()}
    ref = _layer_run(ref_layer, x.double(), **ref_kwargs)
    F = factor("auto", False)
    assert_relative(compiled_run[0], ref[0], eager[0], F, f"{what}: output")
    magnitude = max(float(r.abs().max()) for r in ref[1])
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, got, r, b in zip(names, compiled_run[1], ref[1], eager[1]):
        assert_relative(got, r, b, factor("auto", True), f"{what}: grad {name}", magnitude=magnitude)


def test_layer_with_rope_and_causal_compiles_forward_and_backward():
    """GQA, RoPE (rotated at the positions without reading them on the host), causal & a padding
    mask given per call: one graph, forward and backward; a second batch compiles nothing."""
    layer = _layer()
    step, counter = compiled(layer)
    for seed in range(2):
        gen = torch.Generator().manual_seed(20 + seed)
        x = torch.randn(B, 19, 32, generator=gen)
        mask = mh.key_padding(torch.tensor([19, 11 - 4 * seed]))
        got = _layer_run(step, x, mask=mask)
        _check_layer(got, layer, x, f"layer call {seed}", mask=mask)
    assert counter.frame_count == 1


def test_layer_recompiles_at_most_once_when_the_length_changes_with_dynamic_true():
    layer = _layer()
    step, counter = compiled(layer, dynamic=True)
    first = None
    for L in (19, 40, 7):
        x = torch.randn(B, L, 32, generator=torch.Generator().manual_seed(L))
        got = _layer_run(step, x)
        first = counter.frame_count if first is None else first
        _check_layer(got, layer, x, f"L={L}")
    assert counter.frame_count - first <= 1, f"{counter.frame_count - first} recompilations"


# ---------------------------------------------------------------------- what does not compile
def test_compile_capabilities_are_declared_with_reasons():
    """Every backend says whether it compiles; one that does not says why, and the dispatcher
    passes over it under torch.compile with that reason."""
    assert "sdpa" in COMPILING and "reference" in COMPILING
    for name in mh.available_backends():
        caps = mh.get_backend(name).capabilities
        assert isinstance(caps.compiles, bool)
        assert caps.compiles or len(caps.compile_note) > 20, name
    with pytest.raises(ValueError, match="compile_note"):
        Capabilities(compiles=False)


@pytest.mark.parametrize("backend", NOT_COMPILING)
def test_a_backend_declared_not_to_compile_breaks_the_graph_and_auto_avoids_it(backend):
    """The declaration is true: forced under ``fullgraph=True`` it raises (a graph break).
    ``auto``, on a call that eager ``auto`` gives this backend, compiles in one graph (it chose
    another). (Without fullgraph the forced backend still runs, in pieces: the slow tier.)"""
    q, k, v, kw = _long_window_call(backend)
    forced, _ = compiled(lambda q, k, v: mh.attention(q, k, v, **kw, backend=backend), compiler="eager")
    with pytest.raises(Exception, match="(?i)graph break|data-dependent|item|Unsupported|guard"):
        forced(q, k, v)
    auto, counter = compiled(lambda q, k, v: mh.attention(q, k, v, **kw), compiler="eager")
    torch.testing.assert_close(auto(q, k, v), mh.attention(q, k, v, **kw), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def _long_window_call(backend):
    """``q, k, v`` and the keywords of a call that eager ``auto`` gives ``backend``."""
    Lq = Lk = 256  # long enough that eager auto prefers a blocked backend for a window
    kw: dict = {"mask": mh.sliding_window(16)}
    if backend == "torch_blocks":  # what the fused kernels cannot run (an elementwise modifier), on a mask
        # whose key ranges are read on the host (a band's are plain integers, which trace)
        kw = {
            "mask": mh.document(torch.arange(Lq).div(64, rounding_mode="floor").expand(B, Lq)),
            "score_mod": mh.scores.softcap(5.0),
        }
    q, k, v = qkv(Lq, Lk, 5, grad=False)
    assert mh.explain(q, k, v, **kw).backend == backend  # eager auto gives it this call
    return q, k, v, kw


# ----------------------------------------------------------------------------------- slow tier
@pytest.mark.slow
@pytest.mark.parametrize("backend", NOT_COMPILING)
def test_a_backend_declared_not_to_compile_still_runs_in_pieces(backend):
    q, k, v, kw = _long_window_call(backend)
    torch._dynamo.reset()
    pieces = torch.compile(lambda q, k, v: mh.attention(q, k, v, **kw, backend=backend), backend="eager")
    torch.testing.assert_close(pieces(q, k, v), mh.attention(q, k, v, **kw, backend=backend))


MATRIX_BACKENDS = ["auto"] + COMPILING


@pytest.mark.slow
@pytest.mark.parametrize("backend", MATRIX_BACKENDS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_mask_kind_on_every_compiling_backend(backend, kind):
    """Every mask kind of the test matrix (fully masked rows and batch elements included), forward
    and backward where the backend has a backward, one graph, no recompilation on new values."""
    Lq, Lk = 37, 53
    gen = torch.Generator().manual_seed(7)
    mask = make_mask(kind, B, Hq, Lq, Lk, gen)
    q, k, v = qkv(Lq, Lk, 0)
    grad = True
    if backend != "auto":
        call = validate_call(
            q,
            k,
            v,
            mask=mask,
            score_mod=None,
            scale=None,
            dropout_p=0.0,
            dropout_mask=None,
            return_weights=False,
            return_lse=False,
        )
        if mh.get_backend(backend).refusals(call):  # flex on CPU: inference only
            grad = False
            q, k, v = qkv(Lq, Lk, 0, grad=False)
    skip_if_refused(backend, q, k, v, mask, None)
    step, counter = compiled(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend=backend))
    check_relative(run(step, q, k, v), q, k, v, mask, None, backend, grad, f"{backend} {kind}")
    q2, k2, v2 = qkv(Lq, Lk, 1, grad=grad)
    check_relative(run(step, q2, k2, v2), q2, k2, v2, mask, None, backend, grad, f"{backend} {kind}, 2nd call")
    assert counter.frame_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", MATRIX_BACKENDS)
@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_every_score_modifier_case_on_every_compiling_backend(backend, name):
    grad = backend not in SLOW_BACKENDS  # flex on CPU: inference only
    _functional_case(backend, name, grad=grad)


def test_top_left_causal_with_fewer_queries_than_keys_recompiles_at_most_once_with_dynamic_true():
    """sdpa leaves out the keys no query sees (Lq < Lk, top-left): its note must not format the
    symbolic lengths, which fixed Lk in the graph and recompiled at every length."""
    step, counter = compiled(lambda q, k, v: mh.attention(q, k, v, mask=mh.causal("top_left")), dynamic=True)
    first = None
    for Lq, Lk in ((37, 53), (41, 60), (50, 77)):
        q, k, v = qkv(Lq, Lk, Lq)
        got = run(step, q, k, v)
        first = counter.frame_count if first is None else first
        check_relative(got, q, k, v, mh.causal("top_left"), None, "auto", True, f"Lq={Lq} Lk={Lk}")
    assert counter.frame_count - first <= 1, f"{counter.frame_count - first} recompilations"


@pytest.mark.slow
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_mask_kind_recompiles_at_most_once_with_dynamic_true(kind):
    """The mask is rebuilt for each length (it is defined for one Lq x Lk)."""
    step, counter = compiled(lambda q, k, v, mask: mh.attention(q, k, v, mask=mask), dynamic=True)
    first = None
    for Lq, Lk in ((37, 53), (41, 60), (50, 77)):
        mask = make_mask(kind, B, Hq, Lq, Lk, torch.Generator().manual_seed(Lq))
        q, k, v = qkv(Lq, Lk, Lq)
        got = run(step, q, k, v, mask)
        first = counter.frame_count if first is None else first
        check_relative(got, q, k, v, mask, None, "auto", True, f"{kind} Lq={Lq} Lk={Lk}")
    assert counter.frame_count - first <= 1, f"{kind}: {counter.frame_count - first} recompilations"


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, name", [("auto", "causal+alibi"), ("auto", "key_padding_empty_row"), ("reference", "custom+softcap")]
)
def test_inductor(backend, name):
    _functional_case(backend, name, compiler="inductor")


@pytest.mark.slow
def test_inductor_layer_and_decode_step():
    layer = _layer()
    step, counter = compiled(layer, compiler="inductor")
    x = torch.randn(B, 19, 32, generator=torch.Generator().manual_seed(30))
    _check_layer(_layer_run(step, x), layer, x, "inductor layer")
    x = torch.randn(B, 19, 32, generator=torch.Generator().manual_seed(31))
    _check_layer(_layer_run(step, x), layer, x, "inductor layer, 2nd call")
    assert counter.frame_count == 1
    mask = mh.causal() & mh.key_padding(torch.tensor([300, 120]))
    q, k, v = qkv(3, 300, 2)
    step, counter = compiled(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend="decode"), compiler="inductor")
    check_relative(run(step, q, k, v), q, k, v, mask, None, "decode", True, "inductor decode step")
    assert counter.frame_count == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "causal",
        pytest.param(
            "window&key_padding",
            marks=pytest.mark.xfail(
                strict=True,
                reason="torch 2.13, Inductor on CPU: create_block_mask of a mask_mod that reads a tensor "
                "(lengths[b]) fails in C++ code generation (VecMask<int> vs VecMask<float> in ?:)",
            ),
        ),
    ],
)
def test_inductor_flex_forward(name):
    """flex in a caller's Inductor graph: flex_attention lowered by the caller's compile."""
    if "flex" not in COMPILING:
        pytest.skip("no flex backend")
    mask = mh.causal() if name == "causal" else mh.sliding_window(8) & mh.key_padding(_lengths(53))
    q, k, v = qkv(37, 53, 0, grad=False)
    skip_if_refused("flex", q, k, v, mask, None)
    step, counter = compiled(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend="flex"), compiler="inductor")
    check_relative(run(step, q, k, v), q, k, v, mask, None, "flex", False, "inductor flex")
    assert counter.frame_count == 1


@pytest.mark.slow
def test_the_docs_example(monkeypatch):
    """The python block of docs/integrations.md's torch.compile section, run with the compile
    counter (aot_eager) in place of Inductor: one graph for the first length, at most one more."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text[text.index("## `torch.compile`") : text.index("## Export and ONNX")]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    counter, counts, real = CompileCounterWithBackend("aot_eager"), [], torch.compile

    def counted(fn, **options):
        compiled_fn = real(fn, backend=counter, **options)

        def call(*args, **kwargs):
            out = compiled_fn(*args, **kwargs)
            counts.append(counter.frame_count)
            return out

        return call

    monkeypatch.setattr(torch, "compile", counted)
    torch._dynamo.reset()
    namespace: dict = {}
    exec(compile(block, "docs/integrations.md [torch.compile]", "exec"), namespace)  # noqa: S102
    assert namespace["out"].shape == (4, 173, 512) and len(counts) == 2
    assert counts[1] - counts[0] <= 1, counts
