"""The evidence script's bookkeeping: curves, thresholds and the table, on hand-made logs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scripts import load

E = load("evidence")


def log(accs: dict[int, float], step_s: float, extra: dict | None = None) -> list[dict]:
    """An experiment log: validation at the steps of `accs`, every step taking `step_s` seconds."""
    rows = [{"step": 0, "val/reward_score": accs[0]}]
    for step in range(1, max(accs) + 1):
        row = {"step": step, "perf/time_per_step": step_s, **(extra or {})}
        if step in accs:
            row["val/reward_score"] = accs[step]
        rows.append(row)
    return rows


def test_curve_and_threshold_by_hand():
    c = E.curve(log({0: 0.2, 2: 0.5, 4: 0.7}, step_s=1.5))
    assert c["step"] == [0, 2, 4] and c["accuracy"] == [0.2, 0.5, 0.7]
    assert c["seconds"] == [0.0, 3.0, 6.0]  # 2 and 4 steps of 1.5 s
    assert c["s_per_step"] == [1.5]
    # halfway from 0.2 to 1 is 0.6: first reached at step 4
    assert E.steps_to(0.6, c) == 4 and E.steps_to(0.8, c) is None
    assert E.is_complete(log({0: 0.2, 4: 0.7}, 1.0), 4)
    assert not E.is_complete(log({0: 0.2, 4: 0.7}, 1.0), 5)


def test_summary_over_seeds_by_hand():
    diag = {"guidance/offpolicy_token_ratio": 0.1, "guidance/guided_score_gap": 0.5,
            "guidance/lambda_mean": 0.25, "guidance/subset_guided_score": 0.75,
            "guidance/subset_unguided_score": 0.5}  # fmt: skip
    logs = {
        ("weak", "grpo", 0): log({0: 0.2, 2: 0.35, 4: 0.5}, 2.0),
        ("weak", "grpo", 1): log({0: 0.2, 2: 0.62, 4: 0.7}, 4.0),
        ("weak", "spec_exact", 0): log({0: 0.2, 2: 0.3, 4: 0.38}, 3.0, diag),
    }
    table = E.summarize(logs, steps=4)
    grpo, spec_ = table
    assert (grpo["cell"], spec_["cell"]) == ("grpo", "spec_exact")  # the CELLS order
    # finals 0.5, 0.7: mean 0.6, sample std sqrt(((0.1)² + (0.1)²)/1) = 0.1414
    assert grpo["final_mean"] == pytest.approx(0.6)
    assert grpo["final_std"] == pytest.approx(0.02**0.5)
    assert (grpo["final_min"], grpo["final_max"]) == (0.5, 0.7)
    # thresholds 0.2 + 0.2 = 0.4: seed 0 at step 4 (0.35 < 0.4 at step 2), seed 1 at step 2;
    # 0.2 + 0.4 = 0.6: seed 0 never (0.5 at most), seed 1 at step 2 (0.62)
    assert grpo["thresholds"] == pytest.approx([0.4, 0.6])
    assert grpo["steps_to_threshold"] == [[4, 2], [None, 2]] and grpo["reached"] == [2, 1]
    assert grpo["s_per_step"] == pytest.approx(3.0)  # mean of 2 and 4
    assert grpo["diagnostics"]["guidance/offpolicy_token_ratio"] is None
    assert spec_["diagnostics"]["guidance/guided_score_gap"] == pytest.approx(0.5)
    text = E.markdown(table, 4)
    assert (
        "| weak | plain GRPO (guidance off) | 2 | 20.0 | 60.0 ± 14.1 [50.0-70.0] | 3 (2/2) / 2 (1/2) | 3.00 |"
        in text
    )
    assert "| never (0/1) / never (0/1) |" in text  # spec_exact's best, 0.38, stays below 0.4
    assert (
        "| weak | speculative, exact μ, λ 0.5→0 | 10.0 | — | — | — | 0.250 | +0.500 | 0.750 / 0.500 |"
        in text
    )


def test_report_from_copied_logs_writes_table_and_plots(tmp_path):
    for seed, acc in enumerate((0.5, 0.7)):
        path = tmp_path / "logs" / "base" / "grpo" / f"seed{seed}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(json.dumps(r) for r in log({0: 0.3, 2: acc}, 1.0)) + "\n")
    text = E.report(tmp_path, steps=2, task="arithmetic")
    assert "| base | plain GRPO (guidance off) | 2 |" in text
    assert (tmp_path / "results.md").read_text() == text
    assert json.loads((tmp_path / "results.json").read_text())[0]["seeds"] == [0, 1]
    assert (tmp_path / "accuracy_base.png").stat().st_size > 10_000


def test_run_args_carry_the_cell_seed_and_models(tmp_path):
    cell = next(c for c in E.CELLS if c.name == "spec_provenance")
    args = E.run_args(cell, "/d", "/g", 2, 30, 5, tmp_path, ("data.rollout_batch_size=32",))
    assert args[1:3] == ["-m", "verl.trainer.main"]
    for must in ("worker.actor.model.model_path=/d", "worker.rollout.offpolicy_guidance.model_path=/g",
                 "data.seed=2", "worker.rollout.seed=2", "trainer.max_steps=30",
                 "worker.rollout.offpolicy_guidance.behavior=provenance", "data.rollout_batch_size=32"):  # fmt: skip
        assert must in args, must
    # the cell's own keys come after the shared ones, so provenance overrides SPEC's exact
    assert args.index("worker.rollout.offpolicy_guidance.behavior=provenance") > args.index(
        "worker.rollout.offpolicy_guidance.behavior=exact"
    )


def test_every_cell_validates_as_a_config(tmp_path):
    from verl.trainer.config import load_config
    from verl.utils.config_checks import ConfigError

    for cell in E.CELLS:
        for task, extra in E.TASK_SET.items():
            args = E.run_args(cell, "/d", "/g", 0, 30, 5, tmp_path, extra)
            if task == "toolchain" and any(a.endswith("mode=mix") for a in args):
                # multi-turn guides token by token: a mix cell is refused in one line
                with pytest.raises(
                    ConfigError, match="multi-turn rollouts are guided token by token"
                ):
                    load_config(args[3:])
                assert cell.name not in E.TASK_CELLS[task]
                continue
            if task == "toolchain" and "guide_failing" in cell.overlays:
                # multi-turn rollouts are guided in one stage: group_fails is refused in one line
                with pytest.raises(ConfigError, match="guided in one stage"):
                    load_config(args[3:])
                assert cell.name not in E.TASK_CELLS[task]
                continue
            config = load_config(args[3:])  # parses, merges and validates every key
            assert config.trainer.max_steps == 30, cell.name
            assert config.data.train_files == f"embedded://{E.EMBEDDED.get(task, task)}@train"
    assert set(E.TASK_SET) == set(E.TASK_DRAFTS)


def test_bad_cell_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        E.main(["--cells", "grpo,nope", "--report-only"])
    assert "nope" in capsys.readouterr().err


def _fake_run(run_dir: Path, steps: int, acc: float) -> list[str]:
    """A command that writes a complete run log (validation at 0 and `steps`) into `run_dir`."""
    rows = json.dumps(
        [{"step": 0, "val/reward_score": 0.1}, {"step": steps, "val/reward_score": acc}]
    )
    code = ("import json, sys; open(sys.argv[1], 'w').write("
            "''.join(json.dumps(r) + '\\n' for r in json.loads(sys.argv[2])))")  # fmt: skip
    return [sys.executable, "-c", code, str(run_dir / "experiment_log.jsonl"), rows]


def test_run_once_reuses_a_run_only_for_the_same_command(tmp_path):
    run_dir, dest = tmp_path / "runs" / "base" / "grpo" / "seed0", tmp_path / "logs" / "seed0.jsonl"
    assert E.run_once(_fake_run(run_dir, 2, 0.5), run_dir, dest, 2)  # ran
    assert E.read_log(dest)[-1]["val/reward_score"] == 0.5
    assert not E.run_once(_fake_run(run_dir, 2, 0.5), run_dir, dest, 2)  # same command: reused
    assert E.run_once(_fake_run(run_dir, 2, 0.7), run_dir, dest, 2)  # another command: ran again
    assert E.read_log(dest)[-1]["val/reward_score"] == 0.7
    with pytest.raises(SystemExit, match="failed"):  # a run that stops short is an error
        E.run_once(_fake_run(run_dir, 1, 0.7), run_dir, dest, 2)


def test_tune_picks_the_lr_with_the_best_mean_accuracy_after_step_0(tmp_path, monkeypatch):
    curves = {  # (cell, lr) -> validation accuracy at steps 0, 2, 4
        ("grpo", 5e-5): {0: 0.3, 2: 0.40, 4: 0.50},  # mean after 0: (0.40 + 0.50)/2 = 0.45
        ("grpo", 1e-4): {0: 0.3, 2: 0.50, 4: 0.52},  # (0.50 + 0.52)/2 = 0.51  <- pick
        ("grpo", 2e-4): {0: 0.3, 2: 0.35, 4: 0.60},  # (0.35 + 0.60)/2 = 0.475 (best final only)
        ("mix", 5e-5): {0: 0.3, 2: 0.45, 4: 0.55},  # 0.50  <- pick, the grid's lower edge, so
        ("mix", 1e-4): {0: 0.3, 2: 0.30, 4: 0.40},  # 0.35     2.5e-5 (= 5e-5 / (2e-4 / 1e-4))
        ("mix", 2e-4): {0: 0.3, 2: 0.90, 4: 0.05},  # 0.475    is tried too
        ("mix", 2.5e-5): {0: 0.3, 2: 0.35, 4: 0.45},  # 0.40: 5e-5 stays the pick
        ("distill", 5e-5): {0: 0.3, 2: 0.30, 4: 0.30},  # 0.30
        ("distill", 1e-4): {0: 0.3, 2: 0.40, 4: 0.40},  # 0.40
        ("distill", 2e-4): {0: 0.3, 2: 0.50, 4: 0.50},  # 0.50: upper edge -> 4e-4
        ("distill", 4e-4): {0: 0.3, 2: 0.60, 4: 0.60},  # 0.60: edge again -> 8e-4
        ("distill", 8e-4): {0: 0.3, 2: 0.70, 4: 0.70},  # 0.70: pick; TUNE_EXTEND (2) is spent
    }
    ran = []

    def fake_run_once(args, run_dir, dest, steps):
        cell = run_dir.parent.name
        lr = float(next(a for a in args if a.startswith("worker.actor.optim.lr=")).split("=")[1])
        assert "data.seed=99" in args and f"worker.actor.optim.lr={lr}" == args[-1]
        ran.append((cell, lr))
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("\n".join(json.dumps(r) for r in log(curves[(cell, lr)], 1.0)) + "\n")
        return True

    monkeypatch.setattr(E, "run_once", fake_run_once)
    cells = [
        c for c in E.CELLS if c.name in ("grpo", "mix", "distill", "spec_no_is")
    ]  # a diagnosis cell: not tuned
    result = E.tune("/d", "/g", cells, 4, 2, tmp_path, tmp_path / "runs", (5e-5, 1e-4, 2e-4))
    assert set(result["cells"]) == {"grpo", "mix", "distill"}
    assert sorted(ran) == sorted(curves)  # each (cell, rate) once, the extensions included
    assert result["cells"]["grpo"]["scores"]["0.0001"] == pytest.approx(0.51)
    assert result["cells"]["grpo"]["pick"] == 1e-4 and result["cells"]["mix"]["pick"] == 5e-5
    assert result["cells"]["distill"]["pick"] == 8e-4
    assert list(result["cells"]["mix"]["scores"]) == ["2.5e-05", "5e-05", "0.0001", "0.0002"]
    assert json.loads((tmp_path / "tuning.json").read_text()) == result
    md = (tmp_path / "tuning.md").read_text()
    assert (
        "| cell | lr 2.5e-05 | lr 5e-05 | lr 0.0001 | lr 0.0002 | lr 0.0004 | lr 0.0008 | pick |"
        in md
    )
    assert "| plain GRPO (guidance off) | — | 45.0 | 51.0 | 47.5 | — | — | 0.0001 |" in md
    assert (
        "| pure distillation (no reward, λ = 0) | — | 30.0 | 40.0 | 50.0 | 60.0 | 70.0 | 0.0008 |"
        in md
    )


def test_tune_keeps_earlier_picks_and_uses_a_cells_own_grid(tmp_path, monkeypatch):
    (tmp_path / "tuning.json").write_text(
        json.dumps({"cells": {"grpo": {"label": "g", "scores": {}, "pick": 1e-4}}})
    )
    ran = []

    def fake_run_once(args, run_dir, dest, steps):
        lr = float(next(a for a in args if a.startswith("worker.actor.optim.lr=")).split("=")[1])
        ran.append(lr)
        # accuracy at step 2 peaks at 5e-4, the grid's middle: no extension
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(
            "\n".join(json.dumps(r) for r in log({0: 0.3, 2: 0.9 - abs(lr - 5e-4) * 100}, 1.0))
            + "\n"
        )
        return True

    monkeypatch.setattr(E, "run_once", fake_run_once)
    lora = next(c for c in E.CELLS if c.name == "grpo_lora")
    assert lora.tune_lrs == (2.5e-4, 5e-4, 1e-3) and lora.overlays == ("lora",)
    result = E.tune("/d", "/g", [lora], 2, 2, tmp_path, tmp_path / "runs", (5e-5, 1e-4, 2e-4))
    assert ran == [2.5e-4, 5e-4, 1e-3]  # its own grid, not the task's
    assert result["cells"]["grpo_lora"]["pick"] == 5e-4 and result["cells"]["grpo"]["pick"] == 1e-4
    assert E.lr_of(lora, {"grpo_lora": 5e-4}) == 5e-4  # picks without the cell it would vary
    args = E.run_args(lora, "/d", "/g", 0, 2, 2, tmp_path / "r")
    assert any(a.endswith("configs/lora.yaml") for a in args)


def test_committed_tuning_matches_the_picks_the_runs_use():
    out = E.RESULTS / "evidence_arithmetic"
    tuning = json.loads((out / "tuning.json").read_text())
    assert tuning["seed"] == E.TUNE_SEED and tuning["lrs"] == list(E.TUNE_LRS["arithmetic"])
    assert E.load_picks(out) == {name: r["pick"] for name, r in tuning["cells"].items()}
    assert tuning["seed"] not in range(3)  # never one of the reported seeds
    assert E.load_picks(out.parent / "no_such_task") is None  # not tuned: make evidence tunes


def test_run_plan_runs_each_cell_at_its_tuned_lr(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(
        E, "run_once", lambda args, run_dir, dest, steps: seen.setdefault(run_dir.parent.name, args)
    )
    picks = {"grpo": 5e-5, "spec_exact": 2e-4, "mix": 1e-4, "mentor": 3e-4}
    E.run_plan(
        {"weak": "/d"}, "/g", list(E.CELLS), range(1), 4, 2, tmp_path, tmp_path / "runs", 1e9, picks
    )
    lrs = {
        c: float(next(a for a in args if "optim.lr=" in a).split("=")[1])
        for c, args in seen.items()
    }
    assert lrs["grpo"] == 5e-5 and lrs["spec_exact"] == 2e-4 and lrs["mix"] == 1e-4
    assert lrs["spec_no_is"] == 2e-4  # a diagnosis cell takes the lr of the cell it varies
    assert lrs["mentor"] == 3e-4


def test_mentor_cells_load_their_overlay_and_decay_over_the_run(tmp_path):
    from verl.trainer.config import load_config

    cell = next(c for c in E.CELLS if c.name == "mentor_exact")
    args = E.run_args(cell, "/d", "/g", 0, 30, 5, tmp_path, E.TASK_SET["runsum"])
    config = load_config(args[3:])
    guidance = config.worker.rollout.offpolicy_guidance
    assert guidance.lam_gate == "entropy" and guidance.guided_samples == 4
    assert config.algorithm.guided_advantage == "mentor" and config.algorithm.tis_level == "token"
    assert config.algorithm.guided_advantage_decay_steps == 30  # the run's length
    assert config.data.max_response_length == 21
