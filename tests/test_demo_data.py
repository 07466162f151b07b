"""The demo's bundled dataset: shipped as generated, held-out numbers never trained on."""

from __future__ import annotations

import re
from pathlib import Path

from dpserve import demo_data


def test_the_shipped_files_are_what_generate_makes(tmp_path: Path):
    demo_data.write(tmp_path)
    for name in (demo_data.TRAIN_FILE, demo_data.HELDOUT_FILE):
        assert demo_data.path(name).read_text() == (tmp_path / name).read_text(), (
            f"{name} is stale: run `python -m dpserve.demo_data`")


def test_no_held_out_number_appears_in_any_training_conversation():
    def numbers(q: demo_data.Question) -> set[str]:
        digits = re.findall(r"\d{3}", q.question + " " + q.answer)
        words = re.findall(r"(?:(?:zero|one|two|three|four|five|six|seven|eight|nine) ?){3}",
                           q.question + " " + q.answer)
        spelled = {"".join(str(demo_data.DIGIT_WORDS.index(w)) for w in s.split())
                   for s in words}
        return {n for n in set(digits) | spelled if n}

    train = demo_data.load(demo_data.TRAIN_FILE)
    heldout = demo_data.load(demo_data.HELDOUT_FILE)
    seen = set().union(*(numbers(q) for q in train))
    asked = [numbers(q) for q in heldout]
    assert len(heldout) == demo_data.HELDOUT_NUMBERS and all(asked)
    assert not seen & set().union(*asked)
    assert len(train) == 3 * 823


def test_the_held_out_questions_cycle_through_the_three_tasks():
    heldout = demo_data.load(demo_data.HELDOUT_FILE)
    assert [q.question.split()[0] for q in heldout[:3]] == ["Spell", "Write", "Reverse"]
    assert demo_data.tasks(472) == (
        demo_data.Question("Spell 472.", "four seven two"),
        demo_data.Question("Write four seven two in digits.", "472"),
        demo_data.Question("Reverse the digits of 472.", "274"),
    )
