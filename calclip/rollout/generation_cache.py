"""One static KV cache kept across the trainer's HF ``generate`` rollouts (``compile_generation``).

``generate(cache_implementation="static")`` builds a new ``StaticCache`` on every call and marks its tensors as
static addresses. Inductor's CUDA-graph trees check those addresses on every replay; when a rollout's new cache lands
elsewhere in memory (a training step between rollouts frees and allocates gigabytes), every decode step of that
rollout is re-recorded instead of replayed (``Re-recording function=partition_0, reason=static input data pointer
changed``; seen on the H200 for BF16 and FP8 alike: every decode step re-recorded, docs/benchmarks-log.md, eighth
session). Passing the same cache to every call, reset in place, keeps the addresses, so the graphs recorded by the
first rollout replay in all later ones.

``KeptStaticCache.attached(model)`` wraps ``model.generate`` for one call of TRL's generation (like the log-prob
recorder, as an instance attribute removed afterwards): when the call would build a static cache itself
(``cache_implementation="static"``, greedy/sampling, no cache of the caller's), it passes the kept cache instead,
``reset()`` first, so the call starts empty as it would have. One cache is kept per batch size (two at most); a new
one is built for a new batch size, or when a call needs more positions than the kept one holds (then with the larger
length: transformers itself keeps the largest length seen). Lengths are rounded up to a multiple of ``granularity``
(64) positions, so prompts of varying length (TRL pads each batch to its longest) rarely need a new cache, i.e. new
graphs. Tokens are those of transformers' own static cache (tests/rollout/test_generation_cache.py). Memory: the
caches stay allocated between rollouts, i.e. during the training steps; ``release()`` frees them (the trainer does at
the end of ``train``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect


@contextlib.contextmanager
def generate_wrapped(model, wrap):
    """``model.generate = wrap(model.generate)`` for the block, as an instance attribute, then back to what it was (the
    class method, or an instance attribute some caller had put there): how calclip adds to one TRL generation call
    without touching TRL's own call or its arguments."""
    original = model.generate
    had_instance_attribute = "generate" in vars(model)
    model.generate = wrap(original)
    try:
        yield
    finally:
        if had_instance_attribute:
            model.generate = original
        else:
            del model.generate  # back to the class method


def _cache_keyword(model) -> str:
    """The generate keyword for a cache object: ``cache`` where the model's forward takes one by that name (recent
    transformers, where ``past_key_values`` still works with a deprecation warning), else ``past_key_values``. Read
    off the forward of the model under a PEFT wrapper, whose own methods take ``**kwargs``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


_SETTINGS = ("cache_implementation", "max_new_tokens", "max_length", "num_beams", "num_return_sequences")


class KeptStaticCache:
    """Static caches kept across ``generate`` calls, one per batch size (at most ``max_kept``: training and
    evaluation rollouts usually differ in batch size; the least recently used one goes first)."""

    def __init__(self, max_kept: int = 2, granularity: int = 64) -> None:
        self.max_kept, self.granularity = max_kept, granularity
        self.caches: dict[int, tuple[object, int]] = {}  # batch size -> (StaticCache, max_cache_len)
        self.built = 0  # caches built (a new batch size, or a call needing more positions than its cache holds)
        self.reused = 0  # calls that got a kept cache again

    def release(self) -> None:
        self.caches.clear()

    def _cache_for(self, model, batch: int, needed: int):
        from transformers import StaticCache

        cache, length = self.caches.pop(batch, (None, 0))
        if cache is None or needed > length:
            length = -(-max(needed, length) // self.granularity) * self.granularity
            config = model.config.get_text_config(decoder=True)  # what transformers sizes its own static cache by
            cache = StaticCache(config=config, max_cache_len=length)
            self.built += 1
        else:
            cache.reset()
            self.reused += 1
        self.caches[batch] = (cache, length)  # most recently used last
        while len(self.caches) > self.max_kept:
            self.caches.pop(next(iter(self.caches)))
        return cache

    def attached(self, model):
        """A context in which ``model.generate`` takes the kept caches (module docstring)."""
        cache_kwarg = _cache_keyword(model)
        return generate_wrapped(model, lambda original: self._wrap(model, original, cache_kwarg))

    def _wrap(self, model, original, cache_kwarg: str):
        def generate(*args, **kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
            settings = {name: kwargs.get(name, getattr(config, name, None)) for name in _SETTINGS}
            if (input_ids is None or settings["cache_implementation"] != "static"
                    or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
                    or (settings["num_beams"] or 1) != 1):
                return original(*args, **kwargs)
            prompt_length = input_ids.shape[-1]
            needed = (prompt_length + settings["max_new_tokens"] if settings["max_new_tokens"] is not None
                      else settings["max_length"])  # max_length includes the prompt
            if needed is None:
                return original(*args, **kwargs)
            batch = input_ids.shape[0] * (settings["num_return_sequences"] or 1)
            # transformers refuses a cache object together with an implementation to build one; the caller's config
            # (or the model's) is copied, not changed
            kwargs.pop("cache_implementation", None)
            if config is not None and config.cache_implementation is not None:
                kwargs["generation_config"] = copy.copy(config)
                kwargs["generation_config"].cache_implementation = None
            kwargs[cache_kwarg] = self._cache_for(model, batch, needed)
            return original(*args, **kwargs)

        return generate
