"""The ms-swift Megatron plugin against swift's own callback files: its registry, its callback base class, its
TrainerState and its `print` and `default_flow` callbacks, as `megatron sft` builds and calls them.

swift's Megatron trainer itself cannot be imported without TransformerEngine, which needs CUDA; the callback
package can (see the probe below), and that is the part the plugin touches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from yeto_plugins.swift_megatron.register import NAME

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "yeto_plugins" / "swift_megatron" / "plugin" / "swift_plugin.py"


# The real swift.megatron.callbacks package, loaded without TransformerEngine: only
# swift/megatron/utils/__init__.py needs it (via mcore_bridge), and callbacks/print.py takes nothing
# from there but parallel_utils. The probe imports the plugin with swift's own import_external_file,
# builds callbacks as BaseMegatronTrainer.__init__ does and calls events as its call_event and
# train() do, with swift's TrainerState, PrintCallback and DefaultFlowCallback.
REAL_PROBE = r"""
import ast, dataclasses, importlib.util, json, os, sys, time, types, typing
from pathlib import Path
plugin, out_dir = sys.argv[1], sys.argv[2]

import swift.megatron  # the real package: imports without TransformerEngine
SW = Path(swift.__file__).parent
# swift/megatron/utils/__init__ pulls in mcore_bridge, which imports TransformerEngine: put a package
# there that skips __init__ and holds the real parallel_utils (all that callbacks/print.py takes from it).
utils = types.ModuleType("swift.megatron.utils")
utils.__path__ = [str(SW / "megatron" / "utils")]
sys.modules[utils.__name__] = utils
spec = importlib.util.spec_from_file_location("swift.megatron.utils.parallel_utils",
                                              SW / "megatron" / "utils" / "parallel_utils.py")
parallel_utils = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parallel_utils)
utils.reduce_max_stat_across_model_parallel_group = parallel_utils.reduce_max_stat_across_model_parallel_group

import swift.megatron.callbacks as cbs  # the real __init__, base.py, mapping.py and every callback file
from swift.utils import import_external_file
# swift's TrainerState, lifted from megatron/trainers/utils.py (whose imports need TransformerEngine)
tree = ast.parse((SW / "megatron" / "trainers" / "utils.py").read_text())
ns = {"dataclass": dataclasses.dataclass, "Optional": typing.Optional}
body = [n for n in tree.body if getattr(n, "name", "") == "TrainerState"]
exec(compile(ast.Module(body, []), "TrainerState", "exec"), ns)
TrainerState = ns["TrainerState"]

real = dict(cbs.megatron_callbacks_map)
import_external_file(plugin)
reg = cbs.megatron_callbacks_map
after_first = dict(reg)
import_external_file(plugin)  # swift imports a plugin again in each dataloader worker
from yeto_plugins.swift_megatron import callback as callback_mod
from yeto_plugins.swift_megatron.callback import YetoMegatronCallback
from yeto_plugins.swift_megatron.register import AnchorEntry, AutoAttached

events = []

class Sync:  # IslandSession's end of run: a last step waits for the final cut; finish is idempotent
    def __init__(self, trainer):
        self.trainer, self.stats = trainer, types.SimpleNamespace(pushes=0, installs=0, in_yeto_s=0.25)
        self.final = False
    def start(self): events.append("start")
    def step(self, tokens, last=False):
        self.stats.pushes += 1
        st = self.trainer.state  # what swift's default_flow has done to this step so far
        events.append(["step", tokens, st.iteration, st.consumed_train_samples, st.should_save])
        return last and self.finish()
    def finish(self):
        if not self.final:
            events.append(["finish", self.trainer.state.should_save])
            self.final = True
        return True
    def close(self): events.append("close")

def make_trainer(names):
    args = types.SimpleNamespace(callbacks=names, train_iters=3, global_batch_size=4, seq_length=16,
                                 output_dir=out_dir, eval_iters=0, eval_steps=None, save_steps=None,
                                 logging_steps=5, manual_gc=False, manual_gc_steps=0, manual_gc_eval=True)
    trainer = types.SimpleNamespace(args=args, state=TrainerState(), wrapped_models=["chunk0"],
                                    optimizer="optimizer", opt_param_scheduler=types.SimpleNamespace(num_steps=0))
    callback_mod.megatron_sync = lambda model, optimizer, settings: Sync(trainer)
    trainer.callbacks = [reg[name](trainer) for name in args.callbacks]  # BaseMegatronTrainer.__init__
    return trainer

def call_event(trainer, event, **kwargs):  # BaseMegatronTrainer.call_event
    for cb in trainer.callbacks:
        getattr(cb, event)(**kwargs)

def describe(cb):
    if isinstance(cb, AutoAttached):
        return [type(cb).__name__, [type(p).__name__ for p in cb.parts]]
    return type(cb).__name__

