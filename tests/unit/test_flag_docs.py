"""docs/flags.md documents every flag: it must equal what the parser generates."""

import os

from tests.conftest import REPO
from vime.tools.flag_docs import render


def test_flag_reference_is_up_to_date():
    with open(os.path.join(REPO, "docs", "flags.md")) as f:
        committed = f.read()
    assert committed == render(), "regenerate with: python -m vime.tools.flag_docs > docs/flags.md"


def test_every_flag_has_help():
    from vime.config import build_parser

    missing = [a.option_strings for a in build_parser()._actions if a.option_strings and not a.help]
    assert not missing
