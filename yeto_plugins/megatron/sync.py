"""`MegatronDiLoCoSync`: one Megatron island (TP/PP/DP/EP ranks) as one DiLoCo learner.

    sync = MegatronDiLoCoSync(wrapped_models, optimizer)   # every rank, settings from YETO_DILOCO_*
    sync.start()                                            # every rank: joins, installs the initial cut
    for step in ...:
        train_step()
        if sync.step(tokens, last=step == last_step):       # every rank, once per optimizer step
            break                                           # the final cut is installed: stop here
    sync.finish(); sync.close()                             # finish: idempotent, for an early end

Framework-free apart from megatron-core: a trainer plugin (ms-swift's callback, a Megatron
training loop) calls these four methods on every rank at the same points. Rank 0 of the island
runs the ordinary learner session against the syncer; the fragments it reads and writes are
gathered from and scattered to every rank's fp32 masters by `IslandStore` over a gloo group, on
host buffers. The synced set is every trainable parameter, named globally (`names.py`), so
islands with different parallel layouts share one model description.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from yeto_core.island import IslandSession, IslandStats
from yeto_core.layout import build_layout
from yeto_core.learner import LearnerSession
from yeto_core.moments import MomentError
from yeto_core.settings import LearnerSettings, load_settings
from yeto_plugins.exits import island_exit
from yeto_plugins.megatron.names import EMBEDDING
from yeto_plugins.megatron.probe import megatron_logit_probe
from yeto_plugins.megatron.store import IslandStore

log = logging.getLogger("yeto.megatron")


class MegatronDiLoCoSync:
    """Keyword arguments are `LearnerSettings` fields; they win over `YETO_DILOCO_*`."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any,
                 settings: LearnerSettings | None = None, *, on_final: str = "training stops",
                 **overrides: Any) -> None:
        self.settings = settings if settings is not None else load_settings(LearnerSettings, **overrides)
        if self.settings.share_momentum:
            raise MomentError("YETO_DILOCO_SHARE_MOMENTUM: Megatron's optimizer keeps its moments in its own "
                              "(distributed) buffers, which yeto cannot read yet; unset it for a Megatron island")
        chunks = list(model) if isinstance(model, Sequence) else [model]
        self.store = IslandStore(chunks, optimizer, self.settings.island)
        self.rank = self.store.rank
        # Built on every rank (the same way): the probe is a collective of the whole island.
        probe = (megatron_logit_probe(chunks, self.store.group, self.settings.consensus.tokens)
                 if self.settings.consensus.every else None)
        self.island = IslandSession(self.settings, store=self.store, embedding_names={EMBEDDING}, probe=probe,
                                    on_final=on_final)
        self.session: LearnerSession | None = self.island.session  # rank 0 only

    @property
    def names(self) -> list[str]:
        """The synced tensors' global names, in canonical order (the same on every rank)."""
        return [s.name for s in self.store.specs]

    @property
    def stats(self) -> IslandStats:
        return self.island.stats

    @property
    def final(self) -> bool:
        """The final cut is installed (every rank alike)."""
        return self.island.final

    # -- the collective calls (`IslandSession`) ----------------------------------------------------
    def start(self) -> None:
        """Connect (rank 0) and install the initial cut on every rank. A link too slow to join ends
        the process with code 75 and one line (`yeto_plugins.exits`)."""
        with island_exit():
            self.island.start()

    def step(self, tokens: int, *, last: bool = False) -> bool:
        """Account one optimizer step of `tokens` (the island's tokens, rank 0's value counts);
        `last`: the trainer's last step (the final cut is waited for there). True on every rank once
        the final cut is installed: stop training at this step (`IslandSession.step`)."""
        return self.island.step(tokens, last=last)

    def sweep(self) -> bool:
        """Every pulled fragment pushed now, their merges waited for (see `IslandSession.sweep`)."""
        return self.island.sweep()

    def end_iteration(self, *, last: bool = False) -> bool:
        """The end of an RL iteration (`IslandSession.end_iteration`)."""
        return self.island.end_iteration(last=last)

    def finish(self) -> bool:
        """Training ended here first: wait (deadline `final_timeout_s`) for the final cut; idempotent."""
        return self.island.finish()

    def close(self) -> None:
        self.island.close()

    # -- whole-model access (checks, exports) --------------------------------------------------
    def read_all(self) -> dict[str, torch.Tensor] | None:
        """Every synced tensor's fp32 master, whole and globally named, on rank 0 (None elsewhere)."""
        box: dict[str, torch.Tensor] = {}

        def read() -> bool:
            fragment = build_layout(self.store.specs, 1).fragments[0]
            values = self.store.gather(fragment)
            for slot in fragment.slots:
                box[slot.name] = values[slot.offset : slot.offset + slot.numel].view(slot.shape)
            return False

        self._run(read)
        return box if self.rank == 0 else None

    def write_all(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Install whole, globally named fp32 values (given on rank 0) into every rank's masters
        and parameters; optimizer moments are kept."""
        def write() -> bool:
            assert tensors is not None
            fragment = build_layout(self.store.specs, 1).fragments[0]
            missing = [s.name for s in fragment.slots if s.name not in tensors]
            if missing:
                raise ValueError(f"write_all: no value for {missing[0]} (and {len(missing) - 1} more)")
            values = torch.cat([tensors[s.name].detach().reshape(-1).float().cpu() for s in fragment.slots])
            self.store.install(fragment, values, 0.0)
            return False

        self._run(write)

    def _run(self, fn: Callable[[], bool]) -> None:
        """A whole-model read or write: rank 0 runs `fn`, the other ranks follow."""
        self.store.run(fn if self.rank == 0 else None)
