"""Figures of the ratio distributions (matplotlib, the optional ``plot`` extra).

`plot_ratio_histograms`: two panels, A<0 and A>0 tokens; in each, histograms of log r under FP8 and under the
BF16 shadow on the same tokens, the static bounds log(1-eps_low) / log(1+eps_high) and the calibrated log L /
log H as vertical lines, and the shares each bound drops written on the panel.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from calclip.monitoring.ratio_distributions import RatioSamples, dropped_shares

PLOT_INSTALL_HINT = 'pip install "calclip[plot]"  (or pip install matplotlib)'

FP8_COLOR, BF16_COLOR = "#d62728", "#1f77b4"
STATIC_STYLE = {"color": "0.35", "linestyle": "--", "linewidth": 1.2}
CALIBRATED_STYLE = {"color": "black", "linestyle": "-", "linewidth": 1.6}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ModuleNotFoundError(f"plotting needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}") from None
    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    return plt


def _bin_edges(values: list[torch.Tensor], lines: list[float], num_bins: int) -> torch.Tensor:
    present = [v for v in values if v.numel()]
    lo = min([*(float(v.min()) for v in present), *lines])
    hi = max([*(float(v.max()) for v in present), *lines])
    pad = 0.05 * (hi - lo) if hi > lo else 0.05
    return torch.linspace(lo - pad, hi + pad, num_bins + 1, dtype=torch.float64)


def plot_ratio_histograms(
    samples: RatioSamples,
    path: str | Path,
    *,
    low: float,
    high: float,
    eps_low: float,
    eps_high: float,
    title: str = "",
    num_bins: int = 80,
) -> dict[str, float]:
    """Write the figure to ``path`` (format from the suffix: .png, .pdf, .svg); return the dropped shares it
    shows (`calclip.monitoring.ratio_distributions.dropped_shares`)."""
    plt = _pyplot()
    shares = dropped_shares(samples, low=low, high=high, eps_low=eps_low, eps_high=eps_high)
    logs = samples.log_ratios()
    static_low, static_high = math.log(1.0 - eps_low), math.log(1.0 + eps_high)
    figure, axes = plt.subplots(2, 1, figsize=(8.0, 7.2), constrained_layout=True)
    panels = (
        ("neg_adv", "A < 0 tokens: r < bound drops the penalty", static_low, math.log(low), "1-eps", "L",
         (f"dropped (r < bound)\n"
          f"FP8  at 1-eps = {1 - eps_low:.3f}:  {shares['neg_low_frac_fp8_static']:.1%}\n"
          f"BF16 at 1-eps = {1 - eps_low:.3f}:  {shares['neg_low_frac_bf16']:.1%}\n"
          f"FP8  at L     = {low:.3f}:  {shares['neg_low_frac_fp8']:.1%}")),
        ("pos_adv", "A > 0 tokens: r > bound drops the push-up", static_high, math.log(high), "1+eps", "H",
         (f"dropped (r > bound)\n"
          f"FP8  at 1+eps = {1 + eps_high:.3f}:  {shares['pos_high_frac_fp8_static']:.1%}\n"
          f"BF16 at 1+eps = {1 + eps_high:.3f}:  {shares['pos_high_frac_bf16']:.1%}\n"
          f"FP8  at H     = {high:.3f}:  {shares['pos_high_frac_fp8']:.1%}")),
    )
    for axis, (side, heading, static_line, calibrated_line, static_name, calibrated_name, text) in zip(axes, panels):
        fp8, bf16 = logs[f"fp8/{side}"], logs[f"bf16/{side}"]
        edges = _bin_edges([fp8, bf16], [static_line, calibrated_line], num_bins).numpy()
        axis.hist(bf16.numpy(), bins=edges, color=BF16_COLOR, alpha=0.55, label=f"BF16 shadow ({bf16.numel()} tokens)")
        axis.hist(fp8.numpy(), bins=edges, color=FP8_COLOR, alpha=0.45, label=f"FP8 ({fp8.numel()} tokens)")
        axis.axvline(static_line, **STATIC_STYLE, label=f"static log({static_name})")
        axis.axvline(calibrated_line, **CALIBRATED_STYLE, label=f"calibrated log {calibrated_name}")
        axis.set_yscale("log")
        axis.set_xlabel("log r = log pi_theta - log pi_old")
        axis.set_ylabel("tokens")
        axis.set_title(heading, fontsize=10)
        axis.legend(loc="upper right", fontsize=8)
        axis.text(0.01, 0.97, text, transform=axis.transAxes, va="top", ha="left", family="monospace", fontsize=8,
                  bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.7"})
    if title:
        figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return shares


def require_matplotlib() -> None:
    """Raise the install hint now (before minutes of work) when matplotlib is missing."""
    _pyplot()


def probe_and_plot(model, input_ids, attention_mask, path: str | Path, *, update_steps: int, lr: float,
                   eps_low: float, eps_high: float, title: str = "") -> dict[str, float]:
    """`calclip.monitoring.ratio_probe.probe_moved_policy` on the batch, then `plot_ratio_histograms` of its ratios
    with its calibrated bounds; returns the bounds, the dropped shares and the log-ratio spreads."""
    from calclip.monitoring.ratio_probe import probe_moved_policy

    require_matplotlib()
    probe = probe_moved_policy(model, input_ids, attention_mask, update_steps=update_steps, lr=lr,
                               eps_low=eps_low, eps_high=eps_high)
    low, high = probe.calibration.bounds()
    shares = plot_ratio_histograms(probe.samples, path, low=low, high=high, eps_low=eps_low, eps_high=eps_high,
                                   title=title)
    keep = probe.mask
    log_fp8, log_bf16 = probe.ratio_fp8.log()[keep], probe.ratio_bf16.log()[keep]
    return {"low": low, "high": high, **shares,
            "log_ratio_std_fp8": float(log_fp8.std()), "log_ratio_std_bf16": float(log_bf16.std()),
            "tokens_neg": probe.samples.fp8_neg.numel(), "tokens_pos": probe.samples.fp8_pos.numel()}
