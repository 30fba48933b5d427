"""Comparing tensors on any x86 CPU: tolerances follow the tensors' scale.

Two float32 computations that differ only in summation order (a chunked loss against the full one,
checkpointed against plain, FSDP2 shards against a replicated tensor) agree to a few ulps of the
largest values they sum, not of each element: an element near zero can be off by 1e-6 when its
tensor's largest value is 2. A fixed `atol` passes on the CPU a test was written on and fails on
another (other SIMD widths, other BLAS blocking). So the absolute tolerance here is `atol` times
the expected tensor's largest magnitude; a real bug (a missing average, a wrong scale, a mask
left out) moves values by a large fraction of that scale, far outside it."""

from __future__ import annotations

import torch


def scale_of(tensor: torch.Tensor) -> float:
    """The largest magnitude in `tensor` (1.0 for an empty or all-zero one: then atol is absolute)."""
    if not tensor.numel():
        return 1.0
    return float(tensor.detach().abs().max()) or 1.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, msg=None) -> None:
    """torch.testing.assert_close with the absolute tolerance `atol x max|expected|`."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale_of(expected), msg=msg)
