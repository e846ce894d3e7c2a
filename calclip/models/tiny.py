"""The tiny model that ``model_name_or_path: tiny`` names: a character-level chat tokenizer built locally and a
randomly initialized Llama sized for CPU runs (``calclip demo --model tiny``, ``calclip diagnose``, the tests).

Nothing here touches a model hub. The tokenizer is a ``tokenizers`` WordLevel model over single characters
(digits, lowercase letters, a few symbols), wrapped in ``PreTrainedTokenizerFast`` with ChatML-style special
tokens and a chat template, so TRL's conversational prompt path runs exactly as with a real model.
"""

from __future__ import annotations

import string

import torch

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|im_start|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)
CHARACTERS = string.digits + string.ascii_lowercase + " +-*=?.,:\n"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` with one token per character plus ChatML special tokens (vocab ~50).

    Left padding and truncation, as TRL's GRPO expects for prompts; ``pad`` and ``eos`` are distinct tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        truncation_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer=None,
    *,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A randomly initialized ``LlamaForCausalLM`` matching ``tokenizer`` (default: ``build_tiny_tokenizer()``).

    hidden_size 128 makes every linear layer one or two whole 128x128 FP8 blocks; pass 192 to exercise ragged
    blocks. Untied embeddings, so the LM head stays a separate (BF16-kept) layer as in most real checkpoints.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from calclip.models.dtype import cast_model_dtype

    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cast_model_dtype(LlamaForCausalLM(config), dtype)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model
