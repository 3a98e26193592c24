"""verl plugin: an RL island's actor as one DiLoCo learner (DESIGN §1.7).

Installed with yeto, the `verl.plugins` entry point `yeto = yeto_plugins.verl.entry` is imported
by verl in every process; with `YETO_DILOCO_*` set it makes the actor's training worker
`yeto_plugins.verl.worker.YetoTrainingWorker`, and nothing else changes in verl or in its
command line. Without those variables it does nothing. This package imports verl only there.
"""
