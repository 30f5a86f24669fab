"""Stochastic rounding from float32 to bfloat16, for optimiser states kept in bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _mix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def stochastic_round_bfloat16(x: jax.Array, salt: jax.Array) -> jax.Array:
    """float32 -> bfloat16, rounded up with probability equal to the distance to the lower value
    (so unbiased: E[result] = x).

    Why: an EMA's per-step change (1 - beta) * (s - ema) is below half a bfloat16 ulp once ema is
    a few hundred times larger than it, so round-to-nearest never moves it again (beta 0.999 and a
    constant input 1 stall at 0.25). Rounded stochastically the EMA follows the float32 one in
    expectation, with noise of a few ulps. The random bits are a hash of each element's index
    and ``salt`` (a uint32, e.g. from the step): integer ops that fuse into the update's pass,
    the same on any sharding, and far cheaper than a PRNG draw of K x P values.
    """
    index = jnp.zeros(x.shape, jnp.uint32)
    for axis, size in enumerate(x.shape):
        index = index * np.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    noise = _mix32(index * np.uint32(0x9E3779B1) + _mix32(jnp.asarray(salt, jnp.uint32))) >> 16
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    truncated = jax.lax.bitcast_convert_type((bits + noise) & np.uint32(0xFFFF0000), jnp.float32)
    return truncated.astype(jnp.bfloat16)  # exact: the low 16 bits are zero
