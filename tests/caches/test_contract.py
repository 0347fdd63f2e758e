"""The contract every cache keeps, checked on every kind (``multihead.caches.base``'s docstring,
``docs/inference.md``): one meaning per name.

A new cache (quantized, an eviction policy, ...) joins by adding a :class:`Kind` to ``KINDS``: a
factory, how it builds ``(k, v)`` for an update, and what it declares (rows of their own length,
a window). Every test below then runs on it:

* ``lengths`` is a ``(B,)`` int64 tensor on the cache's device (tokens seen per row), ``length``
  is ``max(lengths)``;
* ``slots(new)`` equals the ``S`` of the next read, through a random walk of updates, crops,
  reorders and resets;
* positions that do not continue a row are refused;
* ``crop(n)`` keeps each row's first ``n`` tokens (a row holding fewer keeps them all), ``crop``
  of an int equals ``crop`` of that int per row;
* ``reorder`` may grow or shrink the batch;
* ``reset`` forgets every token;
* backpropagation through cached steps equals the full attention's gradients;
* a mask combining parts at positions and a tensor over the slots keeps each part's meaning;
* a refused call (bad shapes, dtypes, devices, positions, crops, indices) leaves every tensor and
  attribute of the cache bit-identical.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from cache_state import everything, identical

import multihead as mh
from helpers import DEVICES
from multihead.caches import (
    CacheRead,
    DynamicKVCache,
    KVCache,
    LatentKVCache,
    PagedKVCache,
    QuantizedKVCache,
    SlidingWindowKVCache,
    StaticKVCache,
)
from multihead.caches.base import EMPTY_POSITION
from multihead.caches.policies import SinksAndWindow

B, HKV, D, DV = 2, 3, 7, 5  # Dv <= D: latent rows hold the values as their first Dv features
DT = torch.float64
WINDOW = 6  # the ring's window; masks passed with it must fit (sliding_window(w), w <= WINDOW)


@dataclass(frozen=True)
class Kind:
    """One cache kind as the contract sees it."""

    name: str
    build: Callable[[int, int, int, str], KVCache]  # (Hkv, D, Dv, device) -> an empty cache
    values_in_keys: bool = False  # v must be k[..., :Dv] (latent rows)
    per_row: bool = False  # rows hold their own lengths: crop takes a (B,) tensor
    window: int | None = None  # a ring: masks must not reach further back

    def make(self, heads: int = HKV, head_dim: int = D, value_dim: int = DV, device: str = "cpu") -> KVCache:
        return self.build(heads, head_dim, value_dim, device)

    def kv(self, L: int, seed: int = 0, batch: int = B, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)  # drawn on the CPU, then moved
        k = torch.randn(batch, HKV, L, D, generator=g, dtype=DT).to(device)
        v = k[..., :DV] if self.values_in_keys else torch.randn(batch, HKV, L, DV, generator=g, dtype=DT).to(device)
        return k, v

    def mask(self) -> mh.Mask | None:
        """What a call passes so that the cache can honour it (a ring: its window)."""
        return None if self.window is None else mh.sliding_window(self.window)


MAX_LEN = 64  # a static cache's slots; the random walks stay below

KINDS = [
    Kind("dynamic", lambda h, d, dv, dev: DynamicKVCache(capacity=2)),
    Kind("latent", lambda h, d, dv, dev: LatentKVCache(capacity=2), values_in_keys=True),
    Kind(
        "static",
        lambda h, d, dv, dev: StaticKVCache(B, MAX_LEN, h, d, value_dim=dv, dtype=DT, device=dev),
        per_row=True,
    ),
    Kind(
        "sliding",
        lambda h, d, dv, dev: SlidingWindowKVCache(WINDOW, B, h, d, value_dim=dv, extra=8, dtype=DT, device=dev),
        window=WINDOW,
    ),
    Kind(
        "paged",
        lambda h, d, dv, dev: PagedKVCache(200, 4, h, d, value_dim=dv, batch_size=B, dtype=DT, device=dev),
        per_row=True,
    ),
    # An eviction policy whose window outlasts the walks: the policy's read (its mask at
    # positions, per-head bookkeeping) under every contract check; eviction has its own oracles
    # in test_policies.py.
    Kind("policy-sinks", lambda h, d, dv, dev: DynamicKVCache(policy=SinksAndWindow(2, 2 * MAX_LEN))),
    Kind(
        "policy-sinks-cache-positions",
        lambda h, d, dv, dev: DynamicKVCache(policy=SinksAndWindow(2, 2 * MAX_LEN, positions="cache")),
    ),
    Kind(
        "paged-latent",
        lambda h, d, dv, dev: PagedKVCache(
            200, 4, h, d, value_dim=dv, values_in_keys=True, batch_size=B, dtype=DT, device=dev
        ),
        values_in_keys=True,
        per_row=True,
    ),
]
# Quantized: every value the tests compare stays in the full-precision sinks and residual window
# (<= 10 tokens); the random walks (up to MAX_LEN tokens) quantize groups, crop into them, reorder them.
for fmt in ("int8", "fp8"):
    KINDS.append(
        Kind(
            f"quantized-{fmt}",
            lambda h, d, dv, dev, fmt=fmt: QuantizedKVCache(
                B, MAX_LEN, h, d, value_dim=dv, format=fmt, residual=8, sinks=2, group=2, dtype=DT, device=dev
            ),
        )
    )
KINDS.append(
    Kind(
        "quantized-int8-latent",
        lambda h, d, dv, dev: QuantizedKVCache(
            B, MAX_LEN, h, d, value_dim=dv, values_in_keys=True, residual=8, sinks=2, group=2, dtype=DT, device=dev
        ),
        values_in_keys=True,
    )
)
IDS = [kind.name for kind in KINDS]
every_kind = pytest.mark.parametrize("kind", KINDS, ids=IDS)
per_row_kinds = pytest.mark.parametrize(
    "kind", [k for k in KINDS if k.per_row], ids=[k.name for k in KINDS if k.per_row]
)


def _filled(kind: Kind, lengths: list[int] | None = None, seed: int = 0) -> KVCache:
    """A cache after a prefill of ``max(lengths)`` tokens, cropped per row to ``lengths`` where
    rows may differ (default: 5 tokens in every row)."""
    lengths = lengths or [5] * B
    cache = kind.make()
    cache.update(*kind.kv(max(lengths), seed))
    if len(set(lengths)) > 1:
        cache.crop(torch.tensor(lengths))
    return cache


def _stored(read: CacheRead, row: int) -> dict[int, torch.Tensor]:
    """Row ``row`` of a read as ``{position: key (Hkv, D)}``, over the filled slots."""
    S = read.keys.shape[2]
    if read.key_positions is None:
        positions = list(range(S))
    else:
        kp = read.key_positions
        positions = (kp if kp.dim() == 1 else kp[row]).tolist()
    return {p: read.keys[row, :, j] for j, p in enumerate(positions) if p != EMPTY_POSITION}


# ---------------------------------------------------------------------------- dropped tokens
@every_kind
@pytest.mark.parametrize("how", ["rollback", "crop", "reset"])
def test_dropped_tokens_leave_no_trace_in_later_reads(kind, how):
    """Tokens a rollback, a crop or a reset drops are gone from every later read: a read that returns slots
    past a row's length (a static cache's rows of other lengths, a ring, every slot under
    ``torch.compile``) returns zeros there, never the dropped keys; caches whose reads stop at the
    length never return those slots (docs/inference.md, "Crop, reorder, rollback, refusals").
    The dropped tokens are NaN here, so a trace of them would show."""
    lengths = [5, 3] if kind.per_row else [5, 5]  # rows of their own lengths: reads past row 1's length
    cache = _filled(kind, lengths)
    k, _ = kind.kv(7, seed=2)
    nan_k = torch.full_like(k, float("nan"))
    cache.update(nan_k, nan_k[..., :DV] if kind.values_in_keys else torch.full((B, HKV, 7, DV), float("nan"), dtype=DT))
    if how == "rollback":
        cache.rollback()
    elif how == "crop":
        cache.crop(torch.tensor(lengths) if kind.per_row else 5)
    else:  # every token dropped, then the same prefill again
        cache.reset()
        cache.update(*kind.kv(max(lengths), 0))
        if len(set(lengths)) > 1:
            cache.crop(torch.tensor(lengths))
    assert cache.lengths.tolist() == lengths
    for step in range(3):  # the next tokens, each read whole
        k1, v1 = kind.kv(1, seed=10 + step)
        read = cache.update(k1, v1)
        assert torch.isfinite(read.keys).all() and torch.isfinite(read.values).all(), f"step {step}"
        out = mh.attention(
            torch.randn(B, HKV, 1, D, dtype=DT), read.keys, read.values, mask=read.mask(kind.mask(), True, HKV)
        )
        assert torch.isfinite(out).all()


def test_a_static_cache_zeroes_dropped_slots_inside_a_compiled_step_too():
    """Traced (no host read of the lengths), a static cache's crop zeroes the dropped slots with one
    masked pass and its rollback the slots the update wrote: a compiled decode step reads every slot."""
    cache = StaticKVCache(B, 16, HKV, D, value_dim=DV, dtype=DT)
    k, v = Kind("static", lambda *a: cache).kv(9)
    cache.update(k, v)

    def crop_and_step(lengths, k1, v1):
        cache.crop(lengths)
        cache.update(k1, v1)
        cache.rollback()

    k1, v1 = torch.full((B, HKV, 1, D), float("nan"), dtype=DT), torch.full((B, HKV, 1, DV), float("nan"), dtype=DT)
    torch.compile(crop_and_step, backend="eager", fullgraph=True)(torch.tensor([6, 3]), k1, v1)
    assert cache.lengths.tolist() == [6, 3]
    for row, n in enumerate([6, 3]):
        assert torch.equal(cache.keys[row, :, :n], k[row, :, :n]) and torch.equal(
            cache.values[row, :, :n], v[row, :, :n]
        )
        assert not cache.keys[row, :, n:].any() and not cache.values[row, :, n:].any()


# ---------------------------------------------------------------------------- zero new tokens
@every_kind
@pytest.mark.parametrize("causal", [False, True])
def test_a_read_of_zero_new_tokens_has_a_mask_with_no_rows(kind, causal):
    """An update of no tokens (a peek at what the cache holds) reads every slot, and its ``mask``
    has no query rows; a cache whose reads name each slot's position once raised a reshape error
    there (``view(-1, ...)`` of no elements)."""
    cache = _filled(kind, [5, 3] if kind.per_row else [5, 5])
    k, v = kind.kv(0)
    read = cache.update(k, v)
    mask = read.mask(kind.mask(), causal, HKV)
    if isinstance(mask, torch.Tensor):
        assert mask.shape[-2] in (0, 1) and mask.shape[-1] == read.keys.shape[2]  # Lq or broadcast
    cache.rollback()
    assert cache.lengths.tolist() == ([5, 3] if kind.per_row else [5, 5])


# ---------------------------------------------------------------------------- lengths, length
@every_kind
@pytest.mark.parametrize("device", DEVICES)
def test_lengths_is_a_tensor_of_tokens_seen_per_row_and_length_is_its_max(kind, device):
    cache = kind.make(device=device)
    empty = cache.lengths
    assert isinstance(empty, torch.Tensor) and empty.dtype == torch.int64 and empty.dim() == 1
    assert not empty.any() and cache.length == 0
    cache.update(*kind.kv(4, device=device))
    cache.update(*kind.kv(1, seed=1, device=device))
    lengths = cache.lengths
    assert isinstance(lengths, torch.Tensor) and lengths.dtype == torch.int64
    assert lengths.device == cache.update(*kind.kv(0, device=device)).keys.device  # the cache's device
    assert lengths.shape == (B,) and lengths.tolist() == [5, 5] and cache.length == 5
    # the position each row's next token takes
    assert cache.next_positions(1).reshape(-1, 1).expand(B, 1)[:, 0].tolist() == lengths.tolist()
    if kind.window is not None:  # a ring counts the tokens seen, not the ones it still holds
        for t in range(5, 40):
            cache.update(*kind.kv(1, seed=t, device=device))
        assert cache.lengths.tolist() == [40, 40] and cache.length == 40


@per_row_kinds
def test_lengths_and_length_on_rows_of_different_lengths(kind):
    cache = _filled(kind, [5, 2])
    assert cache.lengths.tolist() == [5, 2] and cache.length == 5


# ---------------------------------------------------------------------------- slots
@every_kind
@pytest.mark.parametrize("seed", range(4))
def test_slots_equals_what_the_next_read_returns(kind, seed):
    """Through a random walk of updates of 0 to 4 tokens, crops (int and per row), reorders
    (changing the batch) and resets, ``slots(new)`` asked before each update is the read's S."""
    rng = random.Random(seed)
    cache, batch = kind.make(), B
    for step in range(40):
        action = rng.random()
        if cache.length > MAX_LEN - 8:
            cache.crop(cache.length - 5)  # a ring goes back 5 here
        elif action < 0.65 or cache.length == 0:
            new = rng.choice([0, 1, 1, 1, 2, 3, 4])
            S = cache.slots(new)
            read = cache.update(*kind.kv(new, seed=step, batch=batch))
            assert read.keys.shape[2] == S and read.values.shape[2] == S, (step, new)
            if read.key_positions is not None:
                assert read.key_positions.shape[-1] == S
        elif action < 0.8:
            n = rng.randint(max(0, cache.length - 5), cache.length + 2)  # a ring goes back 5 here
            if kind.per_row and rng.random() < 0.5:
                cache.crop(torch.tensor([rng.randint(max(0, n - 3), n) for _ in range(batch)]))
            else:
                cache.crop(n)
        elif action < 0.95:
            batch = rng.choice([1, 2, 3])
            cache.reorder(torch.tensor([rng.randrange(cache.lengths.shape[0]) for _ in range(batch)]))
        else:
            cache.reset()
            if kind.name in ("dynamic", "latent"):
                batch = rng.choice([1, 2, 3])  # an empty call-order cache takes any batch again


