"""The pictures of docs/positions.md, drawn from what the library computes.

    .venv/bin/python docs/figures/positions_figures.py      # writes docs/img/positions_*.png

Every value drawn comes from ``multihead``: bias matrices from the modifiers' ``bias_block``
(the block a backend adds to the scores), the causal pattern from ``causal().materialize``,
buckets from ``relative_position_bucket``, the capped curve from calling ``softcap(cap)`` and
the probabilities from ``multihead.attention(..., return_weights=True)``. Nothing is re-derived
here, so a picture changes when the code does. Images (bias and bucket matrices) have a colour
bar; the two plots of curves and bars have a legend instead.

matplotlib is drawn on an Agg canvas (``matplotlib.figure.Figure``): no window, no global backend.
"""

from __future__ import annotations

from pathlib import Path

import torch

import multihead as mh
from multihead.positions import ALiBi, RelativePositionBias, alibi_slopes, relative_position_bucket
from multihead.scores import softcap

OUT = Path(__file__).resolve().parents[1] / "img"
DPI = 100


def alibi_bias(num_heads: int, length: int, symmetric: bool) -> torch.Tensor:
    """``(H, L, L)``: the bias ALiBi adds to the scores of an ``L x L`` attention (bottom-right
    alignment, which for ``Lq == Lk`` is query ``i`` at key ``i``)."""
    mod = ALiBi(num_heads, symmetric=symmetric).for_lengths(length, length)
    extent = mh.Extent(1, num_heads, length, length)
    return mod.bias_block(extent, extent.whole())[0]  # (H, L, L)


def t5_bias(num_heads: int, length: int, seed: int = 0) -> torch.Tensor:
    """``(H, L, L)``: a bidirectional T5 bias read from a table ``weight (32, H)`` drawn from
    ``N(0, 1)`` with a fixed seed (a trained table would do; this one is reproducible)."""
    rel = RelativePositionBias(num_heads, num_buckets=32, max_distance=128, bidirectional=True)
    with torch.no_grad():
        rel.weight.copy_(torch.randn(rel.weight.shape, generator=torch.Generator().manual_seed(seed)))
    extent = mh.Extent(1, num_heads, length, length)
    return rel().for_lengths(length, length).bias_block(extent, extent.whole())[0].detach()


def _fraction(m: float) -> str:
    """A slope ``2^-n`` as ``1/2^n`` text."""
    return f"1/{round(1 / m)}"


def draw_alibi(path: Path, symmetric: bool) -> None:
    from matplotlib.figure import Figure

    H, L = 4, 32
    bias = alibi_bias(H, L, symmetric)
    slopes = alibi_slopes(H)
    if symmetric:
        title = f"ALiBi({H}, symmetric=True), Lq = Lk = {L}, no mask: bias −m_h·|j − i| added to score (i, j)"
    else:
        visible = mh.causal().materialize(1, 1, L, L)[0, 0]  # (L, L) bool, True = may attend
        bias = bias.masked_fill(~visible, float("nan"))  # drawn grey: the mask blocks these keys
        title = f"ALiBi({H}) under causal(), Lq = Lk = {L}: bias m_h·(j − i) added to score (i, j); grey = blocked"
    fig = Figure(figsize=(13.5, 3.6), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, H)
    for h, ax in enumerate(axes):
        cmap = _cmap("viridis")
        im = ax.imshow(bias[h].numpy(), cmap=cmap, interpolation="nearest")
        ax.set_title(f"head {h}: m = {_fraction(float(slopes[h]))}", fontsize=10)
        ax.set_xlabel("key j")
        if h == 0:
            ax.set_ylabel("query i")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=11)
    _save(fig, path)


def draw_t5_buckets(path: Path) -> None:
    from matplotlib.figure import Figure

    buckets, max_distance, L = 32, 128, 160
    d = torch.arange(-L + 1, L)
    fig = Figure(figsize=(14, 4.3), dpi=DPI, layout="constrained")
    ax_line, ax_bi, ax_causal = fig.subplots(1, 3)
    for bidirectional, style in ((True, "-"), (False, "--")):
        b = relative_position_bucket(d, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance)
        ax_line.step(d.numpy(), b.numpy(), style, where="mid",
                     label="bidirectional=True" if bidirectional else "bidirectional=False (causal)")
    ax_line.set_xlabel("distance d = j − i (key − query)")
    ax_line.set_ylabel("bucket")
    ax_line.set_title("bucket(d), d in [-159, 159]", fontsize=10)
    ax_line.legend(fontsize=8, loc="center right")
    ax_line.grid(alpha=0.3)
    i = torch.arange(L).view(-1, 1)
    j = torch.arange(L).view(1, -1)
    for ax, bidirectional in ((ax_bi, True), (ax_causal, False)):
        grid = relative_position_bucket(j - i, bidirectional=bidirectional, num_buckets=buckets,
                                        max_distance=max_distance)
        im = ax.imshow(grid.numpy(), cmap=_cmap("turbo"), vmin=0, vmax=buckets - 1, interpolation="nearest")
        ax.set_title(f"bucket(j − i), {L} x {L}, bidirectional={bidirectional}", fontsize=10)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        fig.colorbar(im, ax=ax, shrink=0.85, label="bucket")
    fig.suptitle(f"T5 buckets: relative_position_bucket(d, num_buckets={buckets}, max_distance={max_distance})",
                 fontsize=11)
    _save(fig, path)


