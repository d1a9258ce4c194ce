"""Activations the models and the fusion patterns share (one definition, so a pattern matches what the
model traces)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Gemma's gelu_pytorch_tanh."""
    return F.gelu(x, approximate="tanh")
