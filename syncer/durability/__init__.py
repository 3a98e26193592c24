"""What outlives the syncer (DESIGN §6): the checkpoint and its writes, the event tape, one writer per run, stopping."""
