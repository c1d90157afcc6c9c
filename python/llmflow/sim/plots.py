"""PNG plots of a scenario run: queue, running requests and KV usage over time, TTFT CDFs.

One line per policy on every panel; the TTFT figure has one panel per workload class. Uses
matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pathlib import Path

    from llmflow.sim.runner import PolicyRun

__all__ = ["write_plots"]


def write_plots(runs: list[PolicyRun], out_dir: Path, title: str) -> list[Path]:
    """Write `timeseries.png` and `ttft_cdf.png` into `out_dir`.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullFormatter

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "timeseries.png", out_dir / "ttft_cdf.png"]

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    panels = (("queue", "queued (gateway + vLLM)"), ("running", "running requests"),
              ("kv_usage", "KV cache usage"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for run in runs:
            ax.plot(run.series["t"], run.series[key], label=run.name, linewidth=1.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[2].set_ylim(0, 1.05)
    axes[2].set_xlabel("simulated time (s)")
    axes[0].legend(loc="upper right")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    classes = list(runs[0].ttft) if runs else []
    fig, axes = plt.subplots(1, max(1, len(classes)), figsize=(5 * max(1, len(classes)), 4),
                             squeeze=False)
    for ax, cls in zip(axes[0], classes, strict=False):
        for run in runs:
            x = np.sort(run.ttft[cls][np.isfinite(run.ttft[cls])])
            if x.size:
                ax.step(np.maximum(x, 1e-3), np.arange(1, x.size + 1) / x.size, where="post",
                        label=run.name)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT from first attempt (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(cls)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths
