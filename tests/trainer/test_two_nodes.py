"""Two guided steps on a two-node Ray cluster started on this machine (`ray.cluster_utils`): the
trainer's placement groups put one FSDP rank and one draft replica on each node, and the guidance
services either beside the replicas (colocated) or in bundles of their own on each node
(`offpolicy_guidance.n_gpus_per_node`, dedicated GPUs on a GPU cluster); the run trains. The
colocated run is MENTOR's recipe, the dedicated one MENTOR's exact recipe, checked as the other
2-step runs of test_e2e_training.py are."""

from __future__ import annotations

import json

import pytest
from test_e2e_training import (
    MENTOR_RUNS,
    assert_trained,
    check_mentor,
    check_run,
    mentor_overrides,
    overrides,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster():
    """A two-node Ray cluster on this machine, shared by the module's tests. 2 CPUs a node: one
    bundle of a rank and a replica (1.5) fits, two do not; a dedicated guidance bundle (0.5) fits
    beside it."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), (
        "another Ray session is still up: the runs would not join the cluster"
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="class")
def two_nodes(cluster):
    """This process joined to the module's two-node cluster (`RAY_ADDRESS`), shared by the runs
    of `TestRunsJoinedToTheCluster` (each trainer removes its placement groups when it shuts
    down), and left after them."""
    import ray

    from verl.trainer.config import load_config
    from verl.trainer.main import start_ray

    assert not ray.is_initialized(), (
        "another Ray session is still up: the run would not join the cluster"
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_ADDRESS", cluster.address)
            start_ray(load_config())  # joins RAY_ADDRESS
            yield cluster
    finally:
        ray.shutdown()


class TestRunsJoinedToTheCluster:
    """The two-node runs, joined to the module's cluster. (A driver that started a Ray of its own
    beside the cluster and left it cannot join the cluster after: its actors are cancelled before
    they start. So `test_without_ray_address_...` runs after the class, once it has left.)"""

    @pytest.mark.parametrize(("dedicated", "recipe"), [(0, "mentor"), (1, "mentor_exact")],
                             ids=["colocated+mentor", "dedicated+mentor_exact"])  # fmt: skip
    def test_two_guided_steps_spread_over_two_nodes(
        self, assets, tmp_path, two_nodes, dedicated, recipe
    ):
        """Each placement runs one of MENTOR's recipes (orthogonal to where the workers are), so
        that both recipes' 2-step runs cost no run of their own. Colocated: a node's bundle holds
        its rank, its draft replica and that one's guidance. Dedicated: the draft replicas and the
        guidance engines each in slots of their own, on their rank's node (the async GPU
        launcher's layout)."""
        import ray

        from verl.trainer.config import load_config
        from verl.trainer.main import prepare
        from verl.trainer.ray_trainer import RayPPOTrainer

        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        run_dir = str(tmp_path / "run")
        extra = mentor_overrides(recipe, trainer={"nnodes": 2, "n_gpus_per_node": 1, "val_before_train": False},
                                 worker={"rollout": {"num_replicas": 2, "n_gpus_per_node": dedicated,
                                                     "offpolicy_guidance": {"n_gpus_per_node": dedicated}}})  # fmt: skip
        trainer = None
        try:
            prepared = prepare(load_config(overrides=overrides(assets, run_dir, **extra)))
            trainer = RayPPOTrainer(prepared.config, prepared.train, prepared.val, prepared.reward,
                                    prepared.val_reward)  # fmt: skip
            trainer.init_workers()
            ranks = [
                (e["node_id"], e["placement_group"])
                for e in trainer.actor_wg.execute_all("environment")
            ]
            replicas = ray.get([r.node_id.remote() for r in trainer.rollout.replicas])
            services = trainer.rollout.service_where
            groups = {
                "main": [g.id.hex() for g in trainer.placement.groups],
                "guidance": [g.id.hex() for g in trainer.guidance_placement.groups]
                if dedicated
                else [],
            }
            if dedicated:  # the drafts' own slots, one group per node, each on its ranks' node
                draft_nodes = [trainer.rollout_placement.node_of(i) for i in range(2)]
            else:
                assert trainer.rollout_placement is None
            trainer.fit()
        finally:
            if trainer is not None:
                trainer.shutdown()
        nodes = [node for node, _ in ranks]
        # rank 0 on one node, rank 1 on the other, each in its node's group
        assert len(set(nodes)) == 2
        assert [group for _, group in ranks] == groups["main"]
        assert replicas == nodes  # each draft replica beside its rank (in its bundle, or its own)
        if dedicated:
            assert draft_nodes == nodes
        # each guidance service on its replica's node, in its replica's bundle, or in a
        # dedicated guidance bundle of that node
        assert [node for node, _ in services] == nodes
        if dedicated:
            assert sorted(group for _, group in services) == sorted(groups["guidance"])
        else:
            assert [group for _, group in services] == groups["main"]
        with open(f"{run_dir}/experiment_log.jsonl") as f:
            rows = [json.loads(line) for line in f]
        # steps 1 and 2, every key documented
        steps = check_run(recipe, rows, MENTOR_RUNS[recipe][1])
        check_mentor(recipe, steps)
        assert_trained(assets, run_dir, rows)


def test_without_ray_address_a_run_starts_its_own_ray_beside_a_running_one(cluster, monkeypatch):
    """A local Ray cluster already runs (another job's, or a test's: here the module's two-node
    cluster, which the runs above have left) and RAY_ADDRESS is unset: `start_ray` starts a Ray
    of its own instead of joining that one (which fails: a joined cluster refuses `num_cpus`)."""
    import ray

    from verl.trainer.config import load_config
    from verl.trainer.main import start_ray

    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        start_ray(load_config())
        assert ray.get_runtime_context().gcs_address != cluster.address
        # its own single node, with its own CPU count, not the other cluster's two nodes
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 1 and ray.cluster_resources()["CPU"] >= 2
    finally:
        ray.shutdown()
