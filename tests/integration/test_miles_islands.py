"""Miles islands: `yeto_plugins.miles` attached to a reproduction of Miles' actor loop (`tests/mcore/miles_loop.py`,
its hook call, weight backup and colocated updater, line by line from radixark/miles) around real megatron-core
islands on CPU gloo ranks, against the real syncer.

What the rollout engine gets is what matters: Miles' colocated updater sends the actor's CPU weight backup, and
the next training pass restores the parameters from it, so an install the backup does not see is lost twice.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Procs, checkpoint_params, start_syncer, syncer_exit_code, wait_until
from test_megatron_islands import digests, results

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
sys.path.insert(0, str(ROOT / "tests" / "mcore"))
from launch import run_ranks

pytestmark = pytest.mark.integration
WORKER = ROOT / "tests" / "mcore" / "miles_worker.py"
SYNC_WORKER = ROOT / "tests" / "mcore" / "sync_worker.py"
TP2 = {"tp": 2}
PP2 = {"pp": 2}
ROLLOUTS, STEPS = 3, 2  # optimizer steps per rollout
ENV = {"YETO_DILOCO_SYNC_INTERVAL": "2", "YETO_DILOCO_RECONNECT_MAX_S": "1", "YETO_DILOCO_INIT_TIMEOUT_S": "90",
       "YETO_DILOCO_FINAL_TIMEOUT_S": "120", "YETO_DILOCO_CONSENSUS_EVERY": "0"}


class Island(threading.Thread):
    def __init__(self, spec: dict[str, Any], address: str, key_file: Path, learner_id: int, mode: str,
                 *extra: str, **settings: str) -> None:
        super().__init__(daemon=True)
        self.argv = [mode, json.dumps(spec), str(ROLLOUTS), str(STEPS), *extra]
        self.env = {**ENV, "YETO_DILOCO_SYNCER": address, "YETO_DILOCO_KEY_FILE": str(key_file),
                    "YETO_DILOCO_LEARNER_ID": str(learner_id), **settings}
        self.ranks: list[dict[str, Any]] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.ranks = results(run_ranks(WORKER, 2, args=self.argv, env=self.env, timeout_s=200))
        except BaseException as exc:
            self.error = exc

    def outcome(self) -> list[dict[str, Any]]:
        self.join(240)
        assert not self.is_alive(), "island did not finish"
        if self.error is not None:
            raise self.error
        assert self.ranks is not None
        return self.ranks


def check_final(islands: list[list[dict[str, Any]]], checkpoint: Path) -> None:
    final = digests(checkpoint)
    for n, ranks in enumerate(islands):
        for r in ranks:
            where = f"island {n} rank {r['rank']}"
            assert r["final"], f"{where} did not install the final cut"
            assert r["problems"] == [] and r["engine"] == [], (where, r["problems"], r["engine"])
            assert r["digest"] == final, f"{where} does not hold the syncer's final weights"


@pytest.mark.timeout(300)
def test_streaming_through_the_hook_ends_with_the_final_cut_in_masters_params_backup_and_engine(
        procs: Procs, key_file: Path) -> None:
    """`--custom-megatron-before-train-step-hook-path yeto_plugins.miles.hook.before_train_step` alone: a
    boundary every H/P steps; the run's last step asks for the final cut, which is in before Miles backs
    the weights up, so the last `update_weights` sends it."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=2,
                          extra=["--sync-interval-steps", "2"])
    a = Island(TP2, syncer.address, key_file, 0, "stream")
    b = Island(PP2, syncer.address, key_file, 1, "stream")
    ranks_a, ranks_b = a.outcome(), b.outcome()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    check_final([ranks_a, ranks_b], syncer.checkpoint)
    assert syncer.commits(), "no round committed"
    for ranks in (ranks_a, ranks_b):
        assert ranks[0]["steps_accounted"] == ROLLOUTS * STEPS and ranks[0]["pushes"] >= 1


