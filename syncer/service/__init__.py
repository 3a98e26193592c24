"""The syncer as a running service (DESIGN §4.1, §7): the command line, the coordinator shell, sockets and metrics."""
