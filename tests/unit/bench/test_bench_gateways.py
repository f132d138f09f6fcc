"""bench.gateways: the running order and the CPU of each process by role."""

from __future__ import annotations

import argparse

import pytest

from bench.gateways import _levels, cpu_roles, schedule


def test_every_round_runs_every_level_and_the_order_flips():
    assert schedule(3, [1, 2]) == [(0, 1), (0, 2), (1, 2), (1, 1), (2, 1), (2, 2)]


def test_cpu_is_grouped_by_role_with_each_gateway_process_apart():
    cpu = {"shoal gateway (10)": 0.01, "python (11)": 0.5, "python (12)": 0.25,
           "python (13)": 0.0, "shoal worker (20)": 0.3, "runtime (21)": 0.1,
           "beam.smp (30)": 0.4, "total": 1.56}
    roles = cpu_roles(cpu, [11, 12])
    assert roles["gateway_processes"] == [0.5, 0.25]
    assert roles["gateway_supervisor"] == 0.01
    assert roles["gateway"] == pytest.approx(0.76)
    assert roles["worker"] == pytest.approx(0.4)
    assert roles["broker"] == 0.4 and roles["other"] == 0.0 and roles["total"] == 1.56


def test_one_gateway_process_is_the_command_itself():
    roles = cpu_roles({"shoal gateway (10)": 0.6, "total": 0.6}, [10])
    assert roles["gateway_processes"] == [0.6] and roles["gateway_supervisor"] == 0.0


@pytest.mark.parametrize("text", ["0,1", "1,1", "", "a"])
def test_levels_must_be_distinct_counts_of_at_least_one(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _levels(text)
