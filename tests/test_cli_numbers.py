"""Comma-separated number options are refused in one line naming the option."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from dflash_bench.cli import app
from dflash_bench.cli.checks import floats, ints, numbers


def test_lists_parse_and_bounds_hold():
    assert ints("1,4", "--levels") == (1, 4)
    assert floats("0,0.7", "--temperatures") == (0.0, 0.7)
    assert numbers("0,4", "--drafter-bits", int, 0) == (0, 4)
    for bad, parse in (("0,4", ints), ("1,x", ints), ("-0.1", floats), ("", floats)):
        with pytest.raises(typer.BadParameter):
            parse(bad, "--opt")


def test_engine_speed_refuses_bad_drafter_bits_before_loading_anything():
    result = CliRunner().invoke(app, ["engine-speed", "--drafter-bits", "4,x"])
    assert result.exit_code == 2
    assert "--drafter-bits" in result.output
