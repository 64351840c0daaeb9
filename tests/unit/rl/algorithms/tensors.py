"""Small tensor helpers shared by the algorithm tests (not a test module)."""

from __future__ import annotations

import torch

GARBAGE = 100.0  # written outside the mask: must never reach an output


def t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> bool:
    return torch.allclose(actual, t(expected), atol=atol, rtol=1e-5)
