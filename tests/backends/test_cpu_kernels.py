"""multihead's CPU decode kernel (``backends/cpu_decode.c`` through ``backends/cpu_kernels.py``)
against an fp64 computation over the very values it reads (the stored fp32/bf16/fp16 values, the
dequantized int8 ones): it computes in fp32, so its error is fp32's whatever the storage.

Head sizes around the 16-wide vectors and the 64-feature blocks of ``P V``; query rows per KV
head 1 to 33 (the 4-row blocks and their remainders); lengths around the 4-key blocks and the
16-wide softmax; strided views; row masks with fully masked rows; NaN in keys and values no row
sees; pages through a shuffled block table; int8 slots across spans of channel scales; the
build without AVX-512 (the portable vector code); one thread and two.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_relative
from multihead.backends import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel() is None, reason=f"the CPU decode kernel is unavailable: {cpu_kernels.unavailable()}"
)


def _expected(qg, keys, values, scale, G, Lq, blocked, dtype=torch.float64):
    """fp64 ``(out, lse)`` of the folded rows over ``keys``/``values`` (B, Hkv, n, ·); 0 and -inf
    on rows that see nothing. ``dtype=torch.float32``: the same computed plainly in fp32, the
    relative rule's baseline (TESTING.md)."""
    scores = qg.to(dtype) @ keys.to(dtype).transpose(-1, -2) * scale  # (B, Hkv, R, n)
    if blocked is not None:
        B, Hkv, R, n = scores.shape
        full = blocked.expand(B, Hkv, G, Lq, n).reshape(B, Hkv, R, n)
        scores = scores.masked_fill(full, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0) @ values.to(dtype)
    return out, lse


def _close(got, want, what, half_values=None):
    """fp32's tolerance; ``half_values``: the values of a half-precision call (a bf16 or fp16 query),
    whose weights the tile path carries to 16 bits (two bf16 terms, ``cpu_decode_amx.h``): each within
    2^-16 of itself, so the output within 2^-16 of the largest |value| more (2^8 below the rounding of
    a bf16 output of that size)."""
    out, lse = got
    atol = 2e-6 + (0.0 if half_values is None else 2**-16 * half_values.abs().max().item())
    torch.testing.assert_close(out.double(), want[0], rtol=2e-5, atol=atol, msg=lambda m: f"{what}: out: {m}")
    torch.testing.assert_close(lse.double(), want[1], rtol=2e-5, atol=2e-5, msg=lambda m: f"{what}: lse: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D,Dv", [(16, 16), (64, 64), (80, 48), (128, 128), (128, 80)])
@pytest.mark.parametrize("G,Lq", [(1, 1), (3, 1), (4, 1), (5, 1), (4, 2), (8, 4), (33, 1)])
def test_dense_reads_equal_fp64_over_the_stored_values(dtype, D, Dv, G, Lq):
    gen = torch.Generator().manual_seed(D * 100 + G * 10 + Lq)
    B, Hkv = 2, 3
    for n in (1, 4, 17, 301):
        q = torch.randn(B, Hkv, G * Lq, D, generator=gen)
        k = torch.randn(B, Hkv, n, D, generator=gen).to(dtype)
        v = torch.randn(B, Hkv, n, Dv, generator=gen).to(dtype)
        for blocked in (None, torch.rand(B, 1, G, Lq, n, generator=gen) < 0.4):
            if blocked is not None:
                blocked[0, 0, 0] = True  # a row that sees nothing
            got = cpu_kernels.decode_partial(q, k, v, 0.3, G, Lq, blocked)
            _close(got, _expected(q, k, v, 0.3, G, Lq, blocked), f"{dtype} D={D} Dv={Dv} G={G} Lq={Lq} n={n}")


def test_strided_views_and_broadcast_masks():
    """K/V slices of a larger cache (strides of batch, head and token apart), a mask broadcast
    over batch and heads, values that are the first features of the keys (MLA's latent rows)."""
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(3, 4, 500, 96, generator=gen).to(torch.bfloat16)
    k = big[1:3, ::2, 37:250]  # (2, 2, 213, 96)
    v = big[1:3, ::2, 37:250, :64]
    q = torch.randn(2, 2, 4, 96, generator=gen)
    blocked = torch.rand(1, 1, 4, 1, 213, generator=gen) < 0.5
    _close(cpu_kernels.decode_partial(q, k, v, 0.1, 4, 1, blocked), _expected(q, k, v, 0.1, 4, 1, blocked), "views")