def draw_t5_bias(path: Path) -> None:
    from matplotlib.figure import Figure

    H, L = 4, 48
    bias = t5_bias(H, L)
    limit = float(bias.abs().max())
    fig = Figure(figsize=(13.5, 3.7), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, H)
    for h, ax in enumerate(axes):
        im = ax.imshow(bias[h].numpy(), cmap=_cmap("RdBu_r"), vmin=-limit, vmax=limit, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=10)
        ax.set_xlabel("key j")
        if h == 0:
            ax.set_ylabel("query i")
    fig.colorbar(im, ax=list(axes), shrink=0.8, label="bias weight[bucket(j − i), h]")
    fig.suptitle(f"T5 bias, RelativePositionBias({H}) bidirectional, weight (32, {H}) ~ N(0, 1) with seed 0, "
                 f"Lq = Lk = {L}", fontsize=11)
    _save(fig, path)


def draw_softcap(path: Path) -> None:
    from matplotlib.figure import Figure

    s = torch.linspace(-120, 120, 481, dtype=torch.float64)
    fig = Figure(figsize=(6.5, 4.5), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ax.plot(s.numpy(), s.numpy(), ":", color="grey", label="no cap: s")
    for cap in (20.0, 50.0):
        capped = softcap(cap)(s, None, None, None, None)  # the modifier itself; it reads no index
        ax.plot(s.numpy(), capped.numpy(), label=f"softcap({cap:g}): {cap:g}·tanh(s/{cap:g})")
        ax.axhline(cap, color="grey", lw=0.5)
        ax.axhline(-cap, color="grey", lw=0.5)
    ax.set_xlim(-120, 120)
    ax.set_ylim(-70, 70)
    ax.set_xlabel("scaled score s = scale·q·k (after any bias)")
    ax.set_ylabel("score given to the softmax")
    ax.set_title("softcap: s → cap·tanh(s / cap), caps 20 and 50", fontsize=11)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    _save(fig, path)


def sink_row(num_keys: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One query row's weights over ``num_keys`` keys without and with a sink whose logit is the
    row's own log-sum-exp (so the sink takes exactly half the mass): ``(p, p_sink, sink)``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g, dtype=torch.float64) for n in (1, num_keys, num_keys))
    plain = mh.attention(q, k, v, return_weights=True, return_lse=True)
    sink = float(plain.lse[0, 0, 0])
    with_sink = mh.attention(q, k, v, sinks=torch.tensor([sink], dtype=torch.float64), return_weights=True)
    return plain.weights[0, 0, 0], with_sink.weights[0, 0, 0], sink


def draw_sink(path: Path) -> None:
    from matplotlib.figure import Figure

    p, p_sink, sink = sink_row()
    n = p.shape[0]
    x = torch.arange(n).numpy()
    fig = Figure(figsize=(8, 4.3), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ax.bar(x - 0.2, p.numpy(), width=0.4, label=f"no sink: weights sum to {float(p.sum()):.2f}")
    ax.bar(x + 0.2, p_sink.numpy(), width=0.4,
           label=f"sink s = {sink:.3f} (= the row's lse): weights sum to {float(p_sink.sum()):.2f}")
    ax.set_xticks(x)
    ax.set_xlabel("key j")
    ax.set_ylabel("probability P_ij")
    ax.set_title(f"One query row over {n} keys, with and without a sink: P'_ij = P_ij·σ(lse − s)", fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def _cmap(name: str):
    from matplotlib import colormaps

    cmap = colormaps[name].copy()
    cmap.set_bad("#d9d9d9")  # NaN = blocked
    return cmap


def _save(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    print(f"{path.relative_to(OUT.parents[1])}: {path.stat().st_size // 1024} KiB")


FIGURES = {
    "positions_alibi_causal.png": lambda p: draw_alibi(p, symmetric=False),
    "positions_alibi_symmetric.png": lambda p: draw_alibi(p, symmetric=True),
    "positions_t5_buckets.png": draw_t5_buckets,
    "positions_t5_bias.png": draw_t5_bias,
    "positions_softcap.png": draw_softcap,
    "positions_sink.png": draw_sink,
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURES.items():
        draw(OUT / name)


if __name__ == "__main__":
    main()
