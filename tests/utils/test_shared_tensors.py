"""Weight-sync buckets travel as numpy arrays: bit-exact round trips, and Ray hands readers
read-only views of its object store (zero-copy) rather than private copies."""

import numpy as np
import pytest
import ray
import torch

from verl.utils.shared_tensors import from_shared, to_shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_round_trip_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": (torch.randn(3, 5, generator=g) * 100).to(dtype),
        "b": torch.arange(4).to(dtype),
    }
    back = dict(from_shared(to_shared(tensors)))
    assert list(back) == ["a", "b"]
    for k, t in tensors.items():
        assert back[k].dtype == dtype and back[k].shape == t.shape
        assert torch.equal(back[k].view(torch.uint8), t.view(torch.uint8))  # same bits


def test_bf16_travels_as_its_int16_bits():
    ((array, dtype),) = to_shared({"w": torch.tensor([1.0, -2.0], dtype=torch.bfloat16)}).values()
    # bf16 1.0 = 0x3F80 = 16256; -2.0 = 0xC000 = -16384 as int16
    assert dtype == torch.bfloat16 and array.dtype == np.int16 and array.tolist() == [16256, -16384]


def test_ray_readers_map_the_bucket_instead_of_copying_it():
    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
    )
    try:
        ref = ray.put(to_shared({"w": torch.ones(256, 1024)}))  # 1 MiB: stored in shared memory
        ((array, _),) = ray.get(ref).values()
        assert not array.flags.writeable  # a view of the object store, not a private copy
        name, tensor = next(from_shared(ray.get(ref)))
        assert name == "w" and float(tensor.sum()) == 256 * 1024
    finally:
        ray.shutdown()
