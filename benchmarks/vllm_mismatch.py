"""bench_vllm.py's ``ops`` and ``mismatch`` parts: vLLM 0.24's kernels against calclip's on identical inputs, and
each engine's rollout log-probs against the trainer's forward on the same tokens (token-mult-prob-error), before and
after a few AdamW steps and a sync, with the diagnostics that tell a wrong comparison from engine and trainer
computing different functions (teacher-forced prompt log-probs, greedy agreement, the engine's BF16 tensors).
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
import time

import vllm_common  # noqa: I001  (first: vLLM's environment defaults, before torch is imported)
import torch
from torch import nn

import _common
from vllm_common import (_short, fmt, fp8_policy, make_llm, random_llama, recipe_label, rollout, save_for_vllm,
                         save_results, shutdown, smollm2, sync_bf16, timed_ms)

MISMATCH_ARMS = {"calclip": "FP8 calclip", "vllm": "FP8 vLLM-default", "bf16": "BF16"}  # --mismatch-arms


def mismatch_stats(engine_logp: torch.Tensor, trainer_logp: torch.Tensor) -> dict[str, float]:
    """engine vs trainer log-probs of the same sampled tokens, [B, T] each: token-mult-prob-error (mean of
    exp|d|, calclip.losses.token_mult_prob_error), max |d|, share of tokens with exp|d| > 1.1, mean |d|."""
    from calclip.losses import token_mult_prob_error

    a, b = engine_logp.float().cpu(), trainer_logp.float().cpu()
    diff = (a - b).abs()
    return {"tmpe": float(token_mult_prob_error(b, a, torch.ones_like(a))), "max_abs": float(diff.max()),
            "over_1p1": float((diff.exp() > 1.1).float().mean()), "mean_abs": float(diff.mean()),
            "tokens": int(diff.numel())}


def trainer_logprobs(model, prompts: torch.Tensor, completions: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """log p(completion token) under ``model`` (teacher-forced, one forward over prompt + completion), [B, T] fp32."""
    device = next(model.parameters()).device
    out = []
    p = prompts.shape[1]
    with torch.no_grad():
        for start in range(0, prompts.shape[0], chunk):
            ids = torch.cat([prompts[start:start + chunk], completions[start:start + chunk]], 1).to(device)
            logits = model(input_ids=ids).logits[:, p - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None])[..., 0].cpu())
    return torch.cat(out)


def prompt_logprobs_of(out, ids: list[int]) -> list[float]:
    """The engine's teacher-forced log-probs of ``ids[1:]`` from one vLLM 0.24 ``RequestOutput`` of a request with
    ``SamplingParams(prompt_logprobs=0)`` on ``ids``: ``out.prompt_logprobs`` holds None for the first prompt token,
    then per position a {token id: Logprob} dict (a plain list, or vllm.logprobs.FlatLogprobs, whose ``[i]`` builds
    the same dict) holding at least the prompt token itself. Raises ValueError when the output does not belong to
    ``ids`` (another length, or a position without its token)."""
    plp = out.prompt_logprobs
    if plp is None:
        raise ValueError("no prompt_logprobs in the output (SamplingParams(prompt_logprobs=0) not honoured)")
    if len(plp) != len(ids):
        raise ValueError(f"prompt_logprobs cover {len(plp)} positions, the request has {len(ids)} tokens")
    values = []
    for pos in range(1, len(ids)):
        step = plp[pos]
        if step is None or ids[pos] not in step:
            raise ValueError(f"prompt_logprobs position {pos} lacks the prompt token {ids[pos]}")
        values.append(float(step[ids[pos]].logprob))
    return values


def engine_teacher_forced(llm, ids: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, float]:
    """The engine's own log-probs of every token of ``ids`` [B, L] after the first, teacher-forced (one prefill with
    ``prompt_logprobs=0``, ``max_tokens=1``), [B, L-1] fp32; and the share of requests whose ``prompt_token_ids``
    the engine echoes back unchanged. Chunks of ``chunk`` requests keep the [tokens, vocab] log-softmax small."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, seed=0, detokenize=False)
    rows, echoed = [], 0
    for start in range(0, ids.shape[0], chunk):
        batch = ids[start:start + chunk].tolist()
        outs = llm.generate([{"prompt_token_ids": r} for r in batch], params, use_tqdm=False)
        for out, r in zip(outs, batch):
            echoed += list(getattr(out, "prompt_token_ids", None) or []) == r
            rows.append(prompt_logprobs_of(out, r))
    return torch.tensor(rows, dtype=torch.float32), echoed / ids.shape[0]