@per_row_kinds
@pytest.mark.parametrize("new", [1, 3])
def test_slots_on_rows_of_different_lengths(kind, new):
    cache = _filled(kind, [5, 2])
    S = cache.slots(new)
    assert cache.update(*kind.kv(new, seed=1)).keys.shape[2] == S


# ---------------------------------------------------------------------------- positions
BAD_POSITIONS = [  # (name, positions for one new token after 5, error, message after "<Cache>.update: ")
    ("backwards", torch.tensor([4]), ValueError, r"positions must continue each row: expected \[5\] in every row"),
    ("a gap", torch.tensor([6]), ValueError, r"positions must continue each row: expected \[5\] in every row"),
    ("one row wrong", torch.tensor([[5], [6]]), ValueError, r"positions must continue each row"),
    ("shape", torch.tensor([5, 6]), ValueError, r"positions must have shape \(1,\) or \(2, 1\)"),
    ("float", torch.tensor([5.0]), TypeError, r"positions must be an integer tensor .* got dtype torch.float32"),
    ("bool", torch.tensor([True]), TypeError, r"positions must be an integer tensor .* got dtype torch.bool"),
    ("a list", [5], TypeError, r"positions must be an integer tensor .* got list"),
]


@every_kind
@pytest.mark.parametrize("name, positions, error, pattern", BAD_POSITIONS, ids=[c[0] for c in BAD_POSITIONS])
def test_positions_that_do_not_continue_every_row_are_refused_and_change_nothing(kind, name, positions, error, pattern):
    cache = _filled(kind)
    before = everything(cache)
    k, v = kind.kv(1, seed=1)
    with pytest.raises(error, match=rf"^{type(cache).__name__}\.update: " + pattern):
        cache.update(k, v, positions)
    assert identical(everything(cache), before)
    read = cache.update(k, v, torch.tensor([5]))  # the right ones are taken
    assert read.query_positions.reshape(-1).unique().tolist() == [5]


