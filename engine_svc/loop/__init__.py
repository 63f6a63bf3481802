"""The engine busy loop, one concern a module:

engine_loop.py  the loop thread: builds the core, drains its inbox (requests, aborts,
                calls) between steps, steps, and hands each client its outputs
clients.py      the clients (a sink each) and their requests' ids; what a client gets per
                step (``ClientBatch``, ``LoadFigures``). Torch-free
sleep.py        the sleep state machine (Sleep / WakeUp)
liveness.py     stall detection (the loop's heartbeat) and draining at shutdown
errors.py       why new work is refused (``QueueFull``, ``Unavailable`` ...). Torch-free
"""
