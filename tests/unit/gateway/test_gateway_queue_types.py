"""The gateway declares each model's queue with the type its catalog entry gives it (the
type the workers declare it with), SHOAL_QUEUE_TYPE's where the entry sets none. The app
is never started here: what it would declare is read from its broker's ModelQueues."""

from __future__ import annotations

from pathlib import Path

import yaml

from tasks.settings import Settings
from tasks.topology import queue_for


def _catalog(folder: Path) -> None:
    weights = str(folder)  # never loaded here
    for name, extra in {"classic": {"queue_type": "classic"}, "quorum": {"queue_type": "quorum"},
                        "plain": {}}.items():
        entry = {"id": f"test/qt-{name}", "adapter": "dense", "source": {"path": weights},
                 "dims": 8, **extra}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(entry))


def test_the_gateway_declares_each_models_queue_of_its_entrys_type(tmp_path):
    from gateway.app import create_app

    _catalog(tmp_path)
    for setting in ("quorum", "classic"):
        settings = Settings(catalog_dir=tmp_path, gateway_models=["test/qt-*"],
                            queue_type=setting)
        queues = create_app(settings).state.broker.queues.queues
        types = {m: q.arguments["x-queue-type"] for m, q in queues.items()}
        assert types == {"test/qt-classic": "classic", "test/qt-quorum": "quorum",
                         "test/qt-plain": setting}
        # The very arguments a worker declares (app.worker.steps.model_queues does the same call).
        assert queues["test/qt-classic"].arguments == \
            queue_for("test/qt-classic", settings, "classic").arguments
        assert "x-delivery-limit" not in queues["test/qt-classic"].arguments