# ---------------------------------------------------------------------------- refused calls change nothing
def _bad_updates(kind: Kind) -> list[tuple[str, Callable[[], tuple], type, str]]:
    """(name, () -> (k, v), error, message after "<Cache>.update: ") for this kind."""
    k1, v1 = kind.kv(1, seed=1)
    other = Kind("other", kind.make)  # separate values, for the shapes a latent cache compares first
    cases = [
        ("k 3-D", lambda: (k1[0], v1), ValueError, r"k must have 4 dims \(B, Hkv, Lnew, D\), got shape"),
        ("k not a tensor", lambda: ([[0.0]], v1), TypeError, r"k must be a torch.Tensor"),
        ("k, v lengths", lambda: (k1, kind.kv(2, seed=1)[1]), ValueError, r"k and v must agree on \(B, Hkv, Lnew\)"),
        ("k, v dtypes", lambda: (k1, v1.float()), TypeError, r"k and v must share a dtype"),
        ("k, v devices", lambda: (k1, v1.to("meta")), ValueError, r"k and v must be on one device"),
        ("batch", lambda: kind.kv(1, batch=1), ValueError, r"new keys/values have B=1 but the cache holds B=2"),
        (
            "kv heads",
            lambda: (k1[:, :1], v1[:, :1]),
            ValueError,
            r"new keys/values have Hkv=1 but the cache holds Hkv=3",
        ),
        (
            "head dim",
            lambda: (torch.cat([k1, k1[..., :1]], -1), v1),
            ValueError,
            r"new keys/values have D=8 but the cache holds D=7",
        ),
        ("value dim", lambda: (k1, other.kv(1)[1][..., :4]), ValueError, r"new keys/values have Dv=4 but the cache"),
        (
            "dtype",
            lambda: (k1.float(), k1.float()[..., :DV]),
            TypeError,
            r"new keys/values have dtype torch.float32 but the cache holds torch.float64",
        ),
        ("device", lambda: (k1.to("meta"), v1.to("meta")), ValueError, r"new keys/values are on meta but the cache"),
    ]
    if kind.values_in_keys:
        cases.append(("v not k's prefix", lambda: (k1, -v1), ValueError, r"v must equal k\[\.\.\., :5\]"))
    return cases


