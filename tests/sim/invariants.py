"""What must hold after every simulated run, whatever its faults (`check` lists what did not).

* The run ends: the syncer finalizes and every learner process ends, before the horizon; no
  deadline waits forever.
* Commits come strictly in round order, each round at most once, in every syncer process, and a
  resumed syncer goes on from its checkpoint's round.
* Every checkpoint a syncer resumed from, and the last one, is a contiguous prefix of the run: the
  values, versions and token ledger the syncer held right after committing that round, bit for bit.
* No token is counted twice or lost across restarts: the ledger is the sum of the tokens of the
  commits that count (those a crash did not undo), and no learner process has more tokens
  committed for a fragment than it trained.
* Every learner that reaches the end holds the final cut, bit for bit, and none that trained to
  its end without a refusal misses it, unless the syncer finalized while it was away and before
  its first push (such a learner is not waited for, DESIGN §4.7).
* A process with the wrong key is refused and never joins.
* A process of another model is refused for its layout, and no finalizing syncer waits for it
  (it never trained: DESIGN §4.7).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from syncer.durability.checkpoint import SyncerState, ledger_key, load_checkpoint
from tests.sim.world import Run


def check(run: Run) -> list[str]:
    problems: list[str] = []
    if not run.finished:
        stuck = [f"learner {t.learner_id} (process {t.process})" for t in run.trained + run.intruders + run.strangers
                 if not t.ended]
        syncer = run.incarnations[-1]
        problems.append(f"the run did not end within the horizon (t={run.end_s:.0f} s): syncer done={syncer.done}, "
                        f"still running: {stuck or 'none'}")
        return problems
    lineage = _commit_order(run, problems)
    _checkpoints(run, lineage, problems)
    _tokens(run, lineage, problems)
    _final_cut(run, problems)
    for intruder in run.intruders:
        if intruder.reached and (intruder.refused is None or "auth" not in intruder.refused):
            problems.append(f"the process with the wrong key as learner {intruder.learner_id} was not refused "
                            f"({intruder.refused})")
        for node in run.incarnations:
            if intruder.process in node.processes.values():
                problems.append(f"the process with the wrong key joined syncer {node.incarnation}")
    for stranger in run.strangers:
        if stranger.reached and (stranger.refused is None or "layout" not in stranger.refused):
            problems.append(f"the process of another model as learner {stranger.learner_id} was not refused for its "
                            f"layout ({stranger.refused})")
        for node in run.incarnations:
            if stranger.learner_id in (node.finalizing_waits_for or set()):
                problems.append(f"syncer {node.incarnation} finalized waiting for learner {stranger.learner_id}, "
                                "of another model, which never trained")
    return problems


def _commit_order(run: Run, problems: list[str]) -> list[dict[str, object]]:
    """The commits that count, in order: each syncer's, after the round its successor resumed from is cut."""
    lineage: list[dict[str, object]] = []
    for node, resumed in zip(run.incarnations, run.resumed_from, strict=True):
        start = resumed.next_round if resumed is not None else 0
        lineage = [c for c in lineage if int(c["round"]) < start]  # type: ignore[call-overload]
        last = start - 1
        for record in node.tape.records:
            if record["event"] != "commit":
                continue
            round_id = int(record["round"])
            if round_id <= last:
                problems.append(f"syncer {node.incarnation} committed round {round_id} after round {last}")
            elif round_id != last + 1:
                problems.append(f"syncer {node.incarnation} committed round {round_id} with round {last + 1} "
                                "never committed")
            last = round_id
            lineage.append({**record, "incarnation": node.incarnation})
    return lineage


def _snapshot(run: Run, before: int, next_round: int) -> tuple[list[torch.Tensor], list[int], dict[str, int]] | None:
    """What the last syncer before incarnation `before` to reach `next_round` held there."""
    for incarnation, n, params, versions, ledger in reversed(run.commits):
        if incarnation < before and n == next_round:
            return params, versions, ledger
    return None


def _same_state(state: SyncerState, held: tuple[list[torch.Tensor], list[int], dict[str, int]]) -> str | None:
    params, versions, ledger = held
    if state.versions != versions:
        return f"versions {state.versions}, held {versions}"
    if {k: v for k, v in state.ledger.items() if v} != {k: v for k, v in ledger.items() if v}:
        return f"ledger {state.ledger}, held {ledger}"
    for f, (a, b) in enumerate(zip(state.params, params, strict=True)):
        if not torch.equal(a, b):
            return f"fragment {f} differs"
    return None


def _checkpoints(run: Run, lineage: list[dict[str, object]], problems: list[str]) -> None:
    for k, resumed in enumerate(run.resumed_from):
        if resumed is None:
            continue
        held = _snapshot(run, k, resumed.next_round)
        if held is None:
            problems.append(f"syncer {k} resumed from round {resumed.next_round}, which no syncer before it held")
            continue
        differs = _same_state(resumed, held)
        if differs is not None:
            problems.append(f"the checkpoint syncer {k} resumed from (round {resumed.next_round}) is not what was "
                            f"committed: {differs}")
    final = run.final_state
    if final is None or not final.finalized:
        problems.append(f"the syncer ended without finalizing (exit code {run.incarnations[-1].co.exit_code})")
        return
    on_disk = load_checkpoint(run.checkpoint)
    if not on_disk.finalized or _same_state(on_disk, (final.params, final.versions, final.ledger)) is not None:
        problems.append("the last checkpoint is not the final cut the syncer sent")


def _tokens(run: Run, lineage: list[dict[str, object]], problems: list[str]) -> None:
    final = run.final_state
    if final is None:
        return
    counted: dict[str, int] = defaultdict(int)
    by_process: dict[tuple[int, int], int] = defaultdict(int)  # (process, fragment) -> committed tokens
    for record in lineage:
        node = run.incarnations[int(record["incarnation"])]  # type: ignore[call-overload]
        for lid, gen, tokens in zip(record["learners"], record["generations"], record["tokens"],  # type: ignore[call-overload]
                                    strict=True):
            counted[ledger_key(lid, gen)] += tokens
            process = node.processes.get(lid << 32 | gen)
            by_process[(process if process is not None else -1, int(record["fragment"]))] += tokens  # type: ignore[call-overload]
    ledger = {k: v for k, v in final.ledger.items() if v}
    if ledger != dict(counted):
        problems.append(f"the token ledger {ledger} is not the sum of the commits that count {dict(counted)}")
    trained = {t.process: t.tokens for t in run.trained}
    for (process, fragment), tokens in sorted(by_process.items()):
        if process not in trained:
            problems.append(f"fragment {fragment} has {tokens} tokens committed from an unknown process")
        elif tokens > trained[process]:
            problems.append(f"process {process} trained {trained[process]} tokens but fragment {fragment} has "
                            f"{tokens} of them committed")


def _final_cut(run: Run, problems: list[str]) -> None:
    final = run.final_state
    if final is None:
        return
    waited_for = run.incarnations[-1].finalizing_waits_for or set()
    for t in run.trained:
        if t.final_installed:
            assert t.finals is not None
            for f, (mine, theirs) in enumerate(zip(t.finals, final.params, strict=True)):
                if not torch.equal(mine, theirs):
                    problems.append(f"learner {t.learner_id} (process {t.process}) installed a final cut that "
                                    f"differs from the syncer's in fragment {f}")
        elif not t.crashed and t.refused is None and t.learner_id in waited_for:
            problems.append(f"learner {t.learner_id} (process {t.process}) trained to its end but never got the "
                            "final cut")
