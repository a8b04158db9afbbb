"""Autoregressive generation over decode caches: one prefill, then a jit-compiled decode step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

__all__ = ["generate", "sample_next"]

LogitsFn = Callable[..., tuple[Float[Array, "batch seq vocab"], Any]]


def sample_next(
    logits: Float[Array, "batch vocab"], temperature: float | Float[Array, ""], key: Array
) -> Int[Array, " batch"]:
    """Greedy where ``temperature == 0`` (ties to the lower token id), otherwise a softmax
    sample at ``temperature``. ``temperature`` may be traced, so one compiled step serves both."""
    t = jnp.asarray(temperature, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    return jnp.where(t > 0, jax.random.categorical(key, scaled), greedy).astype(jnp.int32)


def _prefill(fn, tokens, caches, lengths, temperature, key):
    if lengths is None:
        logits, caches = fn(tokens, caches)
        last = logits[:, -1]
    else:
        logits, caches = fn(tokens, caches, lengths)
        last = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], 1)[:, 0]
    return sample_next(last, temperature, key), caches


def _decode(fixed, state, key):
    """One decode step on ``state = (caches, tokens so far [B, new], step)``, which is donated
    (``fixed = (logits_fn, temperature)`` is not)."""
    fn, temperature = fixed
    caches, out, i = state
    logits, caches = fn(jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1), caches)
    token = sample_next(logits[:, -1], temperature, key)
    return caches, jax.lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1), i + 1


_prefill = eqx.filter_jit(_prefill)
_decode = eqx.filter_jit(_decode, donate="all-except-first")


def generate(
    model: LogitsFn,
    prompt: Int[ArrayLike, "batch seq"],
    max_new_tokens: int,
    *,
    caches: Any = None,
    max_length: int | None = None,
    prompt_lengths: Int[ArrayLike, " batch"] | None = None,
    temperature: float = 0.0,
    key: Array | None = None,
) -> tuple[Int[Array, "batch new"], Any]:
    """Generate ``max_new_tokens`` tokens after a (right-padded) prompt.

    ``model`` is either an object with ``init_caches(batch, max_length)`` and
    ``extend(tokens, caches, lengths=None) -> (logits, caches)`` (the demo's ``DecoderLM``)
    or any such ``logits_fn(tokens_chunk, caches[, lengths])``; then pass ``caches``. It is
    called with ``lengths`` only for a padded prompt: ``prompt_lengths`` gives each row's real
    prompt length (default: all of ``prompt``). Pass a pytree callable (an Equinox module or its
    bound method) so its arrays are traced, not baked in as constants. The prefill and the
    decode step are each compiled once (``eqx.filter_jit``, ``temperature`` is traced); the
    decode step donates the caches.

    **Arguments:**

    - ``model``, ``caches``: as above.
    - ``prompt``: int ``[B, S]`` token ids, right-padded.
    - ``max_new_tokens``: tokens to generate per row.
    - ``max_length``: cache size (default: prompt length + ``max_new_tokens``).
    - ``prompt_lengths``: real prompt length per row ``[B]``.
    - ``temperature``: 0 for greedy, else sampling (needs ``key``).
    - ``key``: PRNG key for sampling.

    **Returns:**

    ``(tokens, caches)``: int32 new tokens ``[B, max_new_tokens]`` and the final caches.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive (got {max_new_tokens})")
    prompt = jnp.asarray(prompt)
    b, s = prompt.shape
    fn = getattr(model, "extend", model)
    if caches is None:
        if not hasattr(model, "init_caches"):
            raise ValueError("pass caches= when model is a plain logits function")
        caches = model.init_caches(b, max_length or s + max_new_tokens)
    lengths = None if prompt_lengths is None else jnp.asarray(prompt_lengths, jnp.int32)
    if temperature < 0 or (temperature > 0 and key is None):
        raise ValueError("temperature must be >= 0, and sampling (temperature > 0) needs a key")
    keys = jax.random.split(jax.random.key(0) if key is None else key, max_new_tokens)
    temperature = jnp.float32(temperature)
    token, caches = _prefill(fn, prompt, caches, lengths, temperature, keys[0])
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(token)
    state = (caches, out, jnp.ones((), jnp.int32))
    for i in range(1, max_new_tokens):
        state = _decode((fn, temperature), state, keys[i])
    return state[1], state[0]
