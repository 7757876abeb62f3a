"""``NODETRAIN_FAULTS`` (run/inject.py): a fault set by halves, or a key given twice, is refused at
start-up with every other problem, not accepted as "injected" and then never fired."""

from __future__ import annotations

import pytest

from nodetrain.config.checks import ConfigError
from nodetrain.run.inject import ENV, Faults


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Faults.from_env(2, {ENV: text})
    return [line[4:] for line in str(info.value).splitlines() if line.startswith("  - ")]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "fail_rank=1",
            "fail_rank=1 without fail_step: the fault never fires; set fail_step too, or drop fail_rank",
        ),
        (
            "fail_step=2",
            "fail_step=2 without fail_rank: the fault never fires; set fail_rank too, or drop fail_step",
        ),
        (
            "nan_step=1",
            "nan_step=1 without nan_rank: the fault never fires; set nan_rank too, or drop nan_step",
        ),
        (
            '{"nan_rank": 0}',
            "nan_rank=0 without nan_step: the fault never fires; set nan_step too, or drop nan_rank",
        ),
        (
            "tier_fail_rank=1,tier_fail_write=-1",
            "tier_fail_rank=1 without tier_fail_write: the fault never fires; set tier_fail_write too, "
            "or drop tier_fail_rank",
        ),
        (
            "fail_mode=hang",
            "fail_mode=hang without fail_rank and fail_step: nothing fails; set both, or drop fail_mode",
        ),
    ],
)
def test_a_fault_set_by_halves_is_refused(text: str, problem: str) -> None:
    assert _problems(text) == [problem]


def test_a_key_given_twice_is_refused_in_either_form() -> None:
    problems = _problems("fail_rank=0,fail_step=2,fail_rank=1")
    assert problems == ["fail_rank=1: fail_rank is already given (fail_rank=0); give each key once"]
    problems = _problems('{"nan_rank": 0, "nan_step": 3, "nan_step": 4}')
    assert problems == ["nan_step=4: nan_step is already given (nan_step=3); give each key once"]


def test_half_set_and_twice_are_gathered_with_the_other_problems() -> None:
    """One message lists all: the duplicate, the half-set pair and a range problem; an unreadable
    value of a pair is its own problem only (not also "without")."""
    problems = _problems("nan_rank=0,nan_rank=0,copy_delay_s=-1,fail_rank=x")
    assert problems == [
        "nan_rank=0: nan_rank is already given (nan_rank=0); give each key once",
        "fail_rank=x: not an integer; give an integer",
        "nan_rank=0 without nan_step: the fault never fires; set nan_step too, or drop nan_rank",
        "copy_delay_s=-1.0: must be a finite number >= 0; use 0 for no delay",
    ]


def test_whole_pairs_are_accepted() -> None:
    text = "fail_rank=1,fail_step=2,fail_mode=hang,nan_rank=0,nan_step=3,tier_fail_rank=1,tier_fail_write=0"
    assert Faults.from_env(2, {ENV: text}) == Faults(
        fail_rank=1,
        fail_step=2,
        fail_mode="hang",
        nan_rank=0,
        nan_step=3,
        tier_fail_rank=1,
        tier_fail_write=0,
    )
    assert Faults.from_env(2, {ENV: "fail_rank=-1,fail_step=-1,metrics_full_step=3"}) == Faults(
        metrics_full_step=3
    )