def engine_greedy_first(llm, prompts: torch.Tensor) -> torch.Tensor:
    """The engine's greedy (temperature 0) first token after each prompt, [B]."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    return torch.tensor([o.outputs[0].token_ids[0] for o in outs])


def trainer_all_logprobs(model, ids: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s teacher-forced log-probs of every token of ``ids`` [B, L] after the first, [B, L-1] fp32, and its
    argmax at every position, [B, L] (column t: the most likely token after ids[:, :t+1])."""
    device = next(model.parameters()).device
    lps, tops = [], []
    with torch.no_grad():
        for start in range(0, ids.shape[0], chunk):
            part = ids[start:start + chunk].to(device)
            logits = model(input_ids=part).logits.float()
            tops.append(logits.argmax(-1).cpu())
            lps.append(torch.log_softmax(logits[:, :-1], -1).gather(-1, part[:, 1:, None])[..., 0].cpu())
    return torch.cat(lps), torch.cat(tops)


def diagnostic_stats(engine_rollout_lp: torch.Tensor, engine_tf: torch.Tensor, trainer_tf: torch.Tensor,
                     prompt_len: int, engine_greedy: torch.Tensor | None = None,
                     trainer_greedy: torch.Tensor | None = None) -> dict:
    """What tells a wrong comparison from engine and trainer computing different functions.

    engine_rollout_lp [B, T]: the rollout's log-probs of its sampled tokens; engine_tf / trainer_tf [B, P+T-1]:
    teacher-forced log-probs of tokens 1.. of prompt + completion (P = ``prompt_len``) from the engine
    (``prompt_logprobs``) and from the trainer's forward. ``align``: rollout vs the engine's own teacher-forced
    values of the same completion tokens (tmpe ~1: the rollout's tokens and log-probs are extracted and lined up
    right; far from 1: they are not). ``tf_prompt`` / ``tf_completion``: engine vs trainer on the same ids, prompt
    positions (no sampling involved at all) and completion positions. ``greedy_top1_agree``: share of prompts whose
    greedy first token is the same in engine and trainer. ``mean_logp``: the average log-prob each side gives."""
    p = prompt_len
    out = {"align": mismatch_stats(engine_rollout_lp, engine_tf[:, p - 1:]),
           "tf_prompt": mismatch_stats(engine_tf[:, :p - 1], trainer_tf[:, :p - 1]),
           "tf_completion": mismatch_stats(engine_tf[:, p - 1:], trainer_tf[:, p - 1:]),
           "mean_logp": {"engine_rollout": float(engine_rollout_lp.mean()),
                         "engine_tf_completion": float(engine_tf[:, p - 1:].mean()),
                         "trainer_completion": float(trainer_tf[:, p - 1:].mean()),
                         "engine_tf_prompt": float(engine_tf[:, :p - 1].mean()),
                         "trainer_prompt": float(trainer_tf[:, :p - 1].mean())}}
    if engine_greedy is not None and trainer_greedy is not None:
        out["greedy_top1_agree"] = float((engine_greedy.cpu() == trainer_greedy.cpu()).float().mean())
    return out


def engine_runner(llm) -> str:
    """Which vLLM model runner serves ``llm`` (0.24 picks Model Runner V2, ``vllm.v1.worker.gpu.model_runner``, for
    LlamaForCausalLM checkpoints and the V1 ``gpu_model_runner`` otherwise)."""
    try:
        runner = llm.llm_engine.model_executor.driver_worker.model_runner
    except AttributeError:
        return "?"
    return f"{type(runner).__module__}.{type(runner).__name__}"


