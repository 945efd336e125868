"""benchmarks/stages.py runs and measures what it says (its timings are not tested:
a timed unit test is noise on a shared machine)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import benchmark_module

stages = benchmark_module("stages")


def test_a_round_times_every_rank_the_awaits_and_the_whole() -> None:
    medians = asyncio.run(stages.aaccl_calls(200))  # (it checks the allreduces' results)
    assert len(medians) == stages.RANKS + 2
    assert all(m > 0 for m in medians)
    *ranks, _, whole = medians
    assert whole >= max(ranks)  # the round spans every call in it


def test_the_parts_that_do_not_add_up_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    stages.show("x", [1.0, 1.0, 1.0, 1.0, 0.5, 4.5])  # the parts add up
    assert "warning" not in capsys.readouterr().out
    stages.show("x", [1.0, 1.0, 1.0, 1.0, 0.5, 9.0])  # half the round unaccounted for
    assert "x's parts add up to 4.50 us, its round takes 9.00" in capsys.readouterr().out
