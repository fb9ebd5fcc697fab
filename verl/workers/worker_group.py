"""A group of Ray actors, one per data-parallel rank, driven from the trainer process."""

from __future__ import annotations

from typing import Any

import ray

from verl.protocol import DataProto
from verl.workers.placement import Placement


class RayWorkerGroup:
    """Starts `world_size` copies of `worker_cls` as Ray actors (rank i in `placement`'s bundle i
    when given) and dispatches calls to them."""

    def __init__(
        self,
        worker_cls: type,
        world_size: int,
        *args: Any,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        placement: Placement | None = None,
        **kwargs: Any,
    ) -> None:
        remote_cls = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)(
            worker_cls
        )
        self.world_size = world_size
        self.workers = [
            remote_cls.options(**({"scheduling_strategy": placement.slot(rank)} if placement else {}))
            .remote(*args, rank=rank, world_size=world_size, **kwargs)
            for rank in range(world_size)
        ]  # fmt: skip
        addr, port = ray.get(self.workers[0].master_address.remote())
        self.execute_all("init_distributed", addr, port)

    def submit_all(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call `method` on every rank with the same arguments, without waiting: refs in rank order."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank with the same arguments; results in rank order."""
        return ray.get(self.submit_all(method, *args, **kwargs))

    def execute_dp(self, method: str, data: DataProto, **kwargs: Any) -> list[Any]:
        """Split `data` evenly across ranks (padding with repeated rows), call `method`; per-rank results."""
        padded, pad = data.pad_to_divisor(self.world_size)
        chunks = padded.chunk(self.world_size)
        results = ray.get(
            [
                getattr(w, method).remote(c, **kwargs)
                for w, c in zip(self.workers, chunks, strict=True)
            ]
        )
        self._last_pad = pad
        return results

    def dispatch(self, method: str, data: DataProto, **kwargs: Any) -> DataProto:
        """Split, call, concatenate the per-rank DataProtos and drop the padding rows."""
        results = self.execute_dp(method, data, **kwargs)
        return DataProto.concat(results).unpad(self._last_pad)

    def shutdown(self) -> None:
        """Kill the Ray actors."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def reduce_metrics(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """Mean over ranks and over each metric's list of per-mini-batch values."""
    keys = per_rank[0].keys()
    return {k: sum(sum(m[k]) / max(len(m[k]), 1) for m in per_rank) / len(per_rank) for k in keys}
