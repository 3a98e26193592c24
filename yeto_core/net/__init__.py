"""The socket shells: sockets, threads and the clock, around the pure wire (`yeto_core/wire/`).

`stream.py` is one TCP socket with framed sends and exact reads, and the loop that runs a
handshake machine over it; `group.py` runs a live connection group (a control stream and its
data streams) with reader and sender threads; `tickets.py` tells a sender when its bytes left.
Every decision (what a frame is, when to heartbeat, when a peer is gone, which stream carries a
chunk) is made in `yeto_core/wire/`, which reads no socket and no clock.
"""
