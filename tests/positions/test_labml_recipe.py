"""The labml hook, kept: a labml-style subclass changes the scores without copying ``forward``.

The labml tutorial (``shared/seeds/000``) makes ``get_scores`` overridable "for other variations
like relative attention", but its ALiBi subclass copies the whole ``forward`` to add the bias.
Here the subclasses only name a score modifier (``score_mod=ALiBi(heads)``) or override one
method with ``score_mod``'s signature, and inherit ``forward``. Each is checked against the seed's
own formula, written out by hand in its sequence-first layout::

    S_ijbh = Σ_d Q_ibhd K_jbhd / √d_k + bias_ijh      blocked (j > i): -inf
    P = softmax_j(S)          X_ibhd = Σ_j P_ijbh V_jbhd          out = output(concat_h X)

The same classes are in docs/positions.md ("The labml hook, kept"); the doc's own copies are
checked here too, so the page cannot drift from what is tested.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.positions import ALiBi, RelativePositionBias, alibi_slopes, relative_position_bucket

DT = torch.float64
BACKENDS = ["auto", "reference", "sdpa", "blocksparse", "torch_blocks"]


# ------------------------------------------------------------------------------ the recipe
class AlibiMultiHeadAttention(mh.MultiHeadAttention):
    """labml's ALiBi attention (sequence-first, causal): only the modifier is new."""

    def __init__(self, heads: int, d_model: int, dropout_prob: float = 0.1, **options):
        super().__init__(
            d_model, heads, dropout=dropout_prob, causal=True, batch_first=False, score_mod=ALiBi(heads), **options
        )


class AlibiByHook(mh.MultiHeadAttention):
    """The same ALiBi through the one-method hook: ``get_scores`` has ``score_mod``'s signature."""

    def __init__(self, heads: int, d_model: int, **options):
        super().__init__(d_model, heads, causal=True, batch_first=False, score_mod=self.get_scores, **options)
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)  # (H,)

    def get_scores(self, score, b, h, q_idx, kv_idx):
        return score + self.slopes[h].to(score.dtype) * (kv_idx - q_idx)


class RelativeMultiHeadAttention(mh.MultiHeadAttention):
    """A learned bias per head and distance into the past (distances >= max_distance share the last)."""

    def __init__(self, heads: int, d_model: int, max_distance: int = 64, **options):
        super().__init__(d_model, heads, causal=True, batch_first=False, score_mod=self.get_scores, **options)
        self.rel = nn.Parameter(torch.zeros(heads, max_distance, dtype=options.get("dtype")))

    def get_scores(self, score, b, h, q_idx, kv_idx):
        return score + self.rel[h, (q_idx - kv_idx).clamp(0, self.rel.shape[1] - 1)]


class T5MultiHeadAttention(mh.MultiHeadAttention):
    """A learned bias through a module passed as ``score_mod`` (T5's bucketed table)."""

    def __init__(self, heads: int, d_model: int, **options):
        super().__init__(
            d_model,
            heads,
            causal=True,
            batch_first=False,
            score_mod=RelativePositionBias(heads, bidirectional=False, dtype=options.get("dtype")),
            **options,
        )


# ------------------------------------------------------------------------------ the seed's math
def labml_get_slopes(n_heads: int) -> torch.Tensor:
    """labml's ``get_slopes``: a geometric series from ``2^(-8/n)`` for the closest smaller power
    of two ``n``, then the odd powers of ``2^(-4/n)`` for the remaining heads."""
    n = 2 ** math.floor(math.log2(n_heads))
    m = torch.pow(torch.tensor(2.0 ** (-8.0 / n), dtype=DT), torch.arange(1, 1 + n))
    if n < n_heads:
        m_hat = torch.pow(torch.tensor(2.0 ** (-4.0 / n), dtype=DT), torch.arange(1, 1 + 2 * (n_heads - n), 2))
        m = torch.cat([m, m_hat])
    return m