@every_kind
def test_a_refused_update_leaves_the_cache_bit_identical(kind):
    for name, make_kv, error, pattern in _bad_updates(kind):
        cache = _filled(kind)
        before = everything(cache)
        k, v = make_kv()
        with pytest.raises(error, match=rf"^{type(cache).__name__}\.update: " + pattern):
            cache.update(k, v)
        assert identical(everything(cache), before), name
        cache.update(*kind.kv(1, seed=1))  # and it still works
        assert cache.lengths.tolist() == [6, 6], name


@every_kind
def test_a_refused_dtype_or_device_says_what_to_do_and_the_advice_holds(kind):
    """The refusal of keys in another dtype names the cast, and says whether ``reset()`` helps: on a
    cache that takes its dtype from its first update it does (the next update then succeeds); on
    one allocated up front it does not (still refused after ``reset()``), and the message says to
    build another cache instead."""
    cache = _filled(kind)
    k1, v1 = kind.kv(1, seed=1)
    k32, v32 = k1.float(), (k1.float()[..., :DV] if kind.values_in_keys else v1.float())
    with pytest.raises(TypeError, match=r"hint: pass k.to\(torch.float64\) and v.to\(torch.float64\), or ") as refused:
        cache.update(k32, v32)
    says_reset = "reset() the cache: its next update sets the dtype" in str(refused.value)
    if not says_reset:
        assert "build the cache with dtype=torch.float32 (reset() keeps the dtype it was built with)" in str(
            refused.value
        )
    moved = r"pass k.to\('cpu'\) and v.to\('cpu'\), or (reset|build the cache with device='meta')"
    with pytest.raises(ValueError, match=moved):
        cache.update(k1.to("meta"), v1.to("meta"))
    cache.reset()
    if says_reset:
        cache.update(k32, v32)
        assert cache.lengths.tolist() == [1, 1]
    else:
        with pytest.raises(TypeError, match=r"but the cache holds torch.float64"):
            cache.update(k32, v32)


