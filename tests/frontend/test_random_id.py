"""Request ids: 32 random hex digits, never repeated, also not by a forked worker."""

from __future__ import annotations

import os
import re

from frontend_svc.generation.run import random_id


def test_ids_are_unique_random_hex() -> None:
    ids = [random_id("cmpl") for _ in range(3000)]  # several refills of the buffer
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    random_id("warm")  # the parent has a buffer with ids left in it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.close(read)
        os.write(write, random_id("x").encode())
        os._exit(0)
    os.close(write)
    child_id = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child_id.startswith("x-") and child_id != random_id("x")
