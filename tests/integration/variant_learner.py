"""A learner for test_trainer_variants.py: the example's tiny model and byte data under the HF
Trainer, with `TrainingArguments` as a script might set them (a JSON object in the environment's
`TRAINER_VARIANT`; its `dtype` key, `bf16`, casts the model's weights instead), and the
`YetoDiLoCo` callback. It prints its final evaluation as a JSON line and saves the model.

    TRAINER_VARIANT='{"gradient_accumulation_steps": 3}' python tests/integration/variant_learner.py OUT_DIR

With `TRAINER_RESUME=1` it resumes from the last Trainer checkpoint in OUT_DIR, as a script
restarted after a crash does (`trainer.train(resume_from_checkpoint=True)`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def main(out_dir: str) -> int:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from yeto_plugins.hf import YetoDiLoCo

    torch.set_num_threads(1)
    variant = json.loads(os.environ.get("TRAINER_VARIANT", "{}"))
    sys.path.insert(0, str(EXAMPLES))
    import hf_tiny_llama as ex
    learner_id = int(os.environ["YETO_DILOCO_LEARNER_ID"])
    train, held_out = ex.splits(32, learner_id % 2, 2)
    model = ex.build_model(argparse.Namespace(hidden=32, layers=2, seq_len=32, seed=0))
    if variant.pop("dtype", None) == "bf16":
        model = model.to(torch.bfloat16)
    yeto = YetoDiLoCo()

    class SayBegin(TrainerCallback):  # the step training starts from: past 0 when a checkpoint was resumed
        def on_train_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
            print(json.dumps({"event": "train_begin", "step": getattr(state, "global_step", None)}), flush=True)

    settings = dict(output_dir=out_dir, max_steps=3000, per_device_train_batch_size=4, per_device_eval_batch_size=32,
                    learning_rate=3e-3, weight_decay=0.0, logging_steps=10, save_strategy="no", report_to=[],
                    use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=TrainingArguments(**{**settings, **variant}), train_dataset=train,
                      eval_dataset=held_out, callbacks=[yeto, SayBegin()])
    first = trainer.evaluate()["eval_loss"]
    result = trainer.train(resume_from_checkpoint=os.environ.get("TRAINER_RESUME") == "1" or None)
    final = trainer.evaluate()["eval_loss"]
    print(json.dumps({"event": "eval", "phase": "final", "first": first, "loss": final, "steps": result.global_step,
                      "final_cut": bool(yeto.final_installed)}), flush=True)
    model.save_pretrained(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
