"""A bulk job's part is background work: marked `shoal_bulk`, never coalesced (the mark is
a header of its own message), and split by a worker into batch-sized pieces rather than
pieces as short as SHOAL_PART_TARGET_MS asks."""

from __future__ import annotations

from batching.cost import CostModel
from batching.former import BatchLimits
from batching.parts import items_per_part
from gateway.broker import _coalescible, _Outgoing
from tasks.envelope import H_BULK, Annotations, Part, read_annotations, single_message


def test_the_bulk_header_travels_and_bulk_parts_go_alone():
    bulk = Annotations("m", "encode", 512, 12_800, 25, None, 1.0, bulk=True)
    message = single_message(Part("job.0", bulk, b"body"), "gw")
    assert message.headers[H_BULK] == 1
    assert read_annotations(message.headers).bulk is True
    plain = Annotations("m", "encode", 1, 25, 25, None, 1.0)
    assert H_BULK not in single_message(Part("t", plain, b"b"), "gw").headers
    assert read_annotations(single_message(Part("t", plain, b"b"), "gw").headers).bulk is False

    def outgoing(task_id: str, a: Annotations) -> _Outgoing:
        return _Outgoing(Part(task_id, a, b"small body"), 1.0, None)  # type: ignore[arg-type]

    groups = _coalescible([outgoing("a", plain), outgoing("job.0", bulk), outgoing("c", plain)])
    assert [[o.part.task_id for o in g] for g in groups] == [["job.0"], ["a", "c"]]


def test_without_a_target_a_part_is_split_into_full_batches():
    # MiniLM's CPU profile: 64 items, 10.1 ms + 103 us per padded token; 25-token texts.
    limits = BatchLimits(max_tokens=4096, max_items=64)
    cost = CostModel(0.0101, 103e-6, 0.0)
    with_target = items_per_part(512, 25, 512 * 25, limits, cost, target_s=0.1)
    assert with_target < 40  # what the latency target allows: ~35 texts a piece
    assert items_per_part(512, 25, 512 * 25, limits, cost, target_s=None) == 64
