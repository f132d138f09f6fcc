"""tasks.ids: unique ids in uuid4's forms."""

from __future__ import annotations

import os
import uuid

from tasks import ids


def test_ids_are_version_4_uuids_and_unique() -> None:
    made = [ids.task_id() for _ in range(10_000)]
    assert len(set(made)) == len(made)
    for text in made[:100]:
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
    hexed = ids.hex_id()
    assert uuid.UUID(hex=hexed).hex == hexed and len(hexed) == 32


def test_a_forked_child_draws_its_own_prefix() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, to the parent
        os.write(write, ids.task_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    mine = ids.task_id()
    assert child[:24] != mine[:24]
