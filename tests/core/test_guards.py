"""multihead.guards: the C-level check a stored plan runs on. It must tell apart every fact the
plan's key holds, each changed alone, and pass tensors that share them; where PyTorch's guard
is missing or untrusted, none is built and the Python key serves every call."""

import pytest
import torch

import multihead as mh
from multihead import guards, plans


def _qkv(seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 8, 4, generator=gen, **kw) for _ in range(3))


@pytest.fixture
def guard():
    check = guards.tensor_guard(*_qkv())
    if check is None:
        pytest.skip("this PyTorch has no trusted tensor guard")
    return check


def test_a_guard_passes_other_tensors_with_the_same_facts(guard):
    assert guard(*_qkv(seed=1))
    q, k, v = _qkv(seed=2)
    assert guard(q, k, v.clone())


@pytest.mark.parametrize(
    "change",
    ["dtype", "shape", "strides", "device", "requires_grad", "subclass", "not a tensor"],
)
@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_guard_fails_each_fact_changed_alone(guard, change, which):
    tensors = list(_qkv(seed=3))
    t = tensors[which]
    tensors[which] = {
        "dtype": lambda: t.double(),
        "shape": lambda: torch.randn(1, 2, 9, 4),
        "strides": lambda: torch.randn(1, 2, 4, 8).transpose(2, 3),  # the same shape, other strides
        "device": lambda: t.to("meta"),
        "requires_grad": lambda: t.clone().requires_grad_(),
        "subclass": lambda: torch.nn.Parameter(t.clone()),
        "not a tensor": lambda: t.tolist(),
    }[change]()
    assert not guard(*tensors)


def test_no_guard_for_a_tensor_passed_twice_and_a_sparse_layout_is_a_fact():
    q, k, v = _qkv()
    assert guards.tensor_guard(q, k, k) is None  # (PyTorch's guard fails its own examples then)
    sparse = guards.tensor_guard(q, k, v.to_sparse())
    if sparse is not None:
        assert sparse(q, k, v.to_sparse()) and not sparse(q, k, v)


def test_without_a_trusted_guard_the_key_serves_every_call(monkeypatch):
    monkeypatch.setattr(guards, "_TRUSTED", [False])
    plans.clear()
    q, k, v = _qkv()
    outs = [mh.attention(q, k, v, mask=mh.causal()) for _ in range(4)]
    assert plans._last is None and all(torch.equal(o, outs[0]) for o in outs)
    want = mh.reference_attention(q.double(), k.double(), v.double(), mask=mh.causal()).output
    torch.testing.assert_close(outs[-1].double(), want, rtol=1e-5, atol=1e-5)
    plans.clear()
