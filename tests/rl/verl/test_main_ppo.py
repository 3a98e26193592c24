"""verl's own driver, `python -m verl.trainer.main_ppo`, started as the README says: Ray, verl's v1 `TaskRunner`,
its resource pools and its real `ActorRolloutRefWorker`, whose actor joins the syncer as an island and uploads
the initial weights. That is as far as verl goes on a CPU: the v1 trainer then builds its rollout servers
(`LLMServerManager` -> `get_rollout_replica_class`, verl/workers/rollout/replica.py:418), and the only replicas
verl registers are vLLM, SGLang and TensorRT-LLM servers, all GPU engines. The test pins that stopping point, so
a verl that gets further, or a join that breaks, shows here.

What the CPU needs, none of it in the product: verl's CPU platform and recording rollout (`cpu_platform.py`,
`cpu_rollout.py`, loaded in every Ray process through verl's own `VERL_USE_EXTERNAL_MODULES`), one logical GPU
for Ray (verl sizes its pools in GPUs), and one storage unit for verl's TransferQueue. Ray listens on every
interface, so the syncer, the driver and the cluster it starts run in a network namespace with only loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parents[2]
pytestmark = pytest.mark.timeout(300)

SCENARIO = r"""
import json, os, re, secrets, signal, subprocess, sys, tempfile, time
from pathlib import Path
here, work = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(here))
from tiny_model import write_tiny_qwen2
import pandas as pd

model = write_tiny_qwen2(work / "model")
rows = [{"data_source": "tiny", "prompt": [{"role": "user", "content": f"say {w}"}], "ability": "echo",
         "reward_model": {"style": "rule", "ground_truth": w}, "extra_info": {"index": i}}
        for i, w in enumerate(["abc", "def", "ghi", "jkl"] * 2)]
pd.DataFrame(rows).to_parquet(work / "train.parquet")
pd.DataFrame(rows[:2]).to_parquet(work / "val.parquet")
key = work / "yeto.key"
key.write_text(secrets.token_hex(32)); key.chmod(0o600)
tape = work / "tape.jsonl"

def started(argv, log, env):  # in the work directory: hydra writes its outputs/ where main_ppo runs
    with open(log, "wb") as sink:
        return subprocess.Popen(argv, env=env, cwd=work, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

base = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "RAY_"))}
syncer = started([sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", "1",
                  "--quorum", "1", "--fragments", "2", "--sync-interval-steps", "0", "--pipeline", "2",
                  "--key-file", str(key), "--tape", str(tape), "--checkpoint", str(work / "syncer.safetensors")],
                 work / "syncer.log", base)
deadline, address = time.monotonic() + 60, None
while address is None and time.monotonic() < deadline and syncer.poll() is None:
    found = re.search(r"listening on (127\.0\.0\.1:\d+)", (work / "syncer.log").read_text())
    address = found.group(1) if found else time.sleep(0.1)
ray_dir = tempfile.mkdtemp(prefix="yr")  # short: Ray's socket paths must fit 107 bytes
R = "actor_rollout_ref"
argv = [sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo",
        f"data.train_files={work / 'train.parquet'}", f"data.val_files={work / 'val.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=16", "data.max_response_length=8",
        f"{R}.model.path={model}", f"+{R}.model.override_config.attn_implementation=eager",
        f"{R}.actor.strategy=fsdp2", f"{R}.actor.use_torch_compile=False",
        f"{R}.actor.fsdp_config.use_torch_compile=False", f"{R}.actor.fsdp_config.model_dtype=fp32",
        f"+{R}.actor.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{R}.actor.ppo_mini_batch_size=2", f"{R}.actor.ppo_micro_batch_size_per_gpu=1", f"{R}.actor.use_kl_loss=False",
        f"{R}.rollout.name=cpu_test", f"{R}.rollout.mode=async", f"{R}.rollout.tensor_model_parallel_size=1",
        f"{R}.rollout.free_cache_engine=False", f"{R}.rollout.log_prob_micro_batch_size_per_gpu=1", f"{R}.rollout.n=2",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cpu", "trainer.logger=[console]",
        "trainer.total_epochs=1", "trainer.val_before_train=False", f"trainer.default_local_dir={work / 'ckpt'}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "+ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.num_gpus=1",
        "+ray_kwargs.ray_init.include_dashboard=False", f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
        f"hydra.run.dir={work / 'hydra'}"]