def seed_attention(layer: mh.MultiHeadAttention, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The seed's forward for self-attention, with a bias ``[Lq, Lk, H]`` added after the scaling
    and labml's causal mask ``[Lq, Lk, 1]`` (0 = blocked). The layer supplies only the four
    linear maps; every reshape, product and the softmax are written here."""
    L, B, _ = x.shape
    H, d_k = layer.num_heads, layer.head_dim
    q = layer.q_proj(x).view(L, B, H, d_k)  # [L, B, H, d_k]
    k = layer.k_proj(x).view(L, B, H, d_k)
    v = layer.v_proj(x).view(L, B, H, d_k)
    scores = torch.einsum("ibhd,jbhd->ijbh", q, k) / math.sqrt(d_k)  # [Lq, Lk, B, H]
    scores = scores + bias[:, :, None, :]
    mask = torch.tril(torch.ones(L, L, dtype=x.dtype)).unsqueeze(-1)  # [Lq, Lk, 1]: query i sees keys j <= i
    scores = scores.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
    attn = scores.softmax(dim=1)  # over the keys
    out = torch.einsum("ijbh,jbhd->ibhd", attn, v).reshape(L, B, H * d_k)
    return layer.out_proj(out)


def alibi_paper(heads: int, L: int) -> torch.Tensor:
    """``[Lq, Lk, H]``: ``m_h · (j - i)``."""
    i = torch.arange(L).view(-1, 1, 1)
    j = torch.arange(L).view(1, -1, 1)
    return labml_get_slopes(heads).view(1, 1, -1) * (j - i).to(DT)


def alibi_labml(heads: int, L: int) -> torch.Tensor:
    """``[Lq, Lk, H]`` as labml's ``get_alibi_biases``: ``distance = mask.cumsum(-1)`` of the
    causal mask, i.e. ``m_h · (j + 1)`` on visible keys: ``m_h·(j - i)`` plus ``m_h·(i + 1)``,
    a constant per row that the softmax does not see."""
    mask = torch.tril(torch.ones(L, L, dtype=DT))
    distance = mask.cumsum(dim=-1)
    return distance[:, :, None] * labml_get_slopes(heads)[None, None, :]


def _run(layer: mh.MultiHeadAttention, backend: str, x: torch.Tensor) -> torch.Tensor:
    layer.backend = backend
    try:
        return layer(x)
    except mh.BackendRefusedError as err:
        pytest.skip(f"{backend} refuses: {err}")


@functools.cache
def _doc_namespace() -> dict:
    """The names defined by docs/positions.md's "The labml hook, kept" (its blocks, run once)."""
    path = Path(__file__).with_name("test_docs_positions.py")
    spec = importlib.util.spec_from_file_location("_docs_positions_for_labml", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_section("The labml hook, kept")


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("heads", [4, 8, 12, 6])
def test_labml_slopes_are_alibi_slopes(heads):
    torch.testing.assert_close(alibi_slopes(heads), labml_get_slopes(heads))


@pytest.mark.parametrize(
    "name",
    [
        "AlibiMultiHeadAttention",
        "AlibiByHook",
        "RelativeMultiHeadAttention",
        "T5MultiHeadAttention",
        "doc:AlibiMultiHeadAttention",
        "doc:RelativeMultiHeadAttention",
    ],
)
def test_the_recipe_does_not_copy_forward(name):
    cls = _doc_namespace()[name[4:]] if name.startswith("doc:") else globals()[name]
    assert cls.forward is mh.MultiHeadAttention.forward
    assert cls.__dict__.keys() <= {
        "__module__",
        "__qualname__",
        "__doc__",
        "__init__",
        "get_scores",
        "__firstlineno__",
        "__static_attributes__",
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["score_mod", "hook", "doc"])
@pytest.mark.parametrize("heads, L", [(4, 7), (6, 300)])
def test_alibi_subclass_equals_the_seed_formula(variant, heads, L, backend):
    torch.manual_seed(0)
    E, B = 8 * heads, 2
    if variant == "score_mod":
        layer = AlibiMultiHeadAttention(heads, E, dtype=DT)
    elif variant == "hook":
        layer = AlibiByHook(heads, E, dtype=DT)
    else:
        layer = _doc_namespace()["AlibiMultiHeadAttention"](heads, E).to(DT)
    layer.eval()  # labml defines dropout and never applies it; here it would apply in training mode
    x = torch.randn(L, B, E, dtype=DT)
    got = _run(layer, backend, x)
    with torch.no_grad():
        expected = seed_attention(layer, x, alibi_paper(heads, L))
        torch.testing.assert_close(seed_attention(layer, x, alibi_labml(heads, L)), expected)  # labml's form
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["test", "doc"])
def test_a_learned_bias_through_score_mod_trains(variant, backend):
    """The bias gets exactly the gradient of the seed's formula, and a few steps fit a target."""
    torch.manual_seed(1)
    H, E, L, B, max_distance = 4, 32, 12, 2, 8
    if variant == "test":
        layer = RelativeMultiHeadAttention(H, E, max_distance=max_distance, dtype=DT)
    else:
        layer = _doc_namespace()["RelativeMultiHeadAttention"](H, E, max_distance=max_distance).to(DT)
    with torch.no_grad():
        layer.rel.normal_()
    assert "rel" in dict(layer.named_parameters())
    x = torch.randn(L, B, E, dtype=DT)
    w = torch.randn(L, B, E, dtype=DT)

    out = _run(layer, backend, x)
    (out * w).sum().backward()
    grad_rel, grad_q = layer.rel.grad.clone(), layer.q_proj.weight.grad.clone()
    layer.zero_grad()

    # The seed's formula with the same table, bias[i, j, h] = rel[h, clamp(i - j, 0, max_distance - 1)].
    i, j = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
    bias = layer.rel[:, (i - j).clamp(0, max_distance - 1)].permute(1, 2, 0)  # [Lq, Lk, H]
    expected = seed_attention(layer, x, bias)
    (expected * w).sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad_rel, layer.rel.grad)
    torch.testing.assert_close(grad_q, layer.q_proj.weight.grad)
    assert (grad_rel[:, :max_distance].abs().sum(dim=0) > 0).all()  # every distance was seen (L > max_distance)
    layer.zero_grad()

    # It trains: fitting a target moves the table and lowers the loss.
    target = torch.randn(L, B, E, dtype=DT)
    before = layer.rel.detach().clone()
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (layer(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(layer.rel.detach(), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bias_module_as_score_mod_trains(backend):
    """``score_mod=RelativePositionBias(...)`` in a subclass: the module's table is a parameter of
    the layer and gets the gradient of the seed's formula with ``weight[bucket(j - i), h]``."""
    torch.manual_seed(2)
    H, E, L, B = 4, 32, 40, 2
    layer = T5MultiHeadAttention(H, E, dtype=DT)
    table = layer.score_mod.weight
    assert any(p is table for p in layer.parameters())
    with torch.no_grad():
        table.normal_()
    x = torch.randn(L, B, E, dtype=DT)
    w = torch.randn(L, B, E, dtype=DT)
    out = _run(layer, backend, x)
    (out * w).sum().backward()
    grad = table.grad.clone()
    layer.zero_grad()

    i, j = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
    bucket = relative_position_bucket(j - i, bidirectional=False, num_buckets=32, max_distance=128)  # [Lq, Lk]
    expected = seed_attention(layer, x, table[bucket])  # [Lq, Lk, H]
    (expected * w).sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, table.grad)
    seen = int(bucket.max()) + 1  # distances 0 ... -(L-1)
    assert (grad[:seen].abs().sum(dim=1) > 0).all() and (grad[seen:] == 0).all()


def test_a_hook_subclass_prints():  # a bound method of the layer must not print the layer again (recursion)
    layer = AlibiByHook(2, 16)
    assert "get_scores" in repr(layer)
