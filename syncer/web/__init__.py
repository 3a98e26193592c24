"""The syncer's web port: `/metrics` and the live status page, both made from the tape (DESIGN §6.4, §9.4)."""
