"""Moving stored keys to other positions: RoPE re-rotation (the exact part of chunk reuse).

A key stored after RoPE at position ``p`` is ``s R(p) k`` (``R`` rotates channel pair
``(i, i + head_dim / 2)`` by ``p * inv_freq[i]``, ``s`` the model's attention scaling).
Rotations compose, ``R(p + d) = R(d) R(p)``, so the key the model would have computed at
position ``p + d`` is ``R(d)`` applied to the stored one, with no scaling: exact up to
floating-point rounding, and no need for the pre-RoPE key.
"""

from __future__ import annotations

import torch

from kvlib.policy import Rope


def rerotate(keys: torch.Tensor, shift: torch.Tensor | int, rope: Rope) -> torch.Tensor:
    """``keys`` (after RoPE, ``[..., tokens, head_dim]``) as if each token sat ``shift`` positions
    later (int, or int ``[..., tokens]`` broadcastable; negative moves earlier). Computed in float64
    and returned in ``keys``' dtype."""
    half = keys.shape[-1] // 2
    if rope.inv_freq.numel() != half:
        raise ValueError(f"rope covers {2 * rope.inv_freq.numel()} channels, keys have {keys.shape[-1]}")
    shift = torch.as_tensor(shift, device=keys.device)
    angle = shift.to(torch.float64).unsqueeze(-1) * rope.inv_freq.to(keys.device, torch.float64)  # [..., tokens, half]
    cos, sin = angle.cos(), angle.sin()
    x = keys.to(torch.float64)
    first, second = x[..., :half], x[..., half:]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(keys.dtype)