got = {
    "registry": {k: f"AnchorEntry({v.wrapped.__name__})" if isinstance(v, AnchorEntry) else v.__name__
                 for k, v in reg.items()},
    "wraps_real": all(reg[k].wrapped is real[k] for k in ("print", "default_flow")),
    "others_untouched": all(reg[k] is real[k] for k in real if k not in ("print", "default_flow")),
    "subclass": issubclass(reg["yeto_diloco"], cbs.MegatronCallback)
                and issubclass(reg["yeto_diloco"], YetoMegatronCallback),
    "reimport_same": dict(reg) == after_first,
    "bridge_loaded": "mcore_bridge" in sys.modules,
}

got["named"] = [describe(cb) for cb in make_trainer(["yeto_diloco", "print", "default_flow"]).callbacks]
got["off"] = [describe(cb) for cb in make_trainer(["print", "default_flow"]).callbacks]

os.environ["YETO_DILOCO_AUTO_ATTACH"] = "1"
trainer = make_trainer(["print", "default_flow"])  # what MegatronArguments appends; no --callbacks
first = trainer.callbacks[0]
got["auto"] = [describe(cb) for cb in trainer.callbacks]
got["composite_is_megatron_callback"] = isinstance(first, cbs.MegatronCallback)
call_event(trainer, "on_train_begin")
got["bar_forwarded"] = first.training_bar is first.parts[-1].training_bar is not None
while trainer.state.iteration < trainer.args.train_iters:  # BaseMegatronTrainer.train, one step at a time
    call_event(trainer, "on_step_begin")
    trainer.opt_param_scheduler.num_steps += trainer.args.global_batch_size
    trainer.state.iteration += 1
    call_event(trainer, "on_step_end")
    if trainer.state.should_save:
        events.append(["save", trainer.state.iteration])
        call_event(trainer, "on_save", output_dir=out_dir)
        trainer.state.should_save = False
# print.on_log reduces a CUDA tensor over the model-parallel group: not possible on a CPU host
sys.modules["swift.megatron.callbacks.print"].reduce_max_stat_across_model_parallel_group = lambda stat: stat
logs = {"loss": 1.5}
call_event(trainer, "on_log", logs=logs)
got["logs"] = sorted(logs)
got["print_step"] = first.parts[-1].current_step
got["consumed"] = trainer.state.consumed_train_samples
got["should_log"] = trainer.state.should_log
call_event(trainer, "on_train_end")
got["bar_closed"] = first.training_bar is None
got["events"] = events
deadline = time.time() + 10  # PrintCallback's JsonlWriter writes from a thread
path = Path(out_dir) / "logging.jsonl"
while time.time() < deadline and not (path.exists() and path.read_text().strip()):
    time.sleep(0.05)
got["jsonl"] = json.loads(path.read_text().splitlines()[-1]) if path.exists() else None
print(json.dumps(got))
"""


@pytest.mark.timeout(180)
def test_plugin_against_the_real_swift_callback_files(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "YETO_DILOCO_SYNCER": "127.0.0.1:7070", "YETO_DILOCO_KEY": "k" * 32}
    out = subprocess.run([sys.executable, "-I", "-c", REAL_PROBE, str(PLUGIN), str(tmp_path)],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["registry"] == {"print": "AnchorEntry(PrintCallback)",
                               "default_flow": "AnchorEntry(DefaultFlowCallback)", "swanlab": "SwanlabCallback",
                               "wandb": "WandbCallback", "tensorboard": "TensorboardCallback",
                               NAME: "YetoDiLoCoCallback"}
    assert got["wraps_real"] and got["others_untouched"] and got["subclass"] and got["reimport_same"]
    assert not got["bridge_loaded"]  # the TransformerEngine path stayed closed
    assert got["named"] == ["YetoDiLoCoCallback", "PrintCallback", "DefaultFlowCallback"]
    assert got["off"] == ["PrintCallback", "DefaultFlowCallback"]
    assert got["auto"] == [["YetoAutoAttached", ["YetoDiLoCoCallback", "PrintCallback"]], "DefaultFlowCallback"]
    assert got["composite_is_megatron_callback"] and got["bar_forwarded"] and got["bar_closed"]
    # yeto's step runs before swift's default_flow counts the step's samples and marks the save
    assert got["events"] == ["start", ["step", 64, 1, 0, False], ["step", 64, 2, 4, False],
                             ["step", 64, 3, 8, False], ["finish", False], ["save", 3], "close"]
    assert got["consumed"] == 12 and got["should_log"] and got["print_step"] == 3
    assert {"yeto_pushes", "yeto_installs", "iteration", "train_speed(s/it)"} <= set(got["logs"])
    assert got["jsonl"] is not None and got["jsonl"]["yeto_pushes"] == 3 and got["jsonl"]["iteration"] == "3/3"
