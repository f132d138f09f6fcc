"""A plain Celery client's message gets the headers a gateway would write."""

from __future__ import annotations

from tasks.catalog import load_catalog
from tasks.celery_app import _annotate_shoal_task, settings
from tasks.envelope import read_annotations
from tasks.names import ENCODE, SCORE
from tasks.token_estimate import DEFAULT_MAX_TOKENS

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _publish(task: str, kwargs: dict, **headers) -> dict:
    headers = {"task": task, "id": "t", **headers}
    _annotate_shoal_task(sender=task, body=[[], kwargs, {}], headers=headers, properties={})
    return headers


def test_the_hook_writes_the_entrys_estimate():
    kwargs = {"model": MINILM, "items": [{"text": "x" * 4000}, {"text": "hi"}]}
    entry = load_catalog(settings.catalog_dir).get(MINILM)
    assert entry is not None
    ann = read_annotations(_publish(ENCODE, kwargs))
    assert ann is not None and (ann.model, ann.op) == (MINILM, "encode")
    assert (ann.items, ann.cost, ann.longest) == entry.estimate(kwargs)
    assert ann.longest == (entry.max_seq_length or DEFAULT_MAX_TOKENS)


def test_the_task_names_the_operation_so_the_worker_can_refuse_it():
    ann = read_annotations(_publish(SCORE, {"model": MINILM, "items": [], "query": "q"}))
    assert ann is not None and ann.op == "score"


def test_a_model_the_catalog_lacks_gets_no_headers():
    headers = _publish(ENCODE, {"model": "nobody/knows", "items": [{"text": "hi"}]})
    assert read_annotations(headers) is None


def test_headers_already_written_are_kept():
    headers = _publish(ENCODE, {"model": MINILM, "items": []}, shoal_model=MINILM,
                       shoal_op="encode", shoal_items=9, shoal_cost=9)
    ann = read_annotations(headers)
    assert ann is not None and ann.items == 9


def test_a_celery_client_declares_the_queue_type_of_the_models_entry(monkeypatch, tmp_path):
    """A client's publish declares the model's queue: with the type the gateway and the
    workers give it, the entry's, or RabbitMQ would refuse the declaration."""
    from tasks import celery_app

    (tmp_path / "c.yaml").write_text("id: me/classic\nadapter: dense\ndims: 8\n"
                                     "source: {hub: me/classic}\nqueue_type: classic\n")
    monkeypatch.setattr(settings, "catalog_dir", tmp_path)

    def queue_type(model: str) -> str:
        route = celery_app.route_to_model_queue(ENCODE, [], {"model": model, "items": []}, {})
        assert route is not None
        return route["queue"].queue_arguments["x-queue-type"]

    assert queue_type("me/classic") == "classic"
    assert queue_type(MINILM) == settings.queue_type  # the entry sets none
    assert queue_type("nobody/knows") == settings.queue_type  # no entry
