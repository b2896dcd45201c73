"""``normscope.diff``: two executions of one model compared layer by layer, to the first site that is itself wrong."""

from .core import diff
from .render import plot_diff, render_diff
from .result import SCHEMA, Diff, SiteDiff

__all__ = ["diff", "Diff", "SiteDiff", "SCHEMA", "render_diff", "plot_diff"]