ONE_LENGTH = r"every row has the same length here, so length must be an int, got a tensor of shape"
BAD_CROPS = [  # (name, length, error, message after "<Cache>.crop: " on a per-row cache, on the others)
    ("negative", -1, ValueError, r"length must be >= 0, got -1", None),
    (
        "float",
        1.5,
        TypeError,
        r"length must be an int or a \(B,\) integer tensor, got float",
        "length must be an int, got float",
    ),
    (
        "bool",
        True,
        TypeError,
        r"length must be an int or a \(B,\) integer tensor, got bool",
        "length must be an int, got bool",
    ),
    (
        "float tensor",
        torch.tensor([1.0, 2.0]),
        TypeError,
        r"a length tensor must be integers of shape \(B,\) = \(2,\), got dtype torch.float32",
        ONE_LENGTH,
    ),
    (
        "tensor of 3 rows",
        torch.tensor([1, 2, 3]),
        TypeError,
        r"a length tensor must be integers of shape \(B,\) = \(2,\), got dtype torch.int64, shape \(3,\)",
        ONE_LENGTH,
    ),
    ("negative row", torch.tensor([1, -1]), ValueError, r"lengths must be >= 0, got \[1, -1\]", ONE_LENGTH),
    (
        "meta tensor",
        torch.tensor([1, 1], device="meta"),
        ValueError,
        r"length is on the meta device \(a shape without values\), got torch.int64 of shape \(2,\); expected a "
        r"\(B,\) = \(2,\) integer tensor with values",
        ONE_LENGTH,
    ),
]


@every_kind
@pytest.mark.parametrize("name, length, error, pattern, uniform", BAD_CROPS, ids=[c[0] for c in BAD_CROPS])
def test_a_refused_crop_leaves_the_cache_bit_identical(kind, name, length, error, pattern, uniform):
    cache = _filled(kind)
    before = everything(cache)
    if not kind.per_row and uniform is not None:
        error, pattern = TypeError, uniform
    with pytest.raises(error, match=rf"^{type(cache).__name__}\.crop: " + pattern):
        cache.crop(length)
    assert identical(everything(cache), before)


BAD_INDICES = [  # (name, indices, error, message after "<Cache>.reorder: ")
    ("row out of range", torch.tensor([0, 2]), ValueError, r"indices must be rows in \[0, 2\), got values in \[0, 2\]"),
    ("negative row", torch.tensor([-1, 0]), ValueError, r"indices must be rows in \[0, 2\), got values in \[-1, 0\]"),
    ("2-D", torch.tensor([[0, 1]]), TypeError, r"indices must be a 1-D integer tensor of batch rows"),
    ("float", torch.tensor([0.0, 1.0]), TypeError, r"indices must be a 1-D integer tensor .*float32"),
    ("bools", [True, False], TypeError, r"indices must be ints"),
    ("no row", torch.tensor([], dtype=torch.int64), ValueError, r"indices select no row"),
    (
        "meta",
        torch.tensor([1, 0], device="meta"),
        ValueError,
        r"indices is on the meta device \(a shape without values\), got torch.int64 of shape \(2,\); expected "
        r"a 1-D integer tensor of batch rows with values",
    ),
]


@every_kind
@pytest.mark.parametrize("name, indices, error, pattern", BAD_INDICES, ids=[c[0] for c in BAD_INDICES])
def test_a_refused_reorder_leaves_the_cache_bit_identical(kind, name, indices, error, pattern):
    cache = _filled(kind)
    before = everything(cache)
    with pytest.raises(error, match=rf"^{type(cache).__name__}\.reorder: " + pattern):
        cache.reorder(indices)
    assert identical(everything(cache), before)


