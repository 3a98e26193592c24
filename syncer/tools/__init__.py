"""User tools beside the service, not part of it: `yeto-plan` (DESIGN §10), `yeto-plot` (§6.4), `yeto-export` (§6.5)."""
