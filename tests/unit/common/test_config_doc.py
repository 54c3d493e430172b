"""docs/flags.md is what the configs say: regenerate it with
``python -m common.config_doc > docs/flags.md`` after changing a flag."""

from pathlib import Path

from common.config_doc import markdown

DOC = Path(__file__).parents[3] / "docs" / "flags.md"


def test_the_flag_reference_matches_the_code():
    assert DOC.read_text() == markdown(), "docs/flags.md is stale: python -m common.config_doc > docs/flags.md"