@pytest.mark.timeout(300)
def test_a_miles_island_and_an_ms_swift_island_train_one_model(procs: Procs, key_file: Path) -> None:
    """The same model as a Miles island (TP2, the hook) and an ms-swift Megatron island (PP2, swift's
    callback): one global description, and both end on the syncer's final weights."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=2,
                          extra=["--sync-interval-steps", "2"])
    miles = Island(TP2, syncer.address, key_file, 0, "stream")
    env = {**ENV, "YETO_DILOCO_SYNCER": syncer.address, "YETO_DILOCO_KEY_FILE": str(key_file),
           "YETO_DILOCO_LEARNER_ID": "1"}
    swift = results(run_ranks(SYNC_WORKER, 2, args=["swift", json.dumps(PP2), str(ROLLOUTS * STEPS)], env=env,
                              timeout_s=200))
    ranks = miles.outcome()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    check_final([ranks], syncer.checkpoint)
    final = digests(syncer.checkpoint)
    assert all(r["final"] and r["problems"] == [] and r["digest"] == final for r in swift), swift
    assert {c["learners"][0] for c in syncer.commits() if len(c["learners"]) == 1} <= {0, 1}
    assert any(sorted(c["learners"]) == [0, 1] for c in syncer.commits())


@pytest.mark.timeout(300)
def test_a_policy_sweep_hands_every_rollout_the_global_policy(procs: Procs, key_file: Path) -> None:
    """`RL_MODE=sweep` with the sweep between `train` and `update_weights` and the backup refreshed: after
    every rollout both islands' engines, parameters and masters hold the same global values."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=2, total_rounds=ROLLOUTS * 2,
                          extra=["--sync-interval-steps", "0", "--pipeline", "2"])
    a = Island(TP2, syncer.address, key_file, 0, "sweep", YETO_DILOCO_RL_MODE="sweep")
    b = Island(PP2, syncer.address, key_file, 1, "sweep", YETO_DILOCO_RL_MODE="sweep")
    ranks_a, ranks_b = a.outcome(), b.outcome()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    check_final([ranks_a, ranks_b], syncer.checkpoint)
    assert [c["round"] for c in syncer.commits()] == list(range(ROLLOUTS * 2))
    for rollout in range(ROLLOUTS):
        held = [r["per_rollout"][rollout] for r in (*ranks_a, *ranks_b)]
        assert all(h["engine"] == [] and h["weights"] == [] for h in held), [(h["engine"], h["weights"]) for h in held]
        assert all(h["digest"] == held[0]["digest"] for h in held), f"rollout {rollout}: the islands differ"
    for r in (*ranks_a, *ranks_b):
        assert r["moments_kept"] == [True] * ROLLOUTS, (r["rank"], r["moments_kept"])  # installs keep Adam's state
    assert checkpoint_params(syncer.checkpoint)


@pytest.mark.timeout(300)
def test_without_refreshing_the_backup_the_engine_serves_the_pre_merge_policy(procs: Procs, key_file: Path) -> None:
    """The negative control: the same sweep, the backup not refreshed after the installs. The engine then
    holds the weights from before the merge, and the next training pass restores them over it."""
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=ROLLOUTS * 2,
                          extra=["--sync-interval-steps", "0", "--pipeline", "2"])
    ranks = Island(TP2, syncer.address, key_file, 0, "sweep", "no-refresh", YETO_DILOCO_RL_MODE="sweep").outcome()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    stale = [(r["rank"], h["rollout"]) for r in ranks for h in r["per_rollout"] if h["engine"]]
    assert len(stale) == len(ranks) * ROLLOUTS, stale  # every rollout, every rank: the merge never reached it


# -- overlap, and a syncer killed under it --------------------------------------------------------------------
OVERLAP = {"learners": 2, "quorum": 2, "fragments": 2, "total_rounds": ROLLOUTS * 2,
           "extra": ["--sync-interval-steps", "0", "--pipeline", "2", "--checkpoint-every", "1"]}


def run_overlap(procs: Procs, key_file: Path, fault: str | None) -> tuple[list[list[dict[str, Any]]], list[Any]]:
    """Two overlapping Miles islands; with `fault`, the syncer SIGKILLs itself there and a second one resumes
    from its checkpoint on the same port. The islands' reports and the syncers, in start order."""
    first = start_syncer(procs, key_file=key_file, tape_name="tape-1.jsonl",
                         env={"YETO_FAULT": fault} if fault else None, **OVERLAP)
    syncers = [first]
    islands = [Island(spec, first.address, key_file, lid, "sweep", YETO_DILOCO_RL_MODE="overlap")
               for lid, spec in enumerate((TP2, PP2))]
    if fault:
        wait_until(lambda: first.proc.poll() is not None, 150, f"the syncer's death at {fault}")
        assert first.proc.poll() == -9, first.proc.tail()
        syncers.append(start_syncer(procs, key_file=key_file, port=first.port, tape_name="tape-2.jsonl",
                                    resume=True, bind_retry_s=20, **OVERLAP))
    reports = [island.outcome() for island in islands]
    assert syncer_exit_code(syncers[-1]) == 0, syncers[-1].proc.tail()
    return reports, syncers


def round_summaries(syncers: list[Any]) -> dict[int, dict[str, Any]]:
    """What each round merged (a redone round: its last commit), for telling two runs apart."""
    keys = ("learners", "tokens", "steps", "base_versions", "delta_norms", "outer_grad_norm")
    by_round = {c["round"]: c for s in syncers for c in s.commits()}
    return {r: {k: c.get(k) for k in keys} for r, c in sorted(by_round.items())}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[int, dict[str, Any]]]:
    """The final weights of an undisturbed overlapping run, and what each of its rounds merged."""
    workdir = tmp_path_factory.mktemp("overlap-undisturbed")
    key_file = workdir / "syncer.key"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    procs = Procs(workdir)
    try:
        reports, (syncer,) = run_overlap(procs, key_file, None)
        assert syncer.checkpoint is not None
        check_final(reports, syncer.checkpoint)
        return digests(syncer.checkpoint), round_summaries([syncer])
    finally:
        procs.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["mid-merge@3", "mid-bcast@3", "mid-merge@4"],
                         ids=["killed-before-a-commit", "killed-mid-broadcast",
                              "killed-between-the-rounds-of-a-sweep"])
