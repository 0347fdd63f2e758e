"""Pictures of attention: PNG heatmap grids (matplotlib) and a self-contained HTML viewer.

matplotlib is imported only when a PNG is drawn; the HTML viewer needs nothing but torch.
"""

from multihead.viz.heatmap import plot_attention, plot_attention_grid
from multihead.viz.lens import LogitLens, logit_lens
from multihead.viz.record import QueryKeyCapture, record_attention, record_generation, record_vectors
from multihead.viz.seq2seq import record_seq2seq
from multihead.viz.viewer import Viewer, ViewerSource, render_viewer, write_viewer

__all__ = [
    "plot_attention_grid",
    "plot_attention",
    "ViewerSource",
    "Viewer",
    "render_viewer",
    "write_viewer",
    "record_attention",
    "record_generation",
    "record_vectors",
    "QueryKeyCapture",
    "LogitLens",
    "logit_lens",
    "record_seq2seq",
]
