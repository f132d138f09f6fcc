from tasks.topology import model_queue, model_slug


def test_queue_name_rule():
    assert model_slug("sentence-transformers/all-MiniLM-L6-v2") == \
        "sentence-transformers.all-minilm-l6-v2"
    assert model_slug("BAAI/bge-small-en-v1.5") == "baai.bge-small-en-v1.5"
    assert model_slug("org/we!rd name") == "org.we-rd-name"


def test_model_queue_is_a_bounded_quorum_queue_with_dead_lettering():
    mq = model_queue("a/b", prefix="p", max_length=5, delivery_limit=7)
    assert mq.name == "p.model.a.b"
    assert mq.dead_letter_queue == "p.model.a.b.dead"
    assert mq.arguments == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "p.dlx",
        "x-dead-letter-routing-key": "p.model.a.b",
        "x-delivery-limit": 7,
        "x-max-length": 5,
        "x-overflow": "reject-publish",
    }


def test_classic_queue_has_no_delivery_limit():
    mq = model_queue("a/b", prefix="p", max_length=5, delivery_limit=7, queue_type="classic")
    assert mq.arguments["x-queue-type"] == "classic"
    assert "x-delivery-limit" not in mq.arguments
    assert mq.arguments["x-overflow"] == "reject-publish"
