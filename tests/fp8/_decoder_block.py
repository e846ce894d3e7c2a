"""A stand-in for a Llama decoder layer's linears, for the FP8 tests of sibling groups and weight codes: q/k/v read
one x and gate/up another (the shared inputs), o_proj and down_proj read their own; ragged 128-blocks on every dim."""

import torch
from torch import nn


class DecoderBlock(nn.Module):
    def __init__(self, k=200, nq=256, nkv=70, inter=300, o_bias=False):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj, self.self_attn.k_proj = nn.Linear(k, nq, bias=False), nn.Linear(k, nkv, bias=False)
        self.self_attn.v_proj, self.self_attn.o_proj = nn.Linear(k, nkv, bias=False), nn.Linear(nq, k, bias=o_bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(k, inter, bias=False), nn.Linear(k, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, k, bias=False)

    def forward(self, x):
        a = self.self_attn
        q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        h = x + a.o_proj(q * (k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True)))
        m = self.mlp
        return h + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))
