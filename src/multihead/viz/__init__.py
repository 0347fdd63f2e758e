"""Pictures of attention: PNG heatmap grids (matplotlib) and a self-contained HTML viewer.

matplotlib is imported only when a PNG is drawn; the HTML viewer needs nothing but torch.
"""

from multihead.viz.heatmap import plot_attention, plot_attention_grid
from multihead.viz.viewer import ViewerSource, render_viewer, write_viewer

__all__ = ["plot_attention_grid", "plot_attention", "ViewerSource", "render_viewer", "write_viewer"]
