"""Importance ratios of a policy that has moved, without a GRPO run: what ``calclip diagnose --plot`` draws.

The ratio r = pi_theta / pi_old is 1 until an optimizer step separates the current weights from the ones that
gave the old log-probs, so a probe must move the policy. The procedure (`probe_moved_policy`), on a fixed batch
of token rows:

1. Block-FP8 the model's linear layers (the LM head stays BF16, as in the trainer) unless already done.
2. Old log-probs of every next token, once under FP8 and once under the BF16 shadow (same weights): what
   the rollout (FP8) and a shadow calibration (BF16) record in training.
3. ``update_steps`` AdamW steps on the FP8 policy (the trainer's precision flow) of the unclipped policy-gradient
   loss -mean(A * log pi) with synthetic sequence advantages: rows alternate A = +1 and A = -1, so half the
   tokens are pushed up and half down, like the two halves of a GRPO group.
4. New log-probs under FP8 and the BF16 shadow; rq = exp(new_fp8 - old_fp8), rb = exp(new_bf16 - old_bf16), then
   the calibration of `calclip.calibration.calibrate_bounds` on them.

It is a probe, not training: no sampling, no reward, fixed advantages, one batch. What it shares with training is
what the figure is about: the same FP8 graph for old and new log-probs, a few optimizer steps between them, and
the BF16 shadow on the same tokens. The model's weights are changed; pass a copy to keep them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from calclip.calibration import CalibrationResult, calibrate_bounds
from calclip.fp8.convert import quantize_model
from calclip.fp8.shadow import bf16_shadow
from calclip.monitoring.ratio_distributions import RatioSamples, split_ratios


@dataclass(frozen=True)
class ProbeResult:
    ratio_fp8: Tensor  # [B, T-1] rq per next token
    ratio_bf16: Tensor  # [B, T-1] rb, same tokens
    advantages: Tensor  # [B] the synthetic advantages
    mask: Tensor  # [B, T-1] the tokens that count
    calibration: CalibrationResult
    samples: RatioSamples
    eps_low: float
    eps_high: float


def synthetic_advantages(num_rows: int) -> Tensor:
    """+1, -1, +1, ... per row (float32 [B]): equal numbers of pushed-up and pushed-down sequences."""
    if num_rows < 2:
        raise ValueError(f"the probe needs at least 2 rows (one of each advantage sign), got {num_rows}")
    return torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(num_rows)])


def _next_token_logps(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def probe_moved_policy(
    model: nn.Module,
    input_ids: Tensor,  # [B, T] token rows, B >= 2
    attention_mask: Tensor | None = None,  # [B, T] 1 for real tokens; None: all real
    *,
    update_steps: int = 4,
    lr: float = 1e-6,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    upper: str = "balance",
) -> ProbeResult:
    """The procedure of the module docstring; returns the ratios, the calibrated bounds and the split samples."""
    if update_steps < 1:
        raise ValueError(f"update_steps must be >= 1 (the policy must move), got {update_steps}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    mask = (attention_mask[:, 1:] != 0) & (attention_mask[:, :-1] != 0)
    advantages = synthetic_advantages(input_ids.shape[0]).to(device)

    quantize_model(model)  # converts what is not yet converted; the default keeps the LM head in BF16
    model.eval()  # no dropout: the ratio moves only through the weights
    with torch.no_grad():
        old_fp8 = _next_token_logps(model, input_ids, attention_mask)
        with bf16_shadow(model):
            old_bf16 = _next_token_logps(model, input_ids, attention_mask)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    weights = mask.to(old_fp8.dtype)
    for _ in range(update_steps):
        logps = _next_token_logps(model, input_ids, attention_mask)
        loss = -(advantages[:, None] * logps * weights).sum() / weights.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    with torch.no_grad():
        new_fp8 = _next_token_logps(model, input_ids, attention_mask)
        with bf16_shadow(model):
            new_bf16 = _next_token_logps(model, input_ids, attention_mask)
    ratio_fp8 = torch.exp(new_fp8 - old_fp8)
    ratio_bf16 = torch.exp(new_bf16 - old_bf16)
    calibration = calibrate_bounds(
        ratio_bf16, ratio_fp8, advantages, mask, eps_low=eps_low, eps_high=eps_high, upper=upper
    )
    return ProbeResult(
        ratio_fp8=ratio_fp8,
        ratio_bf16=ratio_bf16,
        advantages=advantages,
        mask=mask,
        calibration=calibration,
        samples=split_ratios(ratio_fp8, ratio_bf16, advantages, mask),
        eps_low=eps_low,
        eps_high=eps_high,
    )


# Natural text for real models (random ids put a pretrained model far off its data and exaggerate the spread):
# eight different passages, one per row, so half the rows get A = +1 and half A = -1.
PROBE_TEXTS = (
    "Reinforcement learning fine-tunes a language model by sampling answers, scoring them and pushing up the "
    "log-probability of the good ones while pushing down the bad ones.",
    "The river rose overnight after three days of rain, and by morning the old stone bridge on the road to the "
    "village was closed to traffic until the water went down.",
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let it rise for an hour, "
    "shape it, and bake it in a hot oven until the crust is brown.",
    "In eight-bit floating point every matrix product is rounded, so the same tokens get slightly different "
    "probabilities than in full precision, and the importance ratio spreads out.",
    "What is seven plus five? Seven plus five is twelve, because counting five steps up from seven gives eight, "
    "nine, ten, eleven and then twelve.",
    "The museum opens at nine on weekdays and at ten on weekends; tickets are cheaper online, and children under "
    "twelve enter for free with an adult.",
    "A good unit test checks one behaviour, names it clearly, and fails for a reason a reader can understand "
    "without running a debugger or reading the whole code base.",
    "The committee met on Tuesday to discuss the budget for next year, and after a long debate it agreed to "
    "spend more on schools and less on new roads.",
)


def text_batch(tokenizer, *, seq_len: int, texts=PROBE_TEXTS) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` [len(texts), <= seq_len]: one text per row, right-padded."""
    encoded = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True, max_length=seq_len,
                        padding_side="right")
    return encoded["input_ids"], encoded["attention_mask"]
