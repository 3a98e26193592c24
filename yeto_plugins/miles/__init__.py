"""yeto for Miles RL islands (radixark/miles): an island's Megatron actor as one DiLoCo learner.

Streaming (`YETO_DILOCO_RL_MODE=stream`) needs no change to Miles: point
``--custom-megatron-before-train-step-hook-path`` at ``yeto_plugins.miles.hook.before_train_step``.
The policy sweep and overlap modes run Miles' own driver through ``python -m
yeto_plugins.miles.train``, which adds one sweep on every actor between ``train`` and
``update_weights``. See `hook.py` and `driver.py`; nothing here imports Miles at import time.
"""