def test_overlap_counts_every_step_once_and_a_syncer_restart_changes_no_bit(
        procs: Procs, key_file: Path, fault: str | None,
        undisturbed: tuple[dict[str, str], dict[int, dict[str, Any]]]) -> None:
    """`RL_MODE=overlap`: each island trains the next rollout on its own weights while its sweep merges,
    and rebases the merge in at the next sweep. Every optimizer step reaches one merge once, and a syncer
    SIGKILLed before a commit, mid-broadcast or between a sweep's two rounds, resumed from its checkpoint,
    ends on exactly the weights of the undisturbed run."""
    reports, syncers = run_overlap(procs, key_file, fault)
    assert syncers[0].checkpoint is not None
    check_final(reports, syncers[0].checkpoint)
    by_round = {c["round"]: c for s in syncers for c in s.commits()}  # a redone round: the last commit counts
    assert sorted(by_round) == list(range(ROLLOUTS * 2)), "\n".join(s.proc.tail() for s in syncers)
    for lid in (0, 1):
        for fragment in (0, 1):
            steps = [c["steps"][c["learners"].index(lid)] for r, c in by_round.items() if r % 2 == fragment]
            assert sum(steps) == ROLLOUTS * STEPS, (lid, fragment, steps)
    weights, rounds = undisturbed
    if digests(syncers[0].checkpoint) != weights:  # say which round went another way, and how
        mine = round_summaries(syncers)
        differ = {r: {"undisturbed": rounds.get(r), "here": mine[r]} for r in mine if mine[r] != rounds.get(r)}
        tails = "\n".join(s.proc.tail() for s in syncers)
        pytest.fail(f"the final weights differ from the undisturbed run's; rounds that differ: {differ}\n{tails}")


# -- an island killed and resumed from Miles' checkpoint --------------------------------------------------------
@pytest.mark.timeout(420)
def test_a_killed_miles_island_resumed_from_its_checkpoint_rejoins_the_present(procs: Procs, key_file: Path,
                                                                               tmp_path: Path) -> None:
    """One sweeping island (quorum 1, so only its sweeps move the run): it saves its checkpoint after rollout 0,
    sweeps rollout 1 into the run and is SIGKILLed, every rank. Resumed from that checkpoint (loaded before any
    training, as Miles' actor init loads `--load`, from `start_rollout_id` 1), its join installs the run's
    present, rollout 1's global weights, over the checkpoint's, and its last rollout ends on the final cut."""
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2,
                          extra=["--sync-interval-steps", "0", "--pipeline", "2"])
    env = {**ENV, "YETO_DILOCO_SYNCER": syncer.address, "YETO_DILOCO_KEY_FILE": str(key_file),
           "YETO_DILOCO_LEARNER_ID": "0", "YETO_DILOCO_RL_MODE": "sweep"}
    argv = ["sweep", json.dumps(TP2), str(ROLLOUTS), str(STEPS)]
    pids: list[int] = []
    failure: list[BaseException] = []

    def doomed() -> None:
        try:
            run_ranks(WORKER, 2, args=[*argv, f"save={tmp_path}", "save_at=1", "hang=2"], env=env, timeout_s=300,
                      started=pids.extend)
        except AssertionError as exc:  # its ranks were killed: expected
            failure.append(exc)

    first = threading.Thread(target=doomed, daemon=True)
    first.start()
    killed = [tmp_path / f"killed-rank{rank}.json" for rank in (0, 1)]
    wait_until(lambda: all(path.exists() for path in killed), 200, "the island's second rollout")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    first.join(60)
    assert not first.is_alive() and failure, "the killed island's ranks did not end"

    resumed = results(run_ranks(WORKER, 2, args=[*argv, f"resume={tmp_path}", "start=1"], env=env, timeout_s=240))
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    check_final([resumed], syncer.checkpoint)
    before = json.loads(killed[0].read_text())
    for rank in resumed:
        assert rank["joined_digest"] == before[1]["digest"], f"rank {rank['rank']} did not take the run's present"
        assert rank["joined_digest"] != before[0]["digest"]  # what its checkpoint held
        assert [r["rollout"] for r in rank["per_rollout"]] == [1, 2]
    assert [r["learner"] for r in syncer.tape_records() if r["event"] == "join"] == [0, 0]
