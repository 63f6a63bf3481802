"""Why the engine loop refuses work; the rpc layer maps each to its contract code. Torch-free."""

from __future__ import annotations


class QueueFull(Exception):
    """The waiting queue is at --max-waiting."""


class Unavailable(Exception):
    """The engine takes no new work: shutting down, stalled, or its loop died."""


class Draining(Unavailable):
    """The engine is shutting down and takes no new work."""


class Asleep(Unavailable):
    """The engine sleeps, or is going to sleep, and takes no new work until woken up."""


class SleepCancelled(Exception):
    """A sleep still waiting for its requests to finish was cancelled by a wake up."""
