"""The syncer's merge math (DESIGN §5): learner weights, RDA, the isotropic merge, the outer step, HeLoCo."""