env = {**base, "PYTHONPATH": str(here), "VERL_USE_EXTERNAL_MODULES": "cpu_platform,cpu_rollout",
       "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "RAY_DISABLE_USAGE_STATS": "1",
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "YETO_DILOCO_SYNCER": address or "127.0.0.1:9", "YETO_DILOCO_KEY_FILE": str(key),
       "YETO_DILOCO_LEARNER_ID": "0", "YETO_DILOCO_RL_MODE": "sweep", "YETO_DILOCO_RECONNECT_MAX_S": "1"}
rc = None
if address:
    driver = started(argv, work / "main_ppo.log", env)
    try:
        rc = driver.wait(timeout=200)
    except subprocess.TimeoutExpired:
        rc = "timeout"
# Everything in this network namespace was started here: end it all, by pid.
mine = os.readlink("/proc/self/ns/net")
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
    try:
        if os.readlink(f"/proc/{pid}/ns/net") == mine:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
import shutil; shutil.rmtree(ray_dir, ignore_errors=True)
records = [json.loads(line) for line in tape.read_text().splitlines() if line.strip()] if tape.exists() else []
log = (work / "main_ppo.log").read_text(errors="replace") if (work / "main_ppo.log").exists() else ""
print(json.dumps({"rc": rc, "address": address, "tape": records, "log": log[-20000:],
                  "syncer": (work / "syncer.log").read_text(errors="replace")[-4000:]}))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.fail("this test runs Ray in a network namespace of its own: it needs `unshare` and `ip` (util-linux, "
                    "iproute2)")
    work = tmp_path_factory.mktemp("main_ppo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "RAY_"))}
    home = work / "home"  # a local ray.init writes ~/.ray/auth_token, which later clusters then ask for
    home.mkdir()
    env["HOME"] = str(home)
    had_outputs = (REPOSITORY / "outputs").exists()
    done = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1" "$2" "$3"',
                           sys.executable, SCENARIO, str(HERE), str(work)], cwd=REPOSITORY, env=env,
                          capture_output=True, text=True, timeout=280, start_new_session=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert had_outputs or not (REPOSITORY / "outputs").exists(), "main_ppo wrote hydra's outputs/ into the repository"
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_main_ppos_actor_joins_the_syncer_as_an_island(run: dict[str, object]) -> None:
    assert run["address"], run["syncer"]
    tape = run["tape"]
    assert isinstance(tape, list)
    joins = [r for r in tape if r["event"] == "join"]
    inits = [r for r in tape if r["event"] == "init"]
    assert [r["learner"] for r in joins] == [0], (tape, str(run["log"])[-6000:])
    assert len(inits) == 1 and inits[0]["fragments"] == 2, tape  # the actor uploaded the initial weights
    assert [r["round"] for r in tape if r["event"] == "launch"] == [0, 1], tape


def test_main_ppo_stops_at_the_rollout_servers_verl_has_only_for_gpus(run: dict[str, object]) -> None:
    log = str(run["log"])
    assert run["rc"] not in (0, "timeout"), log[-6000:]
    # the actor's worker was built (its island joined) before the trainer asked for its rollout servers
    assert "LLMServerManager.create" in log and "get_rollout_replica_class" in log, log[-6000:]
    assert "Unknown rollout mode: cpu_test. Available: ['vllm', 'sglang', 'trtllm']" in log, log[-6000:]
