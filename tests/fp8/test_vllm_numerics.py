"""vLLM 0.24.0's block-FP8 arithmetic, re-derived from its source, against calclip's quantizers (the numerics contract
of calclip/fp8/reference.py). Each ``vllm_*`` helper below is written from the vLLM code it names (read, not
copied: vllm 0.24.0 wheel, commit ee0da84ab, and csrc/ from vllm-project/vllm), so these tests pin down which of
vLLM's paths reproduce calclip's codes bit for bit and which do not. docs/vllm.md ("Numerics") lists the same
differences with the consequences calclip draws (``calclip.rollout.vllm_sync.fp8_engine_numerics_kwargs``).

No vLLM is imported: CI has none. Where vLLM uses a CUDA intrinsic, the helper uses the IEEE operation the SASS of
the 0.24 build shows (``FCHK`` + refinement: ``div.rn.f32``), which torch's CPU float32 division also is.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from calclip.fp8.config import FP8_DTYPE, FP8_E4M3_MAX
from calclip.fp8.export import vllm_block_fp8_problems
from calclip.fp8.reference import dequantize_128x128, quantize_1x128, quantize_128x128, round_scale_up_to_pow2

GROUP = 128
# csrc/quantization/fused_kernels/quant_conversions.cuh: min_scaling_factor<c10::Float8_e4m3fn>::val()
# = 1 / (FP8_E4M3_MAX * 512); the 0.24 SASS of silu_and_mul_per_block_quant_kernel clamps with 4.3596542e-06.
VLLM_MIN_SCALING_FACTOR = 1.0 / (FP8_E4M3_MAX * 512.0)
VLLM_GROUP_QUANT_EPS = 1e-10  # fp8_utils.per_token_group_quant_fp8(eps=1e-10)


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def vllm_per_token_group_quant(x: torch.Tensor, eps: float = VLLM_GROUP_QUANT_EPS):
    """csrc/quantization/fp8/per_token_group_quant.cu (torch.ops._C.per_token_group_fp8_quant, what QuantFP8 runs on
    CUDA for contiguous x): local_absmax starts at eps and takes fmaxf(|x|) over the group; y_s = absmax / 448 and
    q = clamp(x / y_s, -448, 448), both IEEE divisions; c10::Float8_e4m3fn(q) rounds to nearest even."""
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    absmax = torch.clamp(xf.abs().amax(-1), min=f32(eps))
    scale = absmax / f32(FP8_E4M3_MAX)
    q = torch.clamp(xf / scale.unsqueeze(-1), -FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def vllm_triton_group_scale(absmax: torch.Tensor) -> torch.Tensor:
    """fp8_utils._per_token_group_quant_fp8 (the Triton fallback, taken for non-contiguous x):
    scale_raw = absmax * (1.0 / fp8_max) -- a multiply by the fp32 reciprocal, not a division."""
    return absmax.float() * f32(1.0 / FP8_E4M3_MAX)


def vllm_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """The UE8M0 rounding of the CUDA kernel (SCALE_UE8M0) and of deep_gemm._ceil_to_ue8m0:
    exp2(ceil(log2(max(|s|, 1e-10)))), in float32."""
    return torch.exp2(torch.ceil(torch.log2(torch.clamp(scale.abs(), min=f32(1e-10)))))


def vllm_silu_mul_block_quant(gate: torch.Tensor, up: torch.Tensor):
    """silu_and_mul_per_block_quant_kernel (csrc/quantization/fused_kernels/fused_silu_mul_block_quant.cu; the
    fusion pass act_quant_fusion puts it where SiluAndMul + QuantFP8 were): gate and up read as float,
    result = gate * (1 / (1 + expf(-gate))) * up in float32 (never rounded to BF16), group scale
    max(absmax / 448, min_scaling_factor), codes clamp(result / scale) (0.24 sm_90 SASS: FCHK divisions,
    FMNMX with 4.3596542e-06)."""
    g, u = gate.float(), up.float()
    result = (g * (1.0 / (1.0 + torch.exp(-g)))) * u
    groups = result.reshape(*result.shape[:-1], -1, GROUP)
    scale = torch.clamp(groups.abs().amax(-1) / f32(FP8_E4M3_MAX), min=f32(VLLM_MIN_SCALING_FACTOR))
    q = torch.clamp(groups / scale.unsqueeze(-1), -FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q.reshape(result.shape), scale


def hf_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaMLP in BF16 (what the trainer's FP8 down_proj quantizes): act_fn(gate) * up, each op
    rounding to BF16."""
    return F.silu(gate) * up


