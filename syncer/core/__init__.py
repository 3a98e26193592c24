"""The syncer's protocol with no I/O in it (DESIGN §4): events in, effects out, rounds, commits and the finale."""
