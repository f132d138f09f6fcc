from tasks.settings import Settings
from tasks.topology import model_queue, model_slug, queue_for


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


# --- a model's queue type: its catalog entry's, else SHOAL_QUEUE_TYPE -----------------------


def test_the_entrys_queue_type_wins_over_the_setting():
    quorum, classic = Settings(queue_type="quorum"), Settings(queue_type="classic")
    assert queue_for("a/b", quorum, "classic").arguments["x-queue-type"] == "classic"
    assert queue_for("a/b", classic, "quorum").arguments["x-queue-type"] == "quorum"
    assert queue_for("a/b", classic, "quorum").arguments["x-delivery-limit"] == \
        classic.queue_delivery_limit


def test_no_queue_type_is_the_settings():
    for setting in ("quorum", "classic"):
        settings = Settings(queue_type=setting)
        assert queue_for("a/b", settings).arguments["x-queue-type"] == setting
        assert queue_for("a/b", settings, None).arguments["x-queue-type"] == setting


def test_a_classic_queue_for_a_model_has_no_delivery_limit_and_the_same_name():
    settings = Settings(queue_prefix="p", queue_type="quorum")
    classic, quorum = queue_for("a/b", settings, "classic"), queue_for("a/b", settings)
    assert "x-delivery-limit" not in classic.arguments
    assert quorum.arguments["x-delivery-limit"] == settings.queue_delivery_limit
    # Only the type and its delivery limit differ: same name, dead-lettering and bound.
    assert (classic.name, classic.dead_letter_queue) == (quorum.name, quorum.dead_letter_queue)
    same = {k: v for k, v in quorum.arguments.items()
            if k not in ("x-queue-type", "x-delivery-limit")}
    assert {k: v for k, v in classic.arguments.items() if k != "x-queue-type"} == same
