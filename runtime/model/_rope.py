"""Rotary position embedding: frequency tables (default, linear, YaRN) and their application.

Mirrors transformers' `modeling_rope_utils` and each family's `apply_rotary_pos_emb`, in float32.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ._config import RopeConfig, yarn_get_mscale


def inv_freq(rope: RopeConfig) -> tuple[np.ndarray, float]:  # -> [dim/2] f32, cos/sin scaling
    """Inverse frequencies and the factor transformers multiplies cos and sin by."""
    dim, base = rope.dim, rope.theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = (np.float32(base) ** exponents).astype(np.float32)
    if rope.kind == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    if rope.kind == "linear":
        return (1.0 / pos_freqs / np.float32(rope.factor)).astype(np.float32), 1.0
    if rope.kind == "llama3":  # transformers' `_compute_llama3_parameters`
        return _llama3(rope, (1.0 / pos_freqs).astype(np.float32)), 1.0
    # YaRN (arXiv:2309.00071), as transformers' `_compute_yarn_parameters`.
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (1 - ramp).astype(np.float32)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (np.float32(factor) * pos_freqs)
    freqs = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return freqs.astype(np.float32), float(attention_factor)


def _llama3(rope: RopeConfig, freqs: np.ndarray) -> np.ndarray:
    """# [dim/2] -> [dim/2]: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    old, low, high = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
    factor = np.float32(rope.factor)
    wavelen = np.float32(2 * math.pi) / freqs
    low_wavelen, high_wavelen = np.float32(old / low), np.float32(old / high)
    scaled = np.where(wavelen > low_wavelen, freqs / factor, freqs)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    if high > low:  # equal factors leave no medium band (transformers' ramp would divide by zero, unused)
        smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
        scaled = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return scaled.astype(np.float32)


def cos_sin(freqs: np.ndarray, scaling: float, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """# [dim/2], [T] -> cos [T, dim], sin [T, dim] (the angle table repeated twice, as transformers builds it)."""
    angles = positions.astype(np.float32)[:, None] * freqs[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    if scaling != 1.0:  # (times 1 changes no value: skipped)
        cos *= np.float32(scaling)
        sin *= np.float32(scaling)
    return cos.astype(np.float32, copy=False), sin.astype(np.float32, copy=False)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """# [T, h, d], [T, d], [T, d] -> [T, h, d]; rotate_half pairs channel i with i + d/2."""
    d = x.shape[-1]
    # rotate_half(x) * sin as x[..., swap] * (sign * sin): (-a) * b and a * (-b) are the same float32 product, and one
    # gather plus a [T, d] product costs less than negating and concatenating the halves of every head.
    rotated = x.take(_swapped_halves(d), axis=-1)  # [T, h, d]: second half, then first
    rotated *= (sin * _sign_first_half(d))[:, None, :]
    out = x * cos[:, None, :]
    out += rotated
    return out


@functools.cache
def _swapped_halves(d: int) -> np.ndarray:  # -> [d] indices: d/2 .. d-1, then 0 .. d/2-1 (read-only)
    swap = np.concatenate([np.arange(d // 2, d), np.arange(d // 2)])
    swap.flags.writeable = False
    return swap


@functools.cache
def _sign_first_half(d: int) -> np.ndarray:  # -> [d] float32: -1 where rotate_half negates, then 1 (read-only)
    sign = np.ones(d, np.float32)
    sign[:d - d // 2] = -1
    sign.flags.writeable = False
    return sign


def apply_rope_interleave(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """# [T, h, d], [T, d], [T, d] -> [T, h, d]; DeepSeek pairs (x0, x1), (x2, x3)...

    Like transformers' `apply_rotary_pos_emb_interleave` the result is de-interleaved (evens, then odds); q and
    k get the same permutation, so their dot products are unchanged.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