def vllm_requant_weight_ue8m0(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_utils.requant_weight_ue8m0_inplace -> deep_gemm.per_block_cast_to_fp8(use_ue8m0=True), run by
    DeepGemmFp8BlockScaledMMKernel.process_weights_after_loading when is_deep_gemm_e8m0_used() (DeepGEMM installed,
    Hopper or Blackwell, VLLM_USE_DEEP_GEMM_E8M0 default 1): dequantize with the checkpoint's scales, then block
    amax clamped at 1e-4, sf = ceil_ue8m0(amax / 448), codes (x * (1 / sf)).to(e4m3) without a clamp."""
    n, k = q.shape
    w = dequantize_128x128(q, s)
    nbn, nbk = -(-n // GROUP), -(-k // GROUP)
    padded = torch.zeros(nbn * GROUP, nbk * GROUP)
    padded[:n, :k] = w
    view = padded.view(nbn, GROUP, nbk, GROUP)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = torch.pow(2.0, torch.ceil(torch.log2((amax / f32(FP8_E4M3_MAX)).abs())))
    codes = (view * (1.0 / sf)).to(FP8_DTYPE).view(nbn * GROUP, nbk * GROUP)[:n, :k].contiguous()
    return codes, sf.view(nbn, nbk)


def vllm_fused_scale_rows(shard_rows: list[int], shard_scales: list[torch.Tensor], fused_rows: int) -> torch.Tensor:
    """How QKVParallelLinear / MergedColumnParallelLinear load per-shard weight_scale_inv blocks into the fused
    parameter: linear.adjust_block_scale_shard rounds each shard's row offset and size UP to whole blocks
    (ceil(offset / 128), ceil(size / 128)), then the rows are narrowed and copied in shard order."""
    fused = torch.full((-(-fused_rows // GROUP), shard_scales[0].shape[1]), float("nan"))
    offset = 0
    for rows, scale in zip(shard_rows, shard_scales):
        start, size = -(-offset // GROUP), -(-rows // GROUP)
        if start + size > fused.shape[0]:
            raise RuntimeError(f"start ({start}) + length ({size}) exceeds dimension size ({fused.shape[0]})")
        fused[start:start + size] = scale
        offset += rows
    return fused


def codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def activations(rows: int, k: int, seed: int, *, scale: float = 1.0) -> torch.Tensor:
    """BF16 activations with per-group magnitudes spread over four decades (real layers are not unit normal)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    spread = 10.0 ** torch.empty(rows, k // GROUP, 1).uniform_(-2, 2, generator=gen)
    return (x.view(rows, k // GROUP, GROUP) * spread * scale).view(rows, k).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------- activations


def test_cuda_group_quant_equals_calclip_bit_for_bit():
    """The kernel vLLM's QuantFP8 runs for contiguous activations computes calclip's codes and scales exactly."""
    x = activations(64, 1024, seed=0)
    q_v, s_v = vllm_per_token_group_quant(x)
    q_c, s_c = quantize_1x128(x)
    assert codes_equal(q_v, q_c)
    assert torch.equal(s_v, s_c)


def test_cuda_group_quant_differs_only_below_its_eps_floor():
    """eps = 1e-10 seeds vLLM's absmax; calclip floors at 1e-12. A group whose amax lies between gets other codes."""
    x = activations(4, 256, seed=1)
    x[0, :GROUP] = (torch.randn(GROUP) * 1e-11).to(torch.bfloat16)  # amax ~3e-11 < 1e-10
    q_v, s_v = vllm_per_token_group_quant(x)
    q_c, s_c = quantize_1x128(x)
    assert s_v[0, 0] == f32(VLLM_GROUP_QUANT_EPS) / f32(FP8_E4M3_MAX) and s_c[0, 0] < s_v[0, 0]
    assert not codes_equal(q_v[0, :GROUP], q_c[0, :GROUP])
    assert codes_equal(q_v[:, GROUP:], q_c[:, GROUP:]) and codes_equal(q_v[1:], q_c[1:])
    assert torch.equal(s_v[1:], s_c[1:]) and torch.equal(s_v[:, 1:], s_c[:, 1:])


def test_triton_fallback_scale_is_a_reciprocal_multiply_and_can_differ_by_one_ulp():
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(2)) * 100
    divided = amax / f32(FP8_E4M3_MAX)
    multiplied = vllm_triton_group_scale(amax)
    differ = divided != multiplied
    assert 0 < int(differ.sum()) < amax.numel()  # some scales, not all
    ulps = (divided.view(torch.int32) - multiplied.view(torch.int32)).abs()
    assert int(ulps.max()) == 1


def test_ue8m0_activation_scales_equal_calclip_pow2_except_just_above_a_power_of_two():
    gen = torch.Generator().manual_seed(3)
    scale = (torch.rand(100_000, generator=gen) + 0.01) * 10.0 ** torch.randint(-6, 2, (100_000,), generator=gen)
    assert torch.equal(vllm_ue8m0(scale), round_scale_up_to_pow2(scale))
    # 2^-10 * (1 + 2^-23): log2 in float32 rounds to exactly -10, so vLLM's "ceil" keeps 2^-10 -- BELOW the scale
    # (codes then clamp at 448); calclip's exact bit rounding gives 2^-9.
    just_above = (torch.tensor(2.0**-10) .view(torch.int32) + 1).view(torch.float32).reshape(1)
    assert vllm_ue8m0(just_above).item() == 2.0**-10 < just_above.item()
    assert round_scale_up_to_pow2(just_above).item() == 2.0**-9


# -------------------------------------------------------------------------------------- fused quant kernels


def test_fused_silu_mul_quant_quantizes_other_values_than_the_trainer():
    """With fuse_act_quant (on by default in compiled vLLM for block FP8) the down_proj input is quantized from an
    unrounded FP32 SiLU(gate)*up; the trainer quantizes HF's BF16 product. Unfused, vLLM quantizes a BF16 product:
    when it is HF's (eager rounding, emulate_precision_casts) the codes are calclip's exactly."""
    gen = torch.Generator().manual_seed(4)
    gate = (torch.randn(256, 1024, generator=gen) * 2).to(torch.bfloat16)
    up = (torch.randn(256, 1024, generator=gen) * 2).to(torch.bfloat16)
    q_fused, s_fused = vllm_silu_mul_block_quant(gate, up)
    q_train, s_train = quantize_1x128(hf_silu_mul(gate, up))
    code_diff = (q_fused.view(torch.uint8) != q_train.view(torch.uint8)).float().mean().item()
    assert code_diff > 0.02, code_diff  # measured: 3.1% of the down_proj input codes
    # unfused with eager BF16 rounding: vLLM's per-token-group kernel on HF's product = calclip, bit for bit
    q_unfused, s_unfused = vllm_per_token_group_quant(hf_silu_mul(gate, up))
    assert codes_equal(q_unfused, q_train) and torch.equal(s_unfused, s_train)
    # Inductor without emulate_precision_casts: one rounding of the FP32 product, still other codes
    one_rounding = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    q_inductor, _ = vllm_per_token_group_quant(one_rounding)
    inductor_diff = (q_inductor.view(torch.uint8) != q_train.view(torch.uint8)).float().mean().item()
    assert inductor_diff > 0.02, inductor_diff  # measured: 2.9% (27% of the BF16 products differ by an ulp)


def test_fused_kernels_floor_group_scales_at_one_over_448_times_512():
    """rms_norm_per_block_quant and silu_and_mul_per_block_quant clamp every group scale at min_scaling_factor: a
    group whose amax is below 1/512 gets a coarser scale than in the trainer (and than vLLM's unfused kernel)."""
    gate = torch.full((2, 256), 0.02, dtype=torch.bfloat16)
    up = (torch.randn(2, 256, generator=torch.Generator().manual_seed(5)) * 0.01).to(torch.bfloat16)
    q_fused, s_fused = vllm_silu_mul_block_quant(gate, up)
    q_train, s_train = quantize_1x128(hf_silu_mul(gate, up))
    assert bool((s_train < VLLM_MIN_SCALING_FACTOR).all())  # amax ~3e-4 < 1/512
    assert bool((s_fused == f32(VLLM_MIN_SCALING_FACTOR)).all())
    assert not codes_equal(q_fused, q_train)


# ------------------------------------------------------------------------------------------------- weights


def test_deepgemm_ue8m0_requant_rewrites_the_trainers_codes_unless_scales_are_powers_of_two():
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(512, 768, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_128x128(w)  # calclip's default: exact FP32 scales
    q_dg, s_dg = vllm_requant_weight_ue8m0(q, s)
    changed = (q_dg.view(torch.uint8) != q.view(torch.uint8)).float().mean().item()
    # measured: 99.997% of the codes move (each block's scale changes by a non-power-of-two factor), the dequantized
    # weights by 2% (median relative) -- a second rounding the trainer never applied
    assert changed > 0.9, changed
    assert not torch.equal(s_dg, s)
    q2, s2 = quantize_128x128(w, pow2=True)  # Fp8Config(power_of_two_scales=True)
    q2_dg, s2_dg = vllm_requant_weight_ue8m0(q2, s2)
    assert codes_equal(q2_dg, q2) and torch.equal(s2_dg, s2)


def test_fused_scale_rows_line_up_when_every_shard_is_whole_blocks():
    """Llama-3-8B q/k/v (4096/1024/1024) and gate/up (14336/14336): the fused weight_scale_inv is the shards'
    scales stacked, and every fused 128-row block holds rows of one shard only."""
    for rows in ([4096, 1024, 1024], [14336, 14336]):
        scales = [torch.rand(r // GROUP, 32) for r in rows]
        assert torch.equal(vllm_fused_scale_rows(rows, scales, sum(rows)), torch.cat(scales))
    problems = vllm_block_fp8_problems({f"model.layers.0.self_attn.{p}_proj": (n, 4096)
                                        for p, n in zip("qkv", (4096, 1024, 1024))})
    assert problems == {}


def test_ragged_fused_shards_get_misplaced_scales_in_vllm_and_are_refused_by_calclip():
    """SmolLM2-135M q/k/v = 576/192/192: 5 + 2 + 2 = 9 shard scale rows, 8 fused rows. vLLM 0.24 accepts the layer
    (_maybe_allow_fp8_block_shape_mismatch), rounds offsets up and k's second row is overwritten by v's first --
    what the real 0.24 loaders did on CPU (benchmarks/probe_vllm_reload_cpu.py)."""
    rows = [576, 192, 192]
    scales = [torch.full((-(-r // GROUP), 5), float(i + 1)) for i, r in enumerate(rows)]
    scales[1][1] = 2.5  # k's second block row
    fused = vllm_fused_scale_rows(rows, scales, sum(rows))
    assert fused.shape[0] == 8 < sum(s.shape[0] for s in scales)
    assert not bool((fused == 2.5).any())  # k's second scale row is gone
    # fused rows 512..639 (scale row 4) hold q's last 64 rows and k's first 64 rows under q's scale
    assert bool((fused[4] == 1.0).all())
    with pytest.raises(RuntimeError, match="exceeds dimension size"):  # q/k/v = 384/192/192: narrow() fails
        vllm_fused_scale_rows([384, 192, 192], [torch.ones(3, 2), torch.ones(2, 2), torch.ones(2, 2)], 768)
    shapes = {f"model.layers.0.self_attn.{p}_proj": (n, 576) for p, n in zip("qkv", rows)}
    shapes["model.layers.0.mlp.down_proj"] = (576, 1536)
    problems = vllm_block_fp8_problems(shapes)
    assert set(problems) == {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}
    assert "straddle" in problems["model.layers.0.self_attn.k_proj"]
    assert "K=576" in problems["model.layers.0.self_attn.q_proj"]


def test_e4m3_max_is_the_clamp_both_sides_use():
    assert FP8_E4M3_MAX == 448.0 and math.isclose(VLLM_MIN_SCALING_FACTOR, 4.3596542127488646656e-06, rel_tol=1e-7)
