"""bench.lib.profiles: what py-spy's collapsed stacks say."""

from bench.lib import profiles


def test_top_functions_from_collapsed_stacks() -> None:
    collapsed = "\n".join([
        "process 1:thread (1);main (a.py:1);loop (a.py:2);work (a.py:3) 6",
        "main (a.py:1);loop (a.py:2) 3",
        "main (a.py:1);loop (a.py:2);work (a.py:3);work (a.py:3) 1",
        "garbage",
    ])
    top = {name: (inc, own) for name, inc, own in profiles.top_functions(collapsed)}
    assert top["main (a.py:1)"] == (100.0, 0.0)
    assert top["work (a.py:3)"] == (70.0, 70.0)  # counted once per stack
    assert top["loop (a.py:2)"] == (100.0, 30.0)
    assert "process 1:thread (1)" not in top
    assert profiles.top_functions("") == []


def test_by_thread_and_samples() -> None:
    collapsed = "\n".join([
        "thread (0x1): MainThread;main (a.py:1);poll (a.py:2) 3",
        'thread (0x2): "loop";run (profiles.py:1) 5',
        "thread (0x1): MainThread;main (a.py:1) 1",
    ])
    threads = profiles.by_thread(collapsed)
    assert set(threads) == {"MainThread", "loop"}
    assert profiles.samples(threads["MainThread"]) == 4 and profiles.samples(collapsed) == 9