def engine_weight_mismatches(engine_model: nn.Module, base: nn.Module,
                             packed_modules=None) -> tuple[int, list[str]]:
    """Compare every floating-point (not FP8) parameter of a live vLLM model with ``base``'s, under vLLM's names:
    fused layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj) against their shards stacked along dim 0, a vocab
    table padded by the engine on its first rows. Returns (tensors compared, "name: why" for each that differs or
    has no source). FP8 tensors are ``engine_fp8_mismatches``' job; this catches an engine that never received the
    embeddings, norms or LM head, or that ties or pads them differently."""
    from calclip.fp8.export import LLAMA_PACKED_MODULES

    packed = LLAMA_PACKED_MODULES if packed_modules is None else packed_modules
    source = {n: p.detach() for n, p in base.named_parameters()}
    compared, bad = 0, []
    for name, param in engine_model.named_parameters():
        got = param.detach()
        if not got.is_floating_point() or got.dtype == torch.float8_e4m3fn or got.element_size() < 2:
            continue
        module, _, leaf = name.rpartition(".")
        parent, _, short = module.rpartition(".")
        if name in source:
            want = source[name]
        elif short in packed and all(f"{parent}.{s}.{leaf}" in source for s in packed[short]):
            want = torch.cat([source[f"{parent}.{s}.{leaf}"] for s in packed[short]])
        else:
            if leaf == "weight" and "." in module and got.dim() >= 1:
                bad.append(f"{name}: no source in the trainer model")
            continue
        compared += 1
        if got.shape[1:] != want.shape[1:] or got.shape[0] < want.shape[0]:
            bad.append(f"{name}: engine {tuple(got.shape)}, trainer {tuple(want.shape)}")
            continue
        diff = (got[: want.shape[0]].float() - want.to(got.device).float()).abs().max().item()
        if diff > 0:
            bad.append(f"{name}: max |engine - trainer| {diff:.3g}")
    return compared, bad


def mismatch_diagnostics(llm, reference, prompts: torch.Tensor, tokens: torch.Tensor,
                         engine_lp: torch.Tensor, base: nn.Module | None = None) -> dict:
    """``diagnostic_stats`` for one engine and its trainer-side ``reference`` on one rollout, plus the runner,
    whether the engine echoes the prompts unchanged and (with ``base``) whether it holds ``base``'s BF16 tensors.
    Costs two short prefills and a one-token greedy generate."""
    ids = torch.cat([prompts, tokens], 1)
    engine_tf, echoed = engine_teacher_forced(llm, ids)
    trainer_tf, trainer_top = trainer_all_logprobs(reference, ids)
    greedy = engine_greedy_first(llm, prompts)
    stats = diagnostic_stats(engine_lp, engine_tf, trainer_tf, prompts.shape[1], greedy,
                             trainer_top[:, prompts.shape[1] - 1])
    out = {**stats, "prompt_ids_echoed": echoed, "runner": engine_runner(llm)}
    if base is not None:
        from calclip.rollout.vllm_sync import vllm_engine_model

        compared, bad = engine_weight_mismatches(vllm_engine_model(llm)[0], base)
        out["bf16_tensors"] = {"compared": compared, "differ": len(bad), "first": bad[:4]}
        print(f"   engine BF16 tensors vs the trainer's: {compared} compared, {len(bad)} differ"
              + (f", e.g. {bad[:3]}" if bad else ""), flush=True)
    return out


def train_steps(policy, prompts, completions, steps: int, lr: float, chunk: int = 8) -> list[float]:
    """``steps`` AdamW steps minimizing the NLL of ``completions`` under ``policy`` (its FP8 forward and backward);
    returns the losses. The policy shares its Parameters with the BF16 model, so both move."""
    device = next(policy.parameters()).device
    params = [q for q in policy.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    p = prompts.shape[1]
    losses = []
    policy.train()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(0, prompts.shape[0], chunk):
            ids = torch.cat([prompts[start:start + chunk], completions[start:start + chunk]], 1).to(device)
            logits = policy(input_ids=ids).logits[:, p - 1:-1].float()
            nll = -torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None]).mean() * ids.shape[0] / prompts.shape[0]
            nll.backward()
            total += float(nll.detach())
        optimizer.step()
        losses.append(total)
    policy.eval()
    return losses