# ---------------------------------------------------------------------------- crop
@every_kind
@pytest.mark.parametrize("n", [0, 2, 5, 9])
def test_crop_keeps_each_rows_first_n_tokens_and_a_row_with_fewer_keeps_them_all(kind, n):
    cache = _filled(kind)
    k, v = kind.kv(5)
    cache.crop(n)
    kept = min(n, 5)
    assert cache.lengths.tolist() == [kept] * B and cache.length == kept
    k1, v1 = kind.kv(1, seed=7)
    read = cache.update(k1, v1)  # the next token goes right after what was kept
    assert read.query_positions.reshape(-1).unique().tolist() == [kept]
    for row in range(B):
        stored = _stored(read, row)
        assert sorted(stored) == list(range(kept + 1))[-len(stored) :]  # a ring holds the newest
        for p, key in stored.items():
            torch.testing.assert_close(key, (k if p < kept else k1)[row, :, p if p < kept else 0], rtol=0, atol=0)


@per_row_kinds
@pytest.mark.parametrize("n", [0, 1, 3, 4, 6])
def test_crop_of_an_int_caps_rows_of_different_lengths(kind, n):
    """Rows holding 5 and 2 tokens: ``crop(n)`` leaves ``min(n, held)`` in each (a row with fewer
    keeps them all), the same as ``crop`` of ``n`` in every row."""
    by_int, by_rows = _filled(kind, [5, 2]), _filled(kind, [5, 2])
    by_int.crop(n)
    by_rows.crop(torch.tensor([n, n]))
    assert by_int.lengths.tolist() == [min(n, 5), min(n, 2)]
    assert identical(everything(by_int), everything(by_rows))


@per_row_kinds
def test_crop_per_row_past_what_a_row_holds_keeps_that_row(kind):
    cache = _filled(kind, [5, 2])
    cache.crop(torch.tensor([3, 4]))
    assert cache.lengths.tolist() == [3, 2]


# ---------------------------------------------------------------------------- reorder
@every_kind
@pytest.mark.parametrize("order", [[1, 0], [1, 1, 0], [1], [0, 0, 0, 0]], ids=["swap", "grow", "shrink", "fan-out"])
def test_reorder_may_change_the_batch_on_every_cache(kind, order):
    """Beam search grows a batch (one prompt row to four beams) and shrinks it (finished beams
    dropped): every cache takes ``B' = len(indices)`` rows, each a copy of the old row."""
    cache = _filled(kind)
    k, _ = kind.kv(5)
    cache.reorder(torch.tensor(order))
    assert cache.lengths.tolist() == [5] * len(order)
    k1, v1 = kind.kv(2, seed=3, batch=len(order))
    S = cache.slots(2)
    read = cache.update(k1, v1)  # the new batch decodes on
    assert read.keys.shape[:3] == (len(order), HKV, S)
    for row, old in enumerate(order):
        stored = _stored(read, row)
        for p in range(5):
            if p in stored:
                torch.testing.assert_close(stored[p], k[old, :, p], rtol=0, atol=0)
        torch.testing.assert_close(stored[6], k1[row, :, 1], rtol=0, atol=0)


# ---------------------------------------------------------------------------- reset
@every_kind
def test_reset_forgets_every_token(kind):
    cache = _filled(kind, [5, 2] if kind.per_row else None)
    cache.reset()
    assert cache.length == 0 and not cache.lengths.any()
    read = cache.update(*kind.kv(2, seed=4))
    assert read.query_positions.reshape(-1, 2)[:, 0].unique().tolist() == [0]
    assert cache.lengths.tolist() == [2, 2]


