"""`shoal gateway --workers N` / SHOAL_GATEWAY_WORKERS: at least one process."""

from __future__ import annotations

import pydantic
import pytest

from app.cli import main
from tasks.settings import Settings


@pytest.mark.parametrize("workers", ["0", "-1", "two"])
def test_the_gateway_refuses_fewer_than_one_process(workers, capsys):
    with pytest.raises(SystemExit) as exited:  # before anything starts
        main(["gateway", "--workers", workers])
    assert exited.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_the_setting_defaults_to_one_and_refuses_zero(monkeypatch):
    monkeypatch.delenv("SHOAL_GATEWAY_WORKERS", raising=False)
    assert Settings().gateway_workers == 1
    monkeypatch.setenv("SHOAL_GATEWAY_WORKERS", "3")
    assert Settings().gateway_workers == 3
    monkeypatch.setenv("SHOAL_GATEWAY_WORKERS", "0")
    with pytest.raises(pydantic.ValidationError):
        Settings()
