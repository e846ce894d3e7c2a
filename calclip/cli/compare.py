"""``calclip compare``: arms (BF16 / FP8 static / FP8 + TIS / FP8 calibrated, or your own) x seeds over one config,
each an ordinary ``calclip train`` run in its own folder; metrics files, a Markdown table and a figure
(calclip.compare)."""

from __future__ import annotations

from calclip.compare.command import main as compare_main


def compare(argv: list[str] | None = None) -> int:
    """``calclip compare`` (calclip.compare.command). Returns the exit status."""
    return compare_main(argv)