@pytest.mark.parametrize("G", [4, 16, 17], ids=lambda g: f"{g} rows")
def test_nan_where_no_row_looks_never_reaches_the_output_and_a_seen_nan_does(G):
    """4 rows: the 4-row blocks; 16 and 17 fp32 rows: sixteen to a vector (``values_t16`` with a
    row mask), the 17th in a 4-row block."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, G, 32, generator=gen)
    k = torch.randn(1, 2, 40, 32, generator=gen)
    v = torch.randn(1, 2, 40, 32, generator=gen)
    blocked = torch.zeros(1, 1, G, 1, 40, dtype=torch.bool)
    blocked[..., 7] = True  # no row sees slot 7
    blocked[:, :, 1, :, 20] = True  # row 1 does not see slot 20
    k[:, :, 7] = float("nan")
    v[:, :, 7] = float("nan")
    v[:, :, 20] = float("inf")
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[:, :, 7], clean_v[:, :, 7], clean_v[:, :, 20] = 0.0, 0.0, 0.0
    out, lse = cpu_kernels.decode_partial(q, k, v, 0.2, G, 1, blocked)
    want_out, want_lse = _expected(q, clean_k, clean_v, 0.2, G, 1, blocked)
    assert torch.isfinite(out[:, :, 1]).all(), "a row that does not see the inf value took it"
    torch.testing.assert_close(out[:, :, 1].double(), want_out[:, :, 1], rtol=2e-5, atol=2e-6)
    others = [r for r in range(G) if r != 1]
    assert not torch.isfinite(out[:, :, others]).all(dim=-1).any(), "rows that see the inf value must show it"
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_pages_through_a_shuffled_block_table_equal_the_gathered_read(dtype, page_size):
    gen = torch.Generator().manual_seed(page_size)
    B, Hkv, D, pages = 3, 2, 64, 40
    pool_k = torch.randn(Hkv, pages, page_size, D, generator=gen).to(dtype)
    pool_v = torch.randn(Hkv, pages, page_size, D, generator=gen).to(dtype)
    width = pages // B
    table = torch.randperm(pages, generator=gen)[: B * width].view(B, width)
    keys = pool_k[:, table.reshape(-1)].view(Hkv, B, width * page_size, D).transpose(0, 1)  # gathered
    values = pool_v[:, table.reshape(-1)].view(Hkv, B, width * page_size, D).transpose(0, 1)
    q = torch.randn(B, Hkv, 4, D, generator=gen)
    S = width * page_size
    for lo, hi in ((0, S), (page_size + 1, S - 2), (S - 1, S)):
        blocked = torch.rand(B, 1, 4, 1, hi - lo, generator=gen) < 0.2
        got = cpu_kernels.decode_partial(q, pool_k, pool_v, 0.125, 4, 1, blocked, table, lo, hi - lo)
        want = _expected(q, keys[:, :, lo:hi], values[:, :, lo:hi], 0.125, 4, 1, blocked)
        _close(got, want, f"pages of {page_size}, slots [{lo}, {hi})")


FP8 = [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []


def _eight_bit(storage, shape, gen):
    """Random 8-bit slots: int8 codes, or fp8 e4m3 bytes (every finite one, subnormals included)."""
    if storage == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int16).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # NaN bytes: tested on their own below
    return codes.view(storage)


def _scaled_slots(storage, B, Hkv, N, D, Dv, span, scale_dtype, gen):
    """Random 8-bit keys and values with their scales (``kc`` per channel per span of ``span`` slots,
    ``kt``, ``vt`` per slot) and the fp64 values they stand for: ``(k8, v8, kc, kt, vt, keys, values)``."""
    k8, v8 = _eight_bit(storage, (B, Hkv, N, D), gen), _eight_bit(storage, (B, Hkv, N, Dv), gen)
    kc = (torch.rand(B, Hkv, -(-N // span), D, generator=gen) + 0.1).to(scale_dtype)
    kt = (torch.rand(B, Hkv, N, generator=gen) / 100).to(scale_dtype)
    vt = (torch.rand(B, Hkv, N, generator=gen) / 100).to(scale_dtype)
    keys = k8.double() * kc.double()[:, :, torch.arange(N) // span] * kt.double()[..., None]
    return k8, v8, kc, kt, vt, keys, v8.double() * vt.double()[..., None]


@pytest.mark.parametrize("storage", [torch.int8, *FP8], ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_int8_slots_with_channel_scales_per_span_equal_fp64_over_their_dequantized_values(scale_dtype, storage):
    gen = torch.Generator().manual_seed(3)
    B, Hkv, N, D, span = 2, 2, 200, 64, 32
    k8, v8, kc, kt, vt, keys, values = _scaled_slots(storage, B, Hkv, N, D, D, span, scale_dtype, gen)
    q = torch.randn(B, Hkv, 4, D, generator=gen)
    for first, n in ((0, N), (31, 70), (64, 1), (5, 195)):
        scales = cpu_kernels.Int8Scales(kc, kt, vt, first, span)
        blocked = torch.rand(B, 1, 4, 1, n, generator=gen) < 0.3
        got = cpu_kernels.decode_partial(
            q, k8[:, :, first : first + n], v8[:, :, first : first + n], 0.2, 4, 1, blocked, scales=scales
        )
        want = _expected(q, keys[:, :, first : first + n], values[:, :, first : first + n], 0.2, 4, 1, blocked)
        _close(got, want, f"{storage} slots [{first}, {first + n})")


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.int8, *FP8], ids=str)
@pytest.mark.parametrize("G", [1, 4, 5, 16])
def test_the_fma_path_reads_long_calls_in_blocks_with_an_online_softmax(storage, G):
    """The FMA path reads a call in blocks of slots (``superblock``: 1 MiB of rows, MLA's 256 slots in
    fp32), each block's scores, softmax and ``P V`` before the next, the running max and sum carried
    over. Built with 256-slot blocks (``-DSB_BYTES=1``) and without the tiles, against fp64: lengths
    around the blocks; scores that grow along the slots (every block raises the max) and a row whose
    one visible slot lies in the last block; a row that sees nothing; NaN in a key and a value no row
    sees in a later block, and a NaN score one row sees there; 8-bit spans across the blocks; pages."""
    lib = cpu_kernels.build((*cpu_kernels.FLAGS, "-DMH_NO_AMX", "-DSB_BYTES=1"))
    gen = torch.Generator().manual_seed(G * 7 + len(str(storage)))
    B, Hkv, D, Dv, span = 1, 2, 64, 48, 100
    for n in (255, 256, 257, 700, 1100):
        if storage in (torch.int8, *FP8):
            k, v, kc, kt, vt, keys, values = _scaled_slots(storage, B, Hkv, n, D, Dv, span, torch.float32, gen)
            scales = cpu_kernels.Int8Scales(kc, kt, vt, 0, span)
        else:
            ramp = torch.linspace(0.2, 3.0, n)[:, None]  # later slots score higher: the max moves block by block
            k = (torch.randn(B, Hkv, n, D, generator=gen) * ramp).to(storage)
            v = torch.randn(B, Hkv, n, Dv, generator=gen).to(storage)
            keys, values, scales = k.double(), v.double(), None
        q = torch.randn(B, Hkv, G, D, generator=gen)
        blocked = torch.rand(1, 1, G, 1, n, generator=gen) < 0.3
        blocked[..., 0, :, :] = True  # row 0 sees one slot, in the last block
        blocked[..., 0, :, n - 2] = False
        if G > 1:
            blocked[..., 1, :, :] = True  # row 1 sees nothing
        blocked[..., n - 5] = True  # no row sees slot n - 5: NaN there never reaches the output
        if scales is None:
            k[:, :, n - 5], v[:, :, n - 5] = float("nan"), float("nan")
        got = cpu_kernels._call(lib, q, [cpu_kernels.Segment(k, v, blocked, scales=scales)], 0.2, G, 1, 2)
        clean_k, clean_v = keys.clone(), values.clone()
        clean_k[:, :, n - 5], clean_v[:, :, n - 5] = 0.0, 0.0
        want = _expected(q, clean_k, clean_v, 0.2, G, 1, blocked)
        _close(got, want, f"{storage} G={G} n={n}")
        if G > 1:
            assert (got[0][:, :, 1] == 0).all() and (got[1][:, :, 1] == float("-inf")).all(), "a row that sees nothing"
    if storage == torch.float32:  # a NaN score one row sees, in a later block: that row is NaN, the others not
        k[:, :, 600, 0] = float("nan")
        blocked[..., 600] = True
        blocked[..., G - 1, :, 600] = False
        out, lse = cpu_kernels._call(lib, q, [cpu_kernels.Segment(k, v, blocked)], 0.2, G, 1, 2)
        assert out[:, :, G - 1].isnan().all() and lse[:, :, G - 1].isnan().all()
        assert not out[:, :, : G - 1].isnan().any()
    pages, ps = 12, 100  # 1100 slots of a shuffled block table, blocks of 256 across pages
    pool_k = torch.randn(Hkv, pages, ps, D, generator=gen).to(storage if scales is None else torch.float32)
    pool_v = torch.randn(Hkv, pages, ps, Dv, generator=gen).to(pool_k.dtype)
    table = torch.randperm(pages, generator=gen)[None, :11]
    gathered_k = pool_k[:, table[0]].reshape(Hkv, 1100, D)[None]
    gathered_v = pool_v[:, table[0]].reshape(Hkv, 1100, Dv)[None]
    got = cpu_kernels._call(lib, q, [cpu_kernels.Segment(pool_k, pool_v, None, table, 3, 1090)], 0.2, G, 1, 2)
    _close(got, _expected(q, gathered_k[:, :, 3:1093], gathered_v[:, :, 3:1093], 0.2, G, 1, None), "pages")


@pytest.mark.parametrize("R", [16, 17, 32, 33])
@pytest.mark.parametrize("D,Dv", [(16, 16), (80, 48), (576, 512)])
@pytest.mark.parametrize("page_size", [None, 3, 16, 17])
def test_many_fp32_rows_sixteen_to_a_vector_equal_fp64(R, D, Dv, page_size):
    """fp32 keys with 16 query rows and more (MLA, MQA): each group of 16 rows runs as the lanes of a
    vector (``scores_t16``: a key's feature broadcast, features in blocks of 32; ``values_t16``: a
    value's feature broadcast against 16 weights where every row sees every slot), the rows past the
    last 16 in the 4-row blocks. Built with 256-slot blocks (``-DSB_BYTES=1``) and without the
    tiles, against fp64: lengths around 16 keys (a last group of fewer, its missing keys not
    stored), a max that grows along the slots, keys that lie at one stride and keys that pages break
    (pages of 3 and 17 break every group), masked and unmasked rows, a row that sees nothing."""
    lib = cpu_kernels.build((*cpu_kernels.FLAGS, "-DMH_NO_AMX", "-DSB_BYTES=1"))
    gen = torch.Generator().manual_seed(R * 1000 + D + (page_size or 0))
    B, Hkv = 1, 2
    for n in (15, 16, 17, 47, 300):
        ramp = torch.linspace(0.2, 2.0, n)[:, None]
        keys = torch.randn(B, Hkv, n, D, generator=gen) * ramp
        values = torch.randn(B, Hkv, n, Dv, generator=gen)
        q = torch.randn(B, Hkv, R, D, generator=gen)
        if page_size is None:
            k, v, table, lo = keys, values, None, 0
        else:
            pages = -(-(n + 1) // page_size)
            order = torch.randperm(pages, generator=gen)
            pool_k = torch.randn(Hkv, pages, page_size, D, generator=gen)
            pool_v = torch.randn(Hkv, pages, page_size, Dv, generator=gen)
            flat_k = pool_k.view(Hkv, pages * page_size, D)
            flat_v = pool_v.view(Hkv, pages * page_size, Dv)
            slots = (order[:, None] * page_size + torch.arange(page_size)).reshape(-1)[1 : n + 1]  # from slot 1
            flat_k[:, slots], flat_v[:, slots] = keys[0], values[0]
            k, v, table, lo = pool_k, pool_v, order[None], 1
        for blocked in (None, torch.rand(B, 1, R, 1, n, generator=gen) < 0.3):
            if blocked is not None:
                blocked[..., 1, :, :] = True  # a row that sees nothing
            seg = cpu_kernels.Segment(k, v, blocked, table, lo, n if table is not None else None)
            out, lse = cpu_kernels._call(lib, q, [seg], 0.1, R, 1, 2)
            want = _expected(q, keys, values, 0.1, R, 1, blocked)
            naive = _expected(q, keys, values, 0.1, R, 1, blocked, torch.float32)
            what = f"R={R} D={D} n={n} pages={page_size} masked={blocked is not None}"
            # scores of 576 features reach |s| ~ 5 here, where a fixed 2e-6 is below fp32's own error (a
            # plain fp32 computation misses by up to 4.7e-6): the relative rule, with a factor of 4 where
            # it allows about 10 for fp32 (the worst measured: 1.8)
            assert_relative(out, want[0], naive[0], 4, f"{what}: out")
            torch.testing.assert_close(lse.double(), want[1], rtol=2e-5, atol=2e-5, msg=lambda m: f"{what}: lse: {m}")


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
@pytest.mark.skipif(not FP8, reason="this torch has no float8_e4m3fn")
def test_every_fp8_byte_reads_as_torch_converts_it(portable):
    """One slot whose 256 value features are the 256 bytes of e4m3fn: the output of a row that
    sees only it is the slot's value, which must be each byte's value exactly (subnormals, -0,
    448, and NaN for S.1111.111), in the AVX-512 build and the portable one."""
    lib = cpu_kernels.kernel() if not portable else _portable_build()
    values = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).view(1, 1, 1, 256)
    keys = torch.zeros(1, 1, 1, 16, dtype=torch.float8_e4m3fn)
    ones = torch.ones(1, 1, 1)
    scales = cpu_kernels.Int8Scales(torch.ones(1, 1, 1, 16), ones, ones, 0, 64)
    out, _ = cpu_kernels._call(
        lib, torch.randn(1, 1, 1, 16), [cpu_kernels.Segment(keys, values, None, scales=scales)], 1.0, 1, 1, 1
    )
    torch.testing.assert_close(out.view(256).double(), values.view(256).double(), rtol=0, atol=0, equal_nan=True)


def _portable_build():
    try:
        return cpu_kernels.build((*cpu_kernels.FLAGS, "-mno-avx512f"))
    except RuntimeError as error:  # a compiler that does not take the flag (not x86-64)
        pytest.skip(str(error))


def test_the_portable_build_without_avx512_gives_the_same_answers():
    """``cpu_decode.c`` also builds its plain vector code (for CPUs without AVX-512): built here
    with AVX-512 off, it must agree with the fp64 computation too."""
    lib = _portable_build()
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, *FP8):
        q = torch.randn(2, 2, 5, 48, generator=gen)
        if dtype in (torch.int8, *FP8):
            k, v = _eight_bit(dtype, (2, 2, 77, 48), gen), _eight_bit(dtype, (2, 2, 77, 32), gen)
            kc, kt, vt = torch.rand(2, 2, 1, 48, generator=gen), torch.rand(2, 2, 77) / 99, torch.rand(2, 2, 77) / 99
            scales = cpu_kernels.Int8Scales(kc, kt, vt, 0, 1 << 20)
            keys, values = k.double() * kc.double() * kt.double()[..., None], v.double() * vt.double()[..., None]
        else:
            k = torch.randn(2, 2, 77, 48, generator=gen).to(dtype)
            v = torch.randn(2, 2, 77, 32, generator=gen).to(dtype)
            scales, keys, values = None, k, v
        blocked = torch.rand(2, 1, 5, 1, 77, generator=gen) < 0.3
        got = cpu_kernels._call(lib, q, [cpu_kernels.Segment(k, v, blocked, scales=scales)], 0.25, 5, 1, 2)
        _close(got, _expected(q, keys, values, 0.25, 5, 1, blocked), f"portable build, {dtype}")


def test_one_thread_and_two_give_the_same_bits():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 4, 64, generator=gen)
    k, v = torch.randn(2, 4, 999, 64, generator=gen), torch.randn(2, 4, 999, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.decode_partial(q, k, v, 0.1, 4, 1)
        torch.set_num_threads(2)
        two = cpu_kernels.decode_partial(q, k, v, 0.1, 4, 1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def _on_one_thread_and_two(call, masks):
    """``call(mask)`` for each mask on one thread, then on two: ``[one thread's results..., two's...]``."""
    threads = torch.get_num_threads()
    runs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            runs += [call(mask) for mask in masks]
    finally:
        torch.set_num_threads(threads)
    return runs


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.int8, *FP8], ids=str)
def test_few_pairs_split_their_slots_into_pieces_joined_by_lse(storage):
    """A call of fewer than four (batch row, KV head) pairs (MQA, MLA's one latent head) is split
    into pieces of slots (``SPLIT_PAIRS``, ``PIECE_MIN`` in ``cpu_decode.c``) whose partials are joined
    by their LSE: against fp64 at lengths around the pieces' bounds, with a mask (rows that see
    nothing in one piece, in every piece), int8/fp8 scale spans across the pieces, and the same
    bits on one thread and two (the split follows the shape, not the threads)."""
    gen = torch.Generator().manual_seed(6)
    for B, Hkv, n in ((1, 1, 2048), (1, 1, 5001), (1, 2, 4097), (3, 1, 3000)):
        G, D, Dv = 16, 64, 48
        q = torch.randn(B, Hkv, G, D, generator=gen)
        if storage in (torch.int8, *FP8):
            k, v = _eight_bit(storage, (B, Hkv, n + 7, D), gen), _eight_bit(storage, (B, Hkv, n + 7, Dv), gen)
            kc = torch.rand(B, Hkv, -(-(n + 7) // 1000), D, generator=gen) + 0.5
            kt, vt = torch.rand(B, Hkv, n + 7, generator=gen) / 99, torch.rand(B, Hkv, n + 7, generator=gen) / 99
            scales = cpu_kernels.Int8Scales(kc, kt, vt, 7, 1000)
            spans = torch.arange(n + 7) // 1000
            keys = (k.double() * kc.double()[:, :, spans] * kt.double()[..., None])[:, :, 7:]
            values = (v.double() * vt.double()[..., None])[:, :, 7:]
            k, v = k[:, :, 7:], v[:, :, 7:]
        else:
            k = torch.randn(B, Hkv, n, D, generator=gen).to(storage)
            v = torch.randn(B, Hkv, n, Dv, generator=gen).to(storage)
            scales, keys, values = None, k, v
        blocked = torch.rand(B, 1, G, 1, n, generator=gen) < 0.3
        blocked[0, 0, 1, 0, : n // 2] = True  # sees nothing in the first pieces
        blocked[0, 0, 2] = True  # sees nothing at all
        runs = _on_one_thread_and_two(
            lambda mask, q=q, k=k, v=v, scales=scales: cpu_kernels.decode_partial(
                q, k, v, 0.125, G, 1, mask, scales=scales
            ),
            (None, blocked),
        )
        for at, mask in enumerate((None, blocked)):
            _close(runs[at], _expected(q, keys, values, 0.125, G, 1, mask), f"{storage} B={B} Hkv={Hkv} n={n}")
            assert torch.equal(runs[at][0], runs[at + 2][0]) and torch.equal(runs[at][1], runs[at + 2][1])


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("storage", [torch.int8, *FP8], ids=str)
@pytest.mark.parametrize("B,Hkv,G", [(1, 8, 4), (2, 1, 16), (1, 1, 17), (1, 2, 1)])
def test_joined_segments_equal_fp64_over_every_slot_they_hold(compute, storage, B, Hkv, G):
    """``decode_joined``: a quantized cache's read in one call: full-precision sinks, 8-bit slots
    with their scales (long enough to be split into pieces for few pairs), a full-precision window
    (a strided view of a larger buffer), joined by LSE inside the kernel. Against fp64 over the
    concatenated values, with and without a row mask (a row that sees nothing in the 8-bit slots,
    one that sees nothing at all), on the FMA path and the tiles alike (4 and 17 rows per KV head);
    the same bits on one thread and two; segments of one slot; one segment alone equals
    ``decode_partial``."""
    gen = torch.Generator().manual_seed(B * 100 + Hkv * 10 + G)
    D, Dv, span = 64, 32, 1000
    for sinks, n8, window in ((4, 2500, 70), (1, 1, 1), (0, 3000, 9), (3, 0, 65)):
        q = torch.randn(B, Hkv, G, D, generator=gen)
        sink_k = torch.randn(B, Hkv, sinks, D, generator=gen).to(compute)
        sink_v = torch.randn(B, Hkv, sinks, Dv, generator=gen).to(compute)
        k8, v8, kc, kt, vt, keys8, values8 = _scaled_slots(storage, B, Hkv, n8 + 5, D, Dv, span, torch.float32, gen)
        tail_k = torch.randn(B, Hkv, window + 3, D, generator=gen).to(compute)[:, :, 3:]  # a view into a buffer
        tail_v = torch.randn(B, Hkv, window + 3, Dv, generator=gen).to(compute)[:, :, 3:]
        n = sinks + n8 + window
        blocked = torch.rand(B, 1, G, 1, n, generator=gen) < 0.3
        blocked[0, 0, 0, 0, sinks : sinks + n8] = True  # sees nothing of the 8-bit slots
        blocked[-1, 0, -1] = True  # sees nothing at all
        keys = torch.cat([sink_k.double(), keys8[:, :, 5:], tail_k.double()], 2)
        values = torch.cat([sink_v.double(), values8[:, :, 5:], tail_v.double()], 2)
        scales = cpu_kernels.Int8Scales(kc, kt, vt, 5, span)

        def segments(mask, sinks=sinks, n8=n8, window=window, scales=scales, k8=k8, v8=v8):
            cut = (lambda a, b: None) if mask is None else (lambda a, b: mask[..., a:b])
            parts = [
                cpu_kernels.Segment(sink_k, sink_v, cut(0, sinks)),
                cpu_kernels.Segment(k8[:, :, 5:], v8[:, :, 5:], cut(sinks, sinks + n8), scales=scales),
                cpu_kernels.Segment(tail_k, tail_v, cut(sinks + n8, n)),
            ]
            return [part for part in parts if part.keys.shape[2]]

        runs = _on_one_thread_and_two(
            lambda mask, q=q, segments=segments: cpu_kernels.decode_joined(q.to(compute), segments(mask), 0.125, G, 1),
            (None, blocked),
        )
        for at, mask in enumerate((None, blocked)):
            want = _expected(q.to(compute), keys, values, 0.125, G, 1, mask)
            _close(runs[at], want, f"{storage} {compute} B={B} Hkv={Hkv} G={G} slots {sinks}+{n8}+{window}")
            assert torch.equal(runs[at][0], runs[at + 2][0]) and torch.equal(runs[at][1], runs[at + 2][1])
    alone = cpu_kernels.decode_joined(q.to(compute), [cpu_kernels.Segment(tail_k, tail_v)], 0.125, G, 1)
    partial = cpu_kernels.decode_partial(q.to(compute), tail_k, tail_v, 0.125, G, 1)
    assert torch.equal(alone[0], partial[0]) and torch.equal(alone[1], partial[1])


TILES = cpu_kernels.tiles(torch.bfloat16, 16, 64, 64, False)
needs_tiles = pytest.mark.skipif(not TILES, reason="this CPU (or its OS) gives no AMX-BF16 tiles")


def _no_tiles_build():
    return cpu_kernels.build((*cpu_kernels.FLAGS, "-DMH_NO_AMX"))


@needs_tiles
@pytest.mark.parametrize("R", [8, 16, 17, 33])
@pytest.mark.parametrize("D,Dv", [(32, 32), (64, 96), (576, 512)])
def test_many_bf16_rows_on_the_tiles_equal_fp64(R, D, Dv):
    """The AMX path (``cpu_decode_amx.h``: at least 8 rows of bf16, head sizes multiples of 32, no
    mask) against fp64 with the fp32 tolerance of the FMA path: lengths around its 16-slot groups,
    32-slot blocks and 64-slot chunks, and past a split into pieces; a bf16 query (one tile term, the
    weights in two: a half-precision call, ``_close``) and an fp32 one (three each, fp32's
    tolerance); and the FMA build (``-DMH_NO_AMX``) on the same calls."""
    assert cpu_kernels.tiles(torch.bfloat16, R, D, Dv, False)
    gen = torch.Generator().manual_seed(R * 1000 + D)
    fma = _no_tiles_build()
    for n in (1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129, 2049):
        k = torch.randn(1, 2, n, D, generator=gen).bfloat16()
        v = torch.randn(1, 2, n, Dv, generator=gen).bfloat16()
        for q in (torch.randn(1, 2, R, D, generator=gen).bfloat16(), torch.randn(1, 2, R, D, generator=gen)):
            want = _expected(q, k, v, D**-0.5, R, 1, None)
            half = v if q.dtype == torch.bfloat16 else None
            _close(cpu_kernels.decode_partial(q, k, v, D**-0.5, R, 1), want, f"tiles R={R} D={D} n={n} {q.dtype}", half)
            _close(cpu_kernels._call(fma, q, [cpu_kernels.Segment(k, v, None)], D**-0.5, R, 1, 2), want, "FMA build")


@needs_tiles
@pytest.mark.parametrize("page_size", [1, 3, 16, 17, 64, 100])
def test_the_tiles_read_pages_and_strided_rows(page_size):
    """Rows evenly spaced are loaded as tiles in place, others (pages shorter than a 16-slot group,
    a group across pages) staged first: a shuffled block table of each page size, and MLA's latent
    rows (values the first features of the keys, a slice of a larger cache) read in place."""
    gen = torch.Generator().manual_seed(page_size)
    B, Hkv, D, Dv, pages, R = 2, 1, 64, 32, 30, 16
    pool = torch.randn(Hkv, pages, page_size, D, generator=gen).bfloat16()
    width = pages // B
    table = torch.randperm(pages, generator=gen)[: B * width].view(B, width)
    rows = pool[:, table.reshape(-1)].view(Hkv, B, width * page_size, D).transpose(0, 1)  # gathered
    q = torch.randn(B, Hkv, R, D, generator=gen).bfloat16()
    S = width * page_size
    for lo, hi in ((0, S), (page_size + 1, S - 2), (S - 1, S)):
        got = cpu_kernels.decode_partial(q, pool, pool[..., :Dv], 0.125, R, 1, None, table, lo, hi - lo)
        want = _expected(q, rows[:, :, lo:hi], rows[:, :, lo:hi, :Dv], 0.125, R, 1, None)
        _close(got, want, f"pages of {page_size}, slots [{lo}, {hi})")
    big = torch.randn(2, 3, 300, 2 * D, generator=gen).bfloat16()
    latent = big[:, 1:2, 21:270, 5 : 5 + D]  # strides of a larger cache; values its first Dv features
    got = cpu_kernels.decode_partial(q, latent, latent[..., :Dv], 0.125, R, 1)
    _close(got, _expected(q, latent, latent[..., :Dv], 0.125, R, 1, None), "latent rows in place")


@needs_tiles
def test_the_tiles_keep_nan_rows_nan_and_large_scores_stable():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 16, 64, generator=gen).bfloat16()
    k = torch.randn(1, 2, 200, 64, generator=gen).bfloat16()
    v = torch.randn(1, 2, 200, 64, generator=gen).bfloat16()
    k[0, 1, 150, 3] = float("nan")  # every row of head 1 sees it
    out, lse = cpu_kernels.decode_partial(q, k, v, 0.125, 16, 1)
    assert out[0, 1].isnan().all() and lse[0, 1].isnan().all()
    _close((out[:, :1], lse[:, :1]), _expected(q[:, :1], k[:, :1], v[:, :1], 0.125, 16, 1, None), "head 0")
    # scores in the thousands (the running max moves chunk after chunk): finite, and within what fp32
    # scores allow (a score of 2000 is rounded by 1e-4, so is its weight), as the FMA build
    q, k, v = q[:, :1] * 64, k[:, :1], v[:, :1]
    want = _expected(q, k, v, 1.0, 16, 1, None)
    fma = cpu_kernels._call(_no_tiles_build(), q, [cpu_kernels.Segment(k, v)], 1.0, 16, 1, 2)
    for got in (cpu_kernels.decode_partial(q, k, v, 1.0, 16, 1), fma):
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
        torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=1e-3)
        torch.testing.assert_close(got[1].double(), want[1], rtol=1e-6, atol=0)


@needs_tiles
@pytest.mark.parametrize("G,Lq", [(4, 4), (16, 2), (8, 3), (2, 9)])
def test_the_tiles_read_bands_of_slots_per_row(G, Lq):
    """A row mask that is one range of slots per row (a causal multi-token step, a window, both),
    the same for every batch row and head, runs on the tiles as bands (``bands``); one with a hole,
    or a slot no row sees, stays on the FMA path. Against fp64 either way, lengths around the chunks
    and past a split into pieces."""
    gen = torch.Generator().manual_seed(G * 10 + Lq)
    for n in (Lq, 17, 64, 65, 130, 2100):
        q = torch.randn(2, 1, G * Lq, 64, generator=gen).bfloat16()
        k = torch.randn(2, 1, n, 64, generator=gen).bfloat16()
        v = torch.randn(2, 1, n, 32, generator=gen).bfloat16()
        i = torch.arange(Lq)[:, None]
        t = torch.arange(n)[None, :]
        causal = t > (n - Lq) + i  # bottom-right: query i sees slots up to n - Lq + i
        window = causal | (t < (n - Lq) + i - 40)  # and only the 41 latest
        holes = causal.clone()
        holes[0, n // 2] = holes[0, n // 2] or n > 2 * Lq  # row 0 loses a slot in the middle of its range
        cases = (("causal", causal, True), ("window", window, n - Lq <= 40), ("holes", holes, n <= 2 * Lq))
        for name, rule, banded in cases:  # banded: every row one range, every slot seen by some row
            blocked = rule.expand(1, 1, G, Lq, n)
            assert (cpu_kernels.bands(blocked, G, Lq, n) is not None) == banded, name
            got = cpu_kernels.decode_partial(q, k, v, 0.125, G, Lq, blocked)
            _close(got, _expected(q, k, v, 0.125, G, Lq, blocked), f"{name} G={G} Lq={Lq} n={n}", v)


@needs_tiles
@pytest.mark.parametrize("storage", [torch.int8, *FP8], ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("R,span", [(16, 32), (17, 100), (33, 4096)])
def test_eight_bit_slots_on_the_tiles_equal_fp64_over_their_dequantized_values(storage, scale_dtype, R, span):
    """int8 / fp8 slots with 16 or more rows per KV head run on the tiles, converted to bf16 as read
    (exactly), ``kc`` folded into the query per span (spans shorter and longer than a 64-slot chunk,
    slots starting inside a span), ``kt`` and ``vt`` per slot; against fp64 over the dequantized
    values and through the FMA build, past a split into pieces, and with a causal band."""
    gen = torch.Generator().manual_seed(R + span)
    B, Hkv, N, D, Dv = 1, 2, 2300, 64, 32
    k8, v8, kc, kt, vt, keys, values = _scaled_slots(storage, B, Hkv, N, D, Dv, span, scale_dtype, gen)
    q = torch.randn(B, Hkv, R, D, generator=gen)
    fma = _no_tiles_build()
    assert cpu_kernels.tiles(storage, R, D, Dv, False)
    for first, n in ((0, N), (31, 70), (5, 2100), (64, 1)):
        scales = cpu_kernels.Int8Scales(kc, kt, vt, first, span)
        k, v = k8[:, :, first : first + n], v8[:, :, first : first + n]
        want = _expected(q, keys[:, :, first : first + n], values[:, :, first : first + n], 0.2, R, 1, None)
        _close(cpu_kernels.decode_partial(q, k, v, 0.2, R, 1, scales=scales), want, f"{storage} [{first}, {first + n})")
        _close(
            cpu_kernels._call(fma, q, [cpu_kernels.Segment(k, v, None, scales=scales)], 0.2, R, 1, 2), want, "FMA build"
        )
    G, Lq, n = R, 1, 500  # a band per row: row r sees slots [r, n)
    blocked = (torch.arange(n)[None, :] < torch.arange(R)[:, None]).view(1, 1, R, 1, n)
    scales = cpu_kernels.Int8Scales(kc, kt, vt, 0, span)
    want = _expected(q, keys[:, :, :n], values[:, :, :n], 0.2, G, Lq, blocked)
    _close(cpu_kernels.decode_partial(q, k8[:, :, :n], v8[:, :, :n], 0.2, G, Lq, blocked, scales=scales), want, "band")
    qh = q.bfloat16()  # a half-precision call: the weights in two bf16 terms, within _close's bound for it
    scales = cpu_kernels.Int8Scales(kc, kt, vt, 5, span)
    want = _expected(qh, keys[:, :, 5:2105], values[:, :, 5:2105], 0.2, R, 1, None)
    got = cpu_kernels.decode_partial(qh, k8[:, :, 5:2105], v8[:, :, 5:2105], 0.2, R, 1, scales=scales)
    _close(got, want, f"{storage} bf16 query", values[:, :, 5:2105])


def test_the_tiles_take_only_many_unmasked_bf16_rows():
    """What runs on the tiles: the kernel answers (``tiles``); never a masked call, another storage,
    fewer than 8 rows or head sizes off the 32-feature tile columns."""
    assert not cpu_kernels.tiles(torch.bfloat16, 16, 64, 64, True), "a mask"
    assert not cpu_kernels.tiles(torch.float32, 16, 64, 64, False), "fp32"
    assert not cpu_kernels.tiles(torch.int8, 8, 64, 64, False), "int8 with 8 rows (8-bit slots take 16)"
    assert cpu_kernels.tiles(torch.int8, 16, 64, 64, False), "int8 with 16 rows"
    assert not cpu_kernels.tiles(torch.bfloat16, 7, 64, 64, False), "7 rows"
    assert not cpu_kernels.tiles(torch.bfloat16, 16, 48, 64, False), "D = 48"
    assert not cpu_kernels.tiles(torch.bfloat16, 16, 64, 48, False), "Dv = 48"
    assert not cpu_kernels.tiles(torch.bfloat16, 16, 64, 64, False, lib=_no_tiles_build()), "built without them"


def test_supports_refuses_what_the_kernel_does_not_take():
    q, k = torch.randn(1, 1, 4, 64), torch.randn(1, 1, 10, 64)
    assert cpu_kernels.supports(q, k, k)
    assert not cpu_kernels.supports(q.double(), k.double(), k.double()), "fp64"
    assert not cpu_kernels.supports(q[..., :40], k[..., :40], k[..., :40]), "a head size not a multiple of 16"
    assert not cpu_kernels.supports(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), k), "features apart"
    assert not cpu_kernels.supports(q.requires_grad_(), k, k), "autograd"


INT8_TILES = cpu_kernels.int8_tiles(4, 128)
needs_int8_tiles = pytest.mark.skipif(not INT8_TILES, reason="this CPU (or its OS) gives no AMX-INT8 tiles")


@needs_int8_tiles
@pytest.mark.parametrize("D,Dv", [(64, 64), (128, 128), (192, 80), (256, 256)])
@pytest.mark.parametrize("G,Lq", [(1, 1), (3, 1), (4, 1), (2, 2), (5, 1), (8, 1), (4, 3), (16, 1)])
def test_int8_scores_on_the_tiles_equal_fp64_and_the_fma_build(D, Dv, G, Lq):
    """Query rows over int8 slots: the scores on the AMX int8 tiles (the codes as stored, the query
    in three int8 terms, cpu_decode_amx8.h; up to 4 rows one tile with P V on the tiles too, 5 to 16
    rows a tile per term with P V on the FMA path; 16 unmasked rows take the bf16 tiles instead)
    are fp32's, against fp64 over the dequantized values and against the build without tiles, at
    lengths around the 16-slot tiles and the 64-slot blocks, across spans of channel scales, with
    a row mask."""
    gen = torch.Generator().manual_seed(D + 10 * G + Lq)
    B, Hkv, span = 2, 3, 48
    fma = _no_tiles_build()
    assert cpu_kernels.int8_tiles(G * Lq, D) and not cpu_kernels.int8_tiles(G * Lq, D, lib=fma)
    for n in (1, 15, 16, 17, 63, 64, 65, 300):
        k8, v8, kc, kt, vt, keys, values = _scaled_slots(torch.int8, B, Hkv, n + 9, D, Dv, span, torch.bfloat16, gen)
        q = torch.randn(B, Hkv, G * Lq, D, generator=gen) * 3
        scales = cpu_kernels.Int8Scales(kc, kt, vt, 9, span)
        for blocked in (None, torch.rand(B, 1, G, Lq, n, generator=gen) < 0.3):
            segment = cpu_kernels.Segment(k8[:, :, 9:], v8[:, :, 9:], blocked, scales=scales)
            want = _expected(q, keys[:, :, 9:], values[:, :, 9:], 0.2, G, Lq, blocked)
            _close(cpu_kernels.decode_joined(q, [segment], 0.2, G, Lq), want, f"tiles D={D} G={G} Lq={Lq} n={n}")
            _close(cpu_kernels._call(fma, q, [segment], 0.2, G, Lq, 2), want, f"FMA build D={D} n={n}")


@needs_int8_tiles
@pytest.mark.parametrize("rows", [4, 8])
@pytest.mark.parametrize("page_size", [3, 16, 17, 64])
def test_int8_scores_on_the_tiles_read_pages_and_leave_broken_runs_to_the_fma_path(page_size, rows):
    """16 slots go to the tiles only while their rows lie at one stride: pages of 3 or 17 slots break
    most runs (the FMA path takes those), pages of 16 and 64 none; every layout gives fp32's
    answer. Int8 slots through a shuffled block table, against fp64 over the gathered values."""
    gen = torch.Generator().manual_seed(page_size)
    B, Hkv, D, pages, span = 2, 2, 128, 48, 1 << 20
    width = pages // B
    pool_k = torch.randint(-127, 128, (Hkv, pages, page_size, D), generator=gen, dtype=torch.int8)
    pool_v = torch.randint(-127, 128, (Hkv, pages, page_size, D), generator=gen, dtype=torch.int8)
    table = torch.randperm(pages, generator=gen)[: B * width].view(B, width)
    S = width * page_size
    kc = torch.rand(B, Hkv, 1, D, generator=gen) + 0.5
    kt, vt = torch.rand(B, Hkv, S, generator=gen) / 100, torch.rand(B, Hkv, S, generator=gen) / 100
    gather = lambda pool: pool[:, table.reshape(-1)].view(Hkv, B, S, D).transpose(0, 1)  # noqa: E731
    keys = gather(pool_k).double() * kc.double() * kt.double()[..., None]
    values = gather(pool_v).double() * vt.double()[..., None]
    q = torch.randn(B, Hkv, rows, D, generator=gen)
    for lo, hi in ((0, S), (5, S - 7)):
        scales = cpu_kernels.Int8Scales(kc, kt[..., lo:], vt[..., lo:], 0, span)
        got = cpu_kernels.decode_partial(q, pool_k, pool_v, 0.125, rows, 1, None, table, lo, hi - lo, scales=scales)
        want = _expected(q, keys[:, :, lo:hi], values[:, :, lo:hi], 0.125, rows, 1, None)
        _close(got, want, f"int8 pages of {page_size}, slots [{lo}, {hi})")


@needs_int8_tiles
@pytest.mark.parametrize("rows", [4, 8])
def test_int8_scores_on_the_tiles_leave_a_non_finite_query_to_the_fma_path(rows):
    """The query's int8 terms need a finite ``q · scale · kc``: an infinite query row, or a span whose
    channel scale is NaN, runs the FMA path for that span, which gives what it always gave (the
    tiles' build and the FMA build agree bit for bit where the FMA path runs: NaN rows, the same
    numbers elsewhere)."""
    gen = torch.Generator().manual_seed(11)
    B, Hkv, n, D, span = 1, 2, 200, 64, 64
    k8, v8, kc, kt, vt, keys, values = _scaled_slots(torch.int8, B, Hkv, n, D, D, span, torch.float32, gen)
    q = torch.randn(B, Hkv, rows, D, generator=gen)
    q[0, 0, 1, 3] = float("inf")
    kc[0, 1, 2, 5] = float("nan")  # the third span of head 1
    scales = cpu_kernels.Int8Scales(kc, kt, vt, 0, span)
    segment = [cpu_kernels.Segment(k8, v8, scales=scales)]
    tiles = cpu_kernels.decode_joined(q, segment, 0.2, rows, 1)
    fma = cpu_kernels._call(_no_tiles_build(), q, segment, 0.2, rows, 1, 2)
    assert torch.equal(tiles[0].isnan(), fma[0].isnan()) and torch.equal(tiles[1].isnan(), fma[1].isnan())
    assert bool(fma[1].isnan().any())
    finite = ~fma[1].isnan()
    torch.testing.assert_close(tiles[1][finite], fma[1][finite], rtol=2e-5, atol=2e-5)
    finite_rows = [r for r in range(rows) if r != 1]
    want = _expected(q[:, :1, finite_rows], keys[:, :1], values[:, :1], 0.2, rows - 1, 1, None)  # head 0's finite rows
    _close((tiles[0][:, :1, finite_rows], tiles[1][:, :1, finite_rows]), want, "head 0, finite rows")


@needs_int8_tiles
def test_int8_tiles_past_their_int32_flush_and_with_a_nan_value_scale():
    """``P V`` on the int8 tiles keeps int32 sums for 65536 slots at a time: 140000 slots of equal
    weight whose first feature's code is 127 sum to 140000 · 127 · 127 > 2^31 in each row's first
    digit (four KV heads, so that the call is not split into pieces), so without the flush they
    would wrap; against fp64. A NaN value scale of a slot some rows
    see sends ``P V`` to the FMA path: those rows read NaN, the others what the FMA build gives."""
    gen = torch.Generator().manual_seed(12)
    B, Hkv, n, D, span = 1, 4, 140000, 64, 1 << 20  # four (b, h) pairs: not split into pieces
    k8, v8, kc, kt, vt, keys, values = _scaled_slots(torch.int8, B, Hkv, n, D, D, span, torch.float32, gen)
    v8[..., 0] = 127
    vt.fill_(0.01)
    values = v8.double() * vt.double()[..., None]
    q = torch.zeros(B, Hkv, 4, D)  # every weight equal
    scales = cpu_kernels.Int8Scales(kc, kt, vt, 0, span)
    got = cpu_kernels.decode_partial(q, k8, v8, 0.2, 4, 1, scales=scales)
    _close(got, _expected(q, keys, values, 0.2, 4, 1, None), "140000 int8 slots")
    short = 300
    vt_nan = vt[..., :short].clone()
    vt_nan[0, 0, 7] = float("nan")
    blocked = torch.zeros(B, 1, 4, 1, short, dtype=torch.bool)
    blocked[0, 0, 2:, 0, 7] = True  # rows 2 and 3 do not see slot 7
    segment = [
        cpu_kernels.Segment(
            k8[:, :, :short], v8[:, :, :short], blocked, scales=cpu_kernels.Int8Scales(kc, kt, vt_nan, 0, span)
        )
    ]
    tiles = cpu_kernels.decode_joined(q, segment, 0.2, 4, 1)
    fma = cpu_kernels._call(_no_tiles_build(), q, segment, 0.2, 4, 1, 2)
    assert bool(tiles[0][0, 0, :2].isnan().all()) and not bool(tiles[0][0, 0, 2:].isnan().any())
    torch.testing.assert_close(tiles[0][0, 0, 2:], fma[0][0, 0, 2:], rtol=2e-5, atol=2e-6)


@needs_int8_tiles
@pytest.mark.parametrize("rows", [16, 33])
@pytest.mark.parametrize("page_size", [3, 16, 17, 64])
def test_many_rows_over_int8_pages_take_int8_scores_on_the_tiles(page_size, rows):
    """16 and more rows over int8 slots run the bf16 tile path, whose scores for int8 keys of a
    multiple of 64 features come from the int8 tiles (the codes as stored, q · kc in three int8
    terms per group of 16 rows; rows a page breaks are staged as they are). MLA's 576-wide latent
    rows and 64-wide ones, through a shuffled block table, a NaN channel scale in one span (that
    span runs the bf16 conversion: its rows read NaN there, as the FMA build's), against fp64 and
    the build without tiles."""
    gen = torch.Generator().manual_seed(page_size + rows)
    for D, Dv in ((64, 64), (576, 512)):
        B, Hkv, pages, span = 1, 1, 24, 40
        S = pages * page_size
        pool_k = torch.randint(-127, 128, (Hkv, pages, page_size, D), generator=gen, dtype=torch.int8)
        pool_v = torch.randint(-127, 128, (Hkv, pages, page_size, Dv), generator=gen, dtype=torch.int8)
        table = torch.randperm(pages, generator=gen).view(B, pages)
        kc = torch.rand(B, Hkv, -(-S // span), D, generator=gen) + 0.5
        kt, vt = torch.rand(B, Hkv, S, generator=gen) / 100, torch.rand(B, Hkv, S, generator=gen) / 100
        gather = lambda pool, d: pool[:, table.reshape(-1)].view(Hkv, B, S, d).transpose(0, 1)  # noqa: E731
        keys = gather(pool_k, D).double() * kc.double()[:, :, torch.arange(S) // span] * kt.double()[..., None]
        values = gather(pool_v, Dv).double() * vt.double()[..., None]
        q = torch.randn(B, Hkv, rows, D, generator=gen) / 8
        scales = cpu_kernels.Int8Scales(kc, kt, vt, 0, span)
        got = cpu_kernels.decode_partial(q, pool_k, pool_v, 0.1, rows, 1, None, table, 0, S, scales=scales)
        _close(got, _expected(q, keys, values, 0.1, rows, 1, None), f"int8 pages of {page_size}, D={D}, {rows} rows")
        bad = kc.clone()
        bad[0, 0, 1, 3] = float("nan")  # the second span
        segment = [cpu_kernels.Segment(pool_k, pool_v, None, table, 0, S, cpu_kernels.Int8Scales(bad, kt, vt, 0, span))]
        tiles = cpu_kernels.decode_joined(q, segment, 0.1, rows, 1)
        fma = cpu_kernels._call(_no_tiles_build(), q, segment, 0.1, rows, 1, 2)
        assert bool(tiles[0].isnan().all()) and bool(fma[0].isnan().all())
