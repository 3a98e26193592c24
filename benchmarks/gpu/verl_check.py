"""Pieces of the GPU check `benchmarks/gpu/verl.sh` (real verl PPO driver, vLLM rollout, two islands).

    python benchmarks/gpu/verl_check.py data DIR --island I     # train/val parquet + the reward function
    python benchmarks/gpu/verl_check.py compare --final DIR --dumps A.jsonl B.jsonl [--max-tokens N]

`data` writes a small arithmetic task in verl's RL data format (every island its own questions, the
same validation set) and `reward.py` with verl's `compute_score` signature; nothing is downloaded.
`compare` checks that the rollouts served the syncer's final cut: verl dumps the greedy validation
generations of its last iteration (after the final cut was installed and `update_weights` ran);
both islands' must be identical, and vLLM loaded from the exported final cut (`yeto-export`) must
generate the same text for the same prompts. Prints the counts; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1 when the last number in the answer is the ground truth."""
    import re
    numbers = re.findall(r"-?\\d+", solution_str)
    return float(bool(numbers) and numbers[-1] == str(ground_truth))
'''


def rows(count: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        question = f"What is {a} + {b}? Think briefly, then give the number."
        out.append({"data_source": "yeto/arith", "prompt": [{"role": "user", "content": question}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"index": index}})
    return out


def make_data(directory: Path, island: int) -> None:
    import pandas as pd

    directory.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(512, seed=1000 + island)).to_parquet(directory / "train.parquet")
    pd.DataFrame(rows(32, seed=7)).to_parquet(directory / "val.parquet")
    (directory / "reward.py").write_text(REWARD)


def read_dump(path: Path) -> list[tuple[str, str]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["input"], r["output"]) for r in records]


def compare(final: Path, dumps: list[Path], max_tokens: int) -> int:
    first, *others = [dict(read_dump(path)) for path in dumps]
    for path, other in zip(dumps[1:], others, strict=True):
        same = sum(other.get(prompt) == output for prompt, output in first.items())
        print(f"{path}: {same}/{len(first)} greedy validation outputs equal to {dumps[0]}'s")
        if same != len(first):
            return 1
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(final), dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True)
    prompts = list(first)
    generated = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    same = sum(g.outputs[0].text == first[p] for p, g in zip(prompts, generated, strict=True))
    print(f"vLLM on the syncer's exported final cut: {same}/{len(prompts)} greedy outputs equal to the rollouts'")
    # Greedy decoding in bf16 is not batch-invariant in vLLM: a long answer may flip at a near-tie.
    return 0 if same >= 0.9 * len(prompts) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data")
    data.add_argument("directory", type=Path)
    data.add_argument("--island", type=int, required=True)
    check = commands.add_parser("compare")
    check.add_argument("--final", type=Path, required=True)
    check.add_argument("--dumps", type=Path, nargs="+", required=True)
    check.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.command == "data":
        make_data(args.directory, args.island)
        return 0
    return compare(args.final, args.dumps, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
