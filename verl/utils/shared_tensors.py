"""Tensors that Ray shares instead of copying: numpy arrays in a Ray object are mapped by every
reader straight from the node's shared object store (zero-copy, read-only), while torch tensors
are copied into each reader's private memory. Weight sync sends its buckets this way, so that
a rollout replica's memory grows by nothing per bucket it loads."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch

_BITS = {torch.bfloat16: torch.int16}
"""Dtypes numpy lacks -> the integer dtype of the same width whose bits carry them."""

SharedTensors = dict[str, tuple[np.ndarray, torch.dtype]]


def to_shared(tensors: dict[str, torch.Tensor]) -> SharedTensors:
    """CPU tensors as (numpy array, torch dtype) pairs, bit for bit (no copy here either)."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        out[name] = ((t.view(_BITS[t.dtype]) if t.dtype in _BITS else t).numpy(), t.dtype)
    return out


def from_shared(arrays: SharedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views of `to_shared`'s arrays, in order: read-only memory, so a reader must
    copy out of them (as a weight loader does) and never write into them."""
    for name, (array, dtype) in arrays.items():
        with warnings.catch_warnings():  # torch warns that the array is not writable: by design
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(array)
        yield name, t.view(dtype) if dtype in _BITS else t