# ---------------------------------------------------------------------------- backpropagation
@every_kind
@pytest.mark.parametrize("Hq", [HKV, 2 * HKV], ids=["mha", "gqa"])
def test_backpropagation_through_cached_steps_equals_the_full_attention(kind, Hq):
    """Gradients of q, k, v through a prefill and steps equal those of the full causal attention
    (the static cache used to fail with PyTorch's "modified by an inplace operation"). With
    ``Hq == Hkv`` an attention may save the cache's own tensors for its backward."""
    L = 9
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, Hq, L, D, generator=g, dtype=DT, requires_grad=True)
    k = torch.randn(B, HKV, L, D, generator=g, dtype=DT, requires_grad=True)
    v_own = torch.randn(B, HKV, L, DV, generator=g, dtype=DT, requires_grad=True)
    v = k[..., :DV] if kind.values_in_keys else v_own
    cache, mask, outs = kind.make(), kind.mask(), []
    for t0, t1 in [(0, 4), (4, 5), (5, 7), (7, 8), (8, 9)]:
        read = cache.update(k[:, :, t0:t1], v[:, :, t0:t1])
        call = read.mask(mask, causal=True, heads=Hq)
        outs.append(mh.attention(q[:, :, t0:t1], read.keys, read.values, mask=call))
    full_mask = mh.causal() if mask is None else mask & mh.causal()
    inputs = [q, k] if kind.values_in_keys else [q, k, v_own]
    grads = torch.autograd.grad(torch.cat(outs, 2).square().sum(), inputs)
    want = torch.autograd.grad(mh.attention(q, k, v, mask=full_mask).square().sum(), inputs)
    for name, got, expected in zip("qkv", grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


@every_kind
def test_a_cache_used_under_autograd_takes_no_grad_steps_and_a_new_sequence_after_reset(kind):
    """After steps recorded by autograd, a ``no_grad`` step must not write into what they saved,
    and a reset lets go of the graph (the next sequence is not attached to it)."""
    k = torch.randn(B, HKV, 6, D, dtype=DT, requires_grad=True)
    v = k[..., :DV] if kind.values_in_keys else torch.randn(B, HKV, 6, DV, dtype=DT, requires_grad=True)
    cache = kind.make()
    first = cache.update(k[:, :, :4], v[:, :, :4])
    loss = first.keys.square().sum()
    with torch.no_grad():
        cache.update(*kind.kv(1, seed=1))
    (dk,) = torch.autograd.grad(loss, [k])  # what the first read saved was not written into
    assert torch.equal(dk[:, :, :4], 2 * k.detach()[:, :, :4])
    cache.reset()
    with torch.no_grad():
        read = cache.update(*kind.kv(2, seed=2))
    assert not read.keys.requires_grad


# ---------------------------------------------------------------------------- masks: one rule, part by part
def _layer() -> mh.MultiHeadAttention:
    torch.manual_seed(0)
    return mh.MultiHeadAttention(24, 6, num_kv_heads=3, causal=True, dtype=DT).eval()


def _layer_cache(kind: Kind) -> KVCache:
    """The kind's cache, shaped for :func:`_layer` (Hkv 3, D = Dv = 4)."""
    if kind.values_in_keys:
        pytest.skip("stores MLA rows (v = k[..., :Dv]): the latent layer's tests (tests/layers/test_latent.py)")
    return kind.make(3, 4, 4)


@every_kind
def test_a_combined_mask_reads_its_objects_at_positions_and_its_tensors_over_the_slots(kind):
    """``document(ids) & t``: the ids over the whole sequence, ``t`` over the ``(Lq, S)`` slots of
    each read (``S = cache.slots(Lq)``): decoding equals the forward without a cache with the same
    mask over the whole sequence. A tensor once moved the whole mask to the slots (the ids were
    refused as too long, or read at slots)."""
    layer, cache, L = _layer(), _layer_cache(kind), 10
    x = torch.randn(B, L, 24, generator=torch.Generator().manual_seed(1), dtype=DT)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    g = torch.Generator().manual_seed(2)
    whole = (torch.rand(B, 1, L, L, generator=g) > 0.3) | torch.eye(L, dtype=torch.bool)  # (B, 1, L, L) at positions
    window = kind.mask()
    base = mh.document(ids) if window is None else mh.document(ids) & window
    with torch.no_grad():
        want = layer(x, mask=base & whole)
        outs = []
        for t0, t1 in [(0, 4), (4, 5), (5, 8), (8, 9), (9, 10)]:
            S = cache.slots(t1 - t0)
            read_positions = _slot_positions(cache, t1 - t0)  # (B, S) the position each slot will hold
            over_slots = torch.zeros(B, 1, t1 - t0, S, dtype=torch.bool)
            for b in range(B):
                for j, p in enumerate(read_positions[b].tolist()):
                    if 0 <= p < L:
                        over_slots[b, 0, :, j] = whole[b, 0, t0:t1, p]
            outs.append(layer(x[:, t0:t1], kv_cache=cache, mask=base & over_slots))
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-12, atol=1e-12)


def _slot_positions(cache: KVCache, new: int) -> torch.Tensor:
    """``(B, S)``: the position each slot of the next read holds (-1: empty), asked of a copy."""
    probe = copy.deepcopy(cache)
    k = torch.zeros(B, 3, new, 4, dtype=DT)
    read = probe.update(k, k)
    S = read.keys.shape[2]
    if read.key_positions is None:
        return torch.arange(S).expand(B, S)
    kp = read.key_positions.expand(B, S) if read.key_positions.dim() == 1 else read.key_positions
    return torch.where(kp == EMPTY_POSITION, -1, kp)


