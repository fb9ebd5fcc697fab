"""Where the trainer's Ray actors run: one placement group per node, one bundle per GPU (EasyR1's
hybrid engine). Bundle i of node n holds FSDP rank n * per_node + i, and with it its share of a
draft replica and of that replica's guidance service, so a GPU's actors stay on that GPU's node.

Used when the run spans nodes (`trainer.nnodes > 1`) or GPUs; a one-node CPU run lets Ray place
its few actors itself. Draft and guidance engines on GPUs of their own get placements of their
own, node by node beside the ranks' (`near`). The placement groups are created before any actor, and a cluster that
cannot hold them fails in `PLACEMENT_TIMEOUT_S` with one line instead of waiting forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_TIMEOUT_S = 120.0
"""Seconds to wait for the cluster to grant every node's bundles."""


@dataclass
class Placement:
    """Per-node placement groups of `per_node` bundles of `bundle` resources each."""

    groups: list[PlacementGroup]
    per_node: int
    bundle: dict[str, float]

    @classmethod
    def create(
        cls, nnodes: int, per_node: int, bundle: dict[str, float], near: Placement | None = None
    ) -> Placement:
        """Reserve the bundles (STRICT_PACK: a node's bundles on one node); one line on failure.
        `near`: group i asks for the node of `near`'s group i (dedicated draft or guidance GPUs
        beside their node's ranks; a hint, Ray's `_soft_target_node_id`: elsewhere when that node
        is full)."""
        targets = [near.node_of(i * near.per_node) if near is not None and near.groups else None
                   for i in range(nnodes)]  # fmt: skip
        groups = [placement_group([dict(bundle)] * per_node, strategy="STRICT_PACK", _soft_target_node_id=target)
                  for target in targets]  # fmt: skip
        ready, _ = ray.wait(
            [g.ready() for g in groups], num_returns=nnodes, timeout=PLACEMENT_TIMEOUT_S
        )
        if len(ready) < nnodes:
            for g in groups:
                remove_placement_group(g)
            raise RuntimeError(
                f"the Ray cluster granted {len(ready)} of trainer.nnodes = {nnodes} nodes of "
                f"trainer.n_gpus_per_node = {per_node} bundles of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; `ray status` shows what it has"
            )
        return cls(groups, per_node, dict(bundle))

    def slot(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy that puts an actor in rank `rank`'s bundle."""
        group = self.groups[rank // self.per_node]
        return PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank % self.per_node
        )

    def node_of(self, rank: int) -> str:
        """The Ray node of rank `rank`'s bundle."""
        from ray.util import placement_group_table

        table = placement_group_table(self.groups[rank // self.per_node])
        return table["bundles_to_node_id"][rank % self.per_node]

    def ranks_by_node(self, nodes: list[str | None]) -> list[int]:
        """A distinct bundle (its rank) for each of `nodes`, on that node where one is left
        (dedicated guidance slots follow their draft replicas' nodes); else the first free one."""
        free = list(range(len(self.groups) * self.per_node))
        where = {rank: self.node_of(rank) for rank in free}
        picks = []
        for node in nodes:
            rank = next((r for r in free if where[r] == node), free[0])
            free.remove(rank)
            picks.append(rank)
        return picks

    def replica_rank(self, replica: int, num_replicas: int) -> int:
        """The rank whose bundle holds draft replica `replica` (replicas spread evenly over
        ranks: with tensor-parallel width w, replica j's first GPU is rank j * w)."""
        return replica * len(self.groups) * self.per_node // num_replicas

    def remove(self) -> None:
        """Give the bundles back (after the actors in them are gone)."""
        for g in self.groups:
            remove_placement_group(g)
        self.groups = []
