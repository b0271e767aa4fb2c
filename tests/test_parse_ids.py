"""One parser of token-id lists (`cli.parse_ids`) for the CLI, the report and the Explorer."""

from __future__ import annotations

import argparse

import pytest

from kimi_explore import cli
from kimi_explore.cli import IdsError, parse_ids
from kimi_explore.views.explorer import ablation


def test_parse_ids_reads_lists_and_names_the_bad_piece():
    assert parse_ids(" 17, 203,5,") == [17, 203, 5] and parse_ids("") == [] and parse_ids("-1") == [-1]
    with pytest.raises(ValueError, match=r"experts: '3x' is not an integer"):
        parse_ids("1,3x", "experts")
    for piece in ("17 203", "--5", "²"):  # "17 203" was read as the id 17203 (a valid K3 id: another prompt)
        with pytest.raises(IdsError, match=rf"token ids: '{piece}' is not an integer"):
            parse_ids(f"1, {piece}")
    for typo in ("17,,5", ",5", "1, ,2"):  # an id left out: refused, not read as 17,5
        with pytest.raises(ValueError, match="empty piece between commas"):
            parse_ids(typo)


def test_the_cli_and_the_explorer_use_the_one_parser():
    assert ablation.parse_ids is cli.parse_ids
    p = argparse.ArgumentParser()
    p.add_argument("--ids", type=parse_ids)
    assert p.parse_args(["--ids", "1,2"]).ids == [1, 2]
    assert issubclass(IdsError, argparse.ArgumentTypeError)  # argparse prints the message itself, not "invalid value"