@every_kind
@pytest.mark.parametrize("part", ["block_select", "document"])
def test_a_mask_over_fewer_positions_than_the_step_reaches_is_refused_and_changes_nothing(kind, part):
    """A mask object whose own tensors cover the prompt only (a ``block_select`` table, document
    ids) cannot say what a later token sees. Every cache refuses the step the same way, before the
    attention and with the cache as it was; the decode path over a ``QuantizedKVCache``'s blocks
    skips the attention call's check, and ran such a step with the new token's row fully masked."""
    layer, cache, P = _layer(), _layer_cache(kind), 8
    prompt_only = (
        mh.masks.block_select(torch.zeros(1, 1, 2, 1, dtype=torch.long), 4)
        if part == "block_select"
        else mh.document(torch.zeros(B, P, dtype=torch.long))
    )
    window = kind.mask()
    mask = prompt_only if window is None else prompt_only & window
    x = torch.randn(B, P + 1, 24, generator=torch.Generator().manual_seed(3), dtype=DT)
    with torch.no_grad():
        layer(x[:, :P], kv_cache=cache, mask=mask)
        before = everything(cache)
        with pytest.raises(ValueError, match=rf"covers {P} positions, but the cache's new tokens reach position {P}"):
            layer(x[:, P:], kv_cache=cache, mask=mask)
    assert identical(everything(cache), before) and cache.length == P


def test_a_tensor_built_at_positions_is_refused_with_the_slots_it_needs():
    layer, cache = _layer(), DynamicKVCache()
    x = torch.randn(B, 6, 24, dtype=DT)
    with torch.no_grad():
        layer(x[:, :5], kv_cache=cache)
        keys = cache.keys.clone()
        whole = torch.ones(6, 6, dtype=torch.bool)  # over the whole sequence, not the (1, 6) slots
        with pytest.raises(
            ValueError,
            match=re.escape("MultiHeadAttention: with a cache, a tensor in the mask is over the (Lq, S) = (1, 6) slots")
            + r".*hint: build it over cache.slots\(Lq\) columns",
        ):
            layer(x[:, 5:], kv_cache=cache, mask=mh.causal() & whole)
    assert cache.length == 5 and torch.equal(cache.keys, keys)  # refused after the update: rolled back


def test_a_ring_refuses_a_tensor_part_that_could_reach_past_its_window():
    """``sliding_window(w) & t`` fits a ring (the window bounds it); ``causal() | t`` does not: the
    tensor could open any slot, and nothing at positions says how far back."""
    layer, cache = _layer(), SlidingWindowKVCache(3, B, 3, 4, dtype=DT)
    x = torch.randn(B, 6, 24, dtype=DT)
    with torch.no_grad():
        layer(x[:, :5], kv_cache=cache, mask=mh.sliding_window(3))
        t = torch.ones(1, cache.slots(1), dtype=torch.bool)
        layer(x[:, 5:], kv_cache=cache, mask=mh.sliding_window(3) & t)
        before = everything(cache)
        with pytest.raises(
            ValueError,
            match=r"its tensor parts are over the slots, not at positions\) with causal=True lets a query see "
            r"every earlier key \(no window\), but this cache keeps only the window=3 keys",
        ):
            layer(x[:, 5:], kv_cache=cache, mask=mh.sliding_window(3) | t)
    assert identical(everything(cache), before)


# ---------------------------------------------------------------------------- inference mode
@every_kind
def test_a_cache_filled_under_inference_mode_refuses_an_update_outside_it_and_changes_nothing(kind):
    """PyTorch refuses in-place writes to inference tensors outside inference mode, but only at the
    write: a paged cache had claimed its pages by then (leaked from the pool, lengths unchanged),
    others had replaced their undo record or written keys and not values. The update is refused
    first, naming inference mode; under inference mode the cache goes on. (An eviction policy's
    cache writes no buffer in place: it takes the update anywhere.)"""
    with torch.inference_mode():
        cache = _filled(kind)
    before = everything(cache)
    k, v = kind.kv(1, seed=1)
    if kind.name.startswith("policy"):
        with torch.no_grad():
            read = cache.update(k, v)
        assert cache.lengths.tolist() == [6, 6] and _stored(read, 0)[5].equal(k[0, :, 0])
        return
    for outside in (torch.no_grad, torch.enable_grad):
        with (
            outside(),
            pytest.raises(
                RuntimeError,
                match=rf"^{type(cache).__name__}\.update: the cache's buffers were allocated under "
                r"torch.inference_mode\(\).*hint: make every call",
            ),
        ):
            cache.update(k, v)
        assert identical(everything(cache), before)
    with torch.inference_mode():
        read = cache.update(k, v)
    assert cache.lengths.tolist() == [6, 6] and read.query_positions.reshape(-1).unique().tolist() == [5]


@every_kind
def test_writing_into_the_lengths_a_cache_returned_changes_nothing(kind):
    """A static cache returned its own lengths buffer: ``cache.lengths[1] = 2`` (a row "cropped"
    by hand) changed the device lengths behind the host copy eager steps read, and the next step
    wrote and read the wrong slots with no error. ``lengths`` is a copy on every cache."""
    cache = _filled(kind)
    before = everything(cache)
    lengths = cache.lengths
    lengths[1] = 2
    lengths += 1
    assert identical(everything(cache), before) and cache.lengths.tolist() == [5, 5]
