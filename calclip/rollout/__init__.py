"""Rollouts: how the policy generates the completions it trains on.

- ``vllm_sync``: the vLLM engine set-up per precision recipe and the FP8 weight sync through TRL's own paths.
- ``vllm_direct_sync``: in-place weight syncs into a colocated engine once its layout is checked.
- ``generation_cache``: one static KV cache per batch size kept across ``generate`` calls.
- ``positions``: the trainer's log-prob forwards use the positions ``generate`` used.
- ``compiled_layers``: the policy's decoder layers compiled for the training forwards, rollouts eager.

With ``trainers/``, the only room that knows TRL. Modules are imported by their full path; nothing is re-exported.
"""
