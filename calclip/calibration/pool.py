"""The tokens a calibration rests on, pooled over mini-batches (DESIGN.md step 8).

A calibration needs hundreds of A<0 tokens: alpha is a rare-event share (a few percent), and its quantile of the
FP8 ratios moves with every token near the tail. One mini-batch of a GRPO run holds a dozen to a few dozen (the
SmolLM2 evidence runs: 12-45, L jumping 0.20-1.00 between one-mini-batch fits). The calibrator therefore pools the
A != 0 tokens of every moved mini-batch (of every rank) until the pool holds enough evidence, and fits once.

A ``TokenPool`` holds flat float64 tensors in arrival order: FP8 ratios and advantages, and the BF16 shadow ratios
of the same tokens for a shadow pool (``with_bf16=True``). Its state is plain Python lists, so a checkpoint holding
it loads with ``torch.load(..., weights_only=True)`` and can be checked value by value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calclip.calibration.state import is_real

_FIELDS = ("ratio_bf16", "ratio_fp8", "advantages")


class TokenPool:
    """Tokens (A != 0, finite, positive ratios) accumulated over mini-batches: ``[n]`` float64 tensors."""

    def __init__(self, *, with_bf16: bool) -> None:
        self.with_bf16 = with_bf16
        self.clear()

    def clear(self) -> None:
        self._parts: dict[str, list[Tensor]] = {name: [] for name in self._names}
        self.batches = 0  # mini-batches added (on every rank the same: the schedule is global)

    @property
    def _names(self) -> tuple[str, ...]:
        return _FIELDS if self.with_bf16 else _FIELDS[1:]

    def add(self, advantages: Tensor, ratio_fp8: Tensor, ratio_bf16: Tensor | None = None) -> None:
        """Append one mini-batch's selected tokens ([n] each, the same n)."""
        if (ratio_bf16 is not None) != self.with_bf16:
            raise ValueError(f"this pool {'needs' if self.with_bf16 else 'takes no'} BF16 shadow ratios")
        values = {"ratio_fp8": ratio_fp8, "advantages": advantages}
        if self.with_bf16:
            values["ratio_bf16"] = ratio_bf16
        for name in self._names:
            self._parts[name].append(values[name].detach().to(torch.float64).reshape(-1))
        self.batches += 1

    def tensors(self) -> dict[str, Tensor]:
        """The pooled tokens, in arrival order ([n] float64 each; empty tensors for an empty pool)."""
        return {name: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
                for name, parts in self._parts.items()}  # fmt: skip

    def counts(self) -> tuple[int, int]:
        """(|N-|, |N+|) of the pooled tokens."""
        neg = sum(int((adv < 0).sum()) for adv in self._parts["advantages"])
        pos = sum(int((adv > 0).sum()) for adv in self._parts["advantages"])
        return neg, pos

    # -- checkpointing --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {name: tensor.tolist() for name, tensor in self.tensors().items()}
        state["batches"] = self.batches
        return state

    def load_state_dict(self, state: dict, *, where: str) -> None:
        """Restore ``state_dict()``'s lists, checked value by value; errors name ``where`` and the field."""
        if not isinstance(state, dict):
            raise ValueError(f"{where} must be a dict, got {type(state).__name__}")
        expected = {*self._names, "batches"}
        if set(state) != expected:
            raise ValueError(f"{where} must hold exactly the fields {sorted(expected)}, got {sorted(state)}")
        batches = state["batches"]
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"{where}['batches'] must be an int >= 0, got {batches!r}")
        lengths = set()
        columns = {}
        for name in self._names:
            values = state[name]
            if not isinstance(values, list) or not all(is_real(v) for v in values):
                raise ValueError(f"{where}[{name!r}] must be a list of finite numbers")
            if name == "advantages":
                bad = next((v for v in values if v == 0), None)
            else:
                bad = next((v for v in values if not v > 0), None)  # a ratio is exp(log-ratio) > 0
            if bad is not None:
                rule = "non-zero" if name == "advantages" else "positive"
                raise ValueError(f"{where}[{name!r}] values must be {rule}, got {bad!r}")
            lengths.add(len(values))
            columns[name] = torch.tensor(values, dtype=torch.float64)
        if len(lengths) > 1:
            raise ValueError(f"{where}: the token lists must have one length, got {sorted(lengths)}")
        if batches == 0 and lengths != {0}:
            raise ValueError(f"{where}: tokens without a mini-batch ('batches' is 0)")
        self.clear()
        for name, column in columns.items():
            if column.numel():
                self._parts[name].append(column)
        self.batches = batches


# A round ends short when its pool is below the minimum; this many short rounds in a row earn the first warning.
STARVED_AFTER_ROUNDS = 3


class StarvationWatch:
    """Counts the generation rounds in a row whose pool stayed below the minimum, so that a run whose rounds never
    reach ``min_tokens`` (small batches, short completions) says so instead of training at its initial bounds in
    silence.

    ``record(stats)`` takes a calibrator commit's stats: ``calib/fit`` 1 ends a streak, 0 (with
    ``calib/pool_neg_tokens`` / ``calib/pool_pos_tokens``) extends it, a commit without ``calib/fit`` (no shadow round)
    leaves it. It returns ``(metrics, message)``: ``calib/short_rounds`` (the streak, 0 after a fit) and
    ``calib/pool_tokens`` (the pool's A<0 tokens, after a fit the tokens it used) for the log, and a warning text or
    None. The warning comes when a streak first reaches ``after`` rounds, then each time the streak reaches twice the
    length of the last warning's (3, 6, 12, ... rounds: once, then rate-limited), over the whole run.
    """

    def __init__(self, min_tokens: int, *, needs_positive: bool, after: int = STARVED_AFTER_ROUNDS) -> None:
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise ValueError(f"after must be an integer >= 1 (rounds), got {after!r}")
        self.min_tokens = min_tokens
        self.needs_positive = needs_positive  # a `balance` or `quantile` upper bound needs min_tokens A>0 tokens too
        self.short_rounds = 0
        self._next_warning = after

    def record(self, stats: dict) -> tuple[dict[str, float], str | None]:
        if "calib/fit" not in stats:
            return {}, None
        if stats["calib/fit"]:
            self.short_rounds = 0
            return {"calib/short_rounds": 0.0, "calib/pool_tokens": float(stats.get("calib/neg_tokens", 0.0))}, None
        self.short_rounds += 1
        neg = int(stats["calib/pool_neg_tokens"])
        pos = int(stats["calib/pool_pos_tokens"])
        metrics = {"calib/short_rounds": float(self.short_rounds), "calib/pool_tokens": float(neg)}
        if self.short_rounds < self._next_warning:
            return metrics, None
        self._next_warning = 2 * self.short_rounds
        return metrics, self.message(neg, pos)

    def message(self, neg: int, pos: int) -> str:
        rounds = self.short_rounds
        short = [f"{neg} A<0"] if neg < self.min_tokens else []
        if self.needs_positive and pos < self.min_tokens:
            short.append(f"{pos} A>0")
        held = " and ".join(short) or f"{neg} A<0 and {pos} A>0"
        per_round = max(neg, 1) / rounds
        return (
            f"calibration: {rounds} generation rounds in a row without a fit; the pool holds {held} tokens "
            f"(about {per_round:.0f} A<0 per round) against calibration_min_tokens {self.min_tokens}, so the clip "
            f"bounds in force have not changed. Put more tokens in each round (per_device_train_batch_size, "
            f"num_generations, steps_per_generation, max_completion_length) or lower calibration_min_tokens "
            f"(a fit on fewer tokens is noisier)."
        )