@contextlib.contextmanager
def attention(model, implementation: str):
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


# ---------------------------------------------------------------------------------------------------------------
# part ops: vLLM's kernels vs calclip's on identical inputs


def spread_activations(rows: int, k: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, k // 128, 128, device=device, generator=gen)
    scale = 10.0 ** torch.empty(rows, k // 128, 1, device=device).uniform_(-2, 2, generator=gen)
    return (x * scale).view(rows, k).to(torch.bfloat16)


def share_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return float((a == b).float().mean())


def part_ops(opts) -> None:
    import torch.nn.functional as F

    from calclip.fp8.gemm import emulated_block_gemm, fp8_block_gemm, resolve_backend
    from calclip.fp8.quant import quantize_1x128, quantize_128x128

    device = torch.device("cuda")
    rows, results = [], []

    def record(check: str, shape: str, value: str, **numbers):
        rows.append([check, shape, value])
        results.append({"check": check, "shape": shape, **numbers})

    def attempt(label, fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 — one failing check must not stop the others
            record(label, "-", f"error: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")

    def quantizer():
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

        for m, k in ((64, 4096), (4096, 14336)):
            x = spread_activations(m, k, 0, device)
            qv, sv = per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=False)
            qc, sc = quantize_1x128(x)
            codes, scales = share_equal(qv, qc), share_equal(sv.contiguous(), sc)
            record("1x128 quantizer: vLLM per_token_group_quant_fp8 = calclip (codes / scales bit-equal)",
                   f"{m}x{k}", f"{codes:.6f} / {scales:.6f}", codes_equal=codes, scales_equal=scales)

    def silu_mul():
        gen = torch.Generator(device=device).manual_seed(1)
        gate = (torch.randn(256, 14336, device=device, generator=gen) * 2).to(torch.bfloat16)
        up = (torch.randn(256, 14336, device=device, generator=gen) * 2).to(torch.bfloat16)
        eager = F.silu(gate) * up
        for emulate in (False, True):
            torch._dynamo.reset()
            with torch._inductor.config.patch(emulate_precision_casts=emulate):
                compiled = torch.compile(lambda g, u: F.silu(g) * u, dynamic=False)(gate, up)
            same = share_equal(compiled, eager)
            record(f"SiLU(gate)*up, Inductor emulate_precision_casts={emulate}: BF16 bits = eager", "256x14336",
                   f"{same:.6f}", equal=same, emulate=emulate)
        q_train, s_train = quantize_1x128(eager)
        out = torch.empty_like(eager, dtype=torch.float8_e4m3fn)
        scales = torch.empty(256, 14336 // 128, device=device)
        torch.ops._C.silu_and_mul_per_block_quant(out, torch.cat([gate, up], -1).contiguous(), scales, 128, None, False)
        codes = share_equal(out, q_train)
        record("vLLM fused SiLU*up+quant codes = calclip's on HF's BF16 product", "256x14336", f"{codes:.6f}",
               codes_equal=codes)

    def gemm():
        for m, k, n in ((64, 4096, 6144), (256, 4096, 28672), (256, 14336, 4096), (2048, 4096, 4096)):
            gen = torch.Generator(device=device).manual_seed(m + n)
            w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
            qw, sw = quantize_128x128(w)
            qx, sx = quantize_1x128(spread_activations(m, k, 2, device))
            ref = emulated_block_gemm(qx, sx, qw, sw, out_dtype=torch.float32)
            from vllm import _custom_ops as ops

            y_vllm = ops.cutlass_scaled_mm(qx, qw.t(), out_dtype=torch.bfloat16,
                                           scale_a=sx.t().contiguous().t(), scale_b=sw.t())
            y_calclip = fp8_block_gemm(qx, sx, qw, sw, out_dtype=torch.bfloat16)
            backend = resolve_backend("auto", qx, qw, out_dtype=torch.bfloat16, a_blocks="1x128", b_blocks="128x128")
            rms = ref.pow(2).mean().sqrt()
            err_v = float((y_vllm.float() - ref).pow(2).mean().sqrt() / rms)
            err_c = float((y_calclip.float() - ref).pow(2).mean().sqrt() / rms)
            same = share_equal(y_vllm, y_calclip)
            record(f"block GEMM, same codes: vLLM CUTLASS = calclip {backend} (bits) | rel rms err vs fp32 ref",
                   f"{m}x{k}x{n}", f"{same:.4f} | {err_v:.2e} vs {err_c:.2e}", bits_equal=same, vllm_rel_err=err_v,
                   calclip_rel_err=err_c, calclip_backend=backend)

    for label, fn in (("quantizer", quantizer), ("silu_mul", silu_mul), ("gemm", gemm)):
        attempt(label, fn)
    print("\n### ops: vLLM 0.24 kernels vs calclip on identical inputs")
    _common.table(["check", "shape", "value"], rows)
    vllm_common.RESULTS["ops"] = results


# ---------------------------------------------------------------------------------------------------------------
# part mismatch


def part_mismatch(opts) -> None:
    from calclip.rollout.vllm_sync import engine_fp8_mismatches, vllm_engine_model

    device = torch.device(opts.device)
    rows, diag_rows, results = [], [], vllm_common.RESULTS.setdefault("mismatch", [])
    for name in opts.models:
        t0 = time.perf_counter()
        print(f"-- mismatch: {name}", flush=True)
        if name == "smollm2":
            if not opts.smollm2_gguf:
                print("   skipped: --smollm2-gguf not given", flush=True)
                continue
            base = smollm2(opts.smollm2_gguf, device)
        else:
            base = random_llama(name, opts.layers, device, opts.logit_std)
        policy, kept = fp8_policy(base)  # blockwise: the policy the after-sync stage trains (every recipe's engine
        # then syncs the same Parameters)
        if kept:
            print(f"   kept in BF16 for vLLM (and training): {len(kept)} linears, e.g. {kept[0]}", flush=True)
        policies = {"blockwise": policy}
        for recipe in opts.recipes:
            if recipe not in policies and {"calclip", "vllm"} & set(opts.mismatch_arms):
                policies[recipe], kept_r = fp8_policy(base, recipe)
                if kept_r:
                    print(f"   {recipe}: kept in BF16 for vLLM (and training): {len(kept_r)} linears", flush=True)
        model_dir = save_for_vllm(base, tempfile.mkdtemp(prefix=f"bench_vllm_{name}_"))
        vocab = base.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (opts.mismatch_prompts, opts.prompt_len), generator=gen)
        max_len = opts.prompt_len + opts.mismatch_tokens + 8
        engines: dict[str, object] = {}
        specs = [(recipe_label(MISMATCH_ARMS[key], recipe), dict(policy=policies[recipe], numerics=numerics))
                 for recipe in opts.recipes for key, numerics in (("calclip", "calclip"), ("vllm", "vllm"))
                 if key in opts.mismatch_arms]
        specs += [(MISMATCH_ARMS["bf16"], {})] if "bf16" in opts.mismatch_arms else []
        arm_policy = {arm: kwargs.get("policy", base) for arm, kwargs in specs}
        for arm, kwargs in specs:
            try:
                engines[arm] = make_llm(model_dir, opts, max_model_len=max_len, max_num_seqs=opts.mismatch_prompts,
                                        batches=[opts.mismatch_prompts], gpu_util=opts.gpu_util, **kwargs)
            except Exception as err:  # noqa: BLE001
                print(f"   !! engine {arm}: {_short(err)}", flush=True)
                results.append({"model": name, "arm": arm, "error": _short(err)})
        samples = {}
        for stage in ("initial", f"after {opts.steps} steps + sync"):
            sync_ms: dict[str, float] = {}
            if stage != "initial":
                # the FP8 engine's samples (with --mismatch-arms bf16 alone: the BF16 engine's)
                first = recipe_label("FP8 calclip", opts.recipes[0])
                fp8_tokens = samples.get(first, next(iter(samples.values()), None))
                if fp8_tokens is None:
                    break
                losses = train_steps(policy, prompts, fp8_tokens, opts.steps, opts.lr)
                print(f"   {opts.steps} AdamW steps (lr {opts.lr}) on the FP8 policy: NLL {losses[0]:.3f} -> "
                      f"{losses[-1]:.3f}", flush=True)
                from calclip.rollout.vllm_sync import sync_fp8_weights

                for arm, llm in engines.items():
                    sync = (lambda llm=llm: sync_bf16(llm, base)) if arm == "BF16" else (  # noqa: F821
                        lambda llm=llm, arm=arm: sync_fp8_weights(llm, arm_policy[arm]))  # noqa: F821
                    sync_ms[arm] = timed_ms(sync)
            for arm, llm in engines.items():
                fp8 = arm != "BF16"
                reference = arm_policy[arm]
                codes = "-"
                if fp8:
                    bad = engine_fp8_mismatches(vllm_engine_model(llm)[0], reference)
                    codes = "yes" if not bad else f"NO ({len(bad)}: {bad[0]})"
                tokens, engine_lp = rollout(llm, prompts, opts.mismatch_tokens, seed=len(samples))
                samples[arm] = tokens
                stats = mismatch_stats(engine_lp, trainer_logprobs(reference, prompts, tokens))
                floor = {}
                if not arm.startswith("FP8 vLLM-default"):
                    with attention(reference, "eager"):
                        eager_lp = trainer_logprobs(reference, prompts, tokens)
                    floor = mismatch_stats(eager_lp, trainer_logprobs(reference, prompts, tokens))
                try:
                    diag = mismatch_diagnostics(llm, reference, prompts, tokens, engine_lp, base=base)
                except Exception as err:  # noqa: BLE001 — the row stands without its diagnostics
                    diag = {"error": _short(err)}
                    print(f"   !! diagnostics {arm}: {diag['error']}", flush=True)
                degenerate = is_degenerate(diag)
                if degenerate:
                    print(f"   !! {arm} {stage}: degenerate row (the policy puts ~all its mass on its own samples: "
                          f"mean completion log-prob {diag['mean_logp']['trainer_completion']:.3f}); lower --lr",
                          flush=True)
                row = {"model": name, "stage": stage, "arm": arm, "model_impl": opts.model_impl, **stats,
                       "degenerate": degenerate,
                       "floor_tmpe": floor.get("tmpe"),
                       "floor_max_abs": floor.get("max_abs"), "engine_holds_trainer_codes": codes,
                       "sync_ms": sync_ms.get(arm), "diag": diag}
                results.append(row)
                diag_rows.append(diagnostic_row(name, stage, arm, diag))
                print("diag: | " + " | ".join(diag_rows[-1]) + " |", flush=True)
                rows.append([name, stage + (" (degenerate)" if degenerate else ""), arm, fmt(stats["tmpe"], 4),
                             fmt(stats["max_abs"]), fmt(stats["over_1p1"]),
                             fmt(floor.get("tmpe"), 4), codes[:40], fmt(sync_ms.get(arm), 0)])
                print("row: | " + " | ".join(rows[-1]) + " |", flush=True)
            add_control_differences(vllm_common.RESULTS)
            save_results(opts)
        for llm in list(engines.values()):
            shutdown(llm)
        engines.clear()
        # ruff checks the sync lambdas above as if they ran after this del: their noqa F821 (astral-sh/ruff#9858)
        del base, policy, policies, arm_policy
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"   {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n### mismatch: token-mult-prob-error, engine rollout log-probs vs the trainer's forward on the same "
          f"tokens ({opts.mismatch_prompts} prompts x {opts.prompt_len} random tokens, {opts.mismatch_tokens} "
          f"sampled tokens, temperature 1)")
    _common.table(["model", "stage", "engine", "tmpe", "max |d|", "share exp|d|>1.1", "floor tmpe",
                   "engine holds trainer codes", "sync ms"], rows)
    print("FP8 engines are compared with calclip's FP8 forward (same codes), BF16 with the HF BF16 forward. floor: "
          "the trainer model with eager vs SDPA attention on the same tokens (BF16-level noise through the model). "
          "Target (docs/vllm.md): FP8 calclip tmpe minus BF16 tmpe <= 0.01.", flush=True)
    for r in results:
        if r.get("minus_bf16_control") is not None:
            print(f"   {r['model']} {r['stage']} {r['arm']}: minus BF16 control = {r['minus_bf16_control']:+.4f}")
    print("\n### mismatch diagnostics: the engine's teacher-forced prompt log-probs (prompt_logprobs=0 on prompt + "
          "completion) against its rollout log-probs (align) and against the trainer's forward on the same ids "
          "(prompt / completion positions), greedy first-token agreement, mean log-prob per side")
    _common.table(DIAGNOSTIC_COLUMNS, diag_rows)
    print("Read: align ~1 and TF tmpe ~ floor: the engine serves the trainer's model and the comparison is right. "
          "align ~1 but TF prompt tmpe huge and top-1 agree ~0: engine and trainer compute different functions "
          "(weights / config / engine state), sampling not involved. align far from 1: the rollout's tokens and "
          "log-probs are not lined up (extraction).", flush=True)


DIAGNOSTIC_COLUMNS = ["model", "stage", "engine", "runner", "prompt ids echoed", "align tmpe", "align max |d|",
                      "TF prompt tmpe", "TF prompt mean |d|", "TF completion tmpe", "greedy top-1 agree",
                      "mean logp engine/trainer (completion)", "mean logp engine/trainer (prompt)"]


def diagnostic_row(model: str, stage: str, arm: str, diag: dict) -> list[str]:
    """One row of the diagnostics table (``DIAGNOSTIC_COLUMNS``) from ``mismatch_diagnostics``' dict."""
    if "error" in diag:
        return [model, stage, arm, diag["error"][:60], *["-"] * (len(DIAGNOSTIC_COLUMNS) - 4)]
    m = diag["mean_logp"]
    runner = diag.get("runner", "?")
    runner = "V2" if ".worker.gpu." in runner else "V1" if "gpu_model_runner" in runner else runner[-30:]
    return [model, stage, arm, runner, fmt(diag.get("prompt_ids_echoed"), 2), fmt(diag["align"]["tmpe"], 4),
            fmt(diag["align"]["max_abs"]), fmt(diag["tf_prompt"]["tmpe"], 4), fmt(diag["tf_prompt"]["mean_abs"]),
            fmt(diag["tf_completion"]["tmpe"], 4), fmt(diag.get("greedy_top1_agree"), 3),
            f"{m['engine_tf_completion']:.2f} / {m['trainer_completion']:.2f}",
            f"{m['engine_tf_prompt']:.2f} / {m['trainer_prompt']:.2f}"]


DEGENERATE_LOGP = -0.05  # mean completion log-prob above this: the policy samples ~deterministically


def is_degenerate(diag: dict) -> bool:
    """A row whose policy puts almost all its mass on its own samples (mean completion log-prob > -0.05 on the
    trainer side): every log-prob is ~0 on both sides and the tmpe is a trivial ~1.0, not a measurement."""
    logp = diag.get("mean_logp", {}).get("trainer_completion") if isinstance(diag, dict) else None
    return logp is not None and logp > DEGENERATE_LOGP


def add_control_differences(results: dict) -> None:
    """``minus_bf16_control`` of every FP8 mismatch row: its tmpe minus the BF16 row's of the same model and stage
    (rows from separate child processes, so filled in after they merge); None without such a BF16 row, or where
    either row is degenerate (``is_degenerate``)."""
    rows = results.get("mismatch", [])
    control = {(r.get("model"), r.get("stage")): r for r in rows
               if r.get("arm") == "BF16" and r.get("tmpe") is not None}
    for r in rows:
        if r.get("arm", "").startswith("FP8") and r.get("tmpe") is not None:
            base = control.get((r.get("model"), r.get("stage")))
            usable = base is not None and not base.get("degenerate") and not r.get("degenerate")
            r["minus_bf16_control"] = r["tmpe"] - base["tmpe"] if usable else None
