"""`dflash-bench report` writes the plots and a page that a real browser renders (headless Chromium,
Debian's `chromium`, installed by tools/setup.sh when root with apt)."""

from __future__ import annotations

import shutil
import subprocess

import matplotlib.image
import pytest
from typer.testing import CliRunner

from dflash_bench.cli import app

RECEIPTS = ["receipts/decode-default.json", "receipts/exactness-default.json", "receipts/decode-default-itl.json",
            "receipts/plan-default-cpu-p4-c2048.json"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_writes_every_plot_and_a_page_embedding_them(tmp_path):
    result = CliRunner().invoke(app, ["report", *RECEIPTS, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "index.html").read_text()
    for name in ("speedup", "tokens-per-round", "latency", "planner"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000 and f'src="{name}.png"' in page


def test_a_plot_without_data_is_named_on_the_page_not_drawn(tmp_path):
    CliRunner().invoke(app, ["report", "receipts/exactness-default.json", "--out", str(tmp_path)])
    assert not (tmp_path / "planner.png").exists() and not (tmp_path / "speedup.png").exists()
    assert "no plan --check receipt" in (tmp_path / "index.html").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tools/setup.sh installs Debian's "
                                              "chromium when run as root with apt)")
def test_headless_chromium_renders_the_page_with_its_plots(tmp_path):
    out = tmp_path / "report"
    CliRunner().invoke(app, ["report", *RECEIPTS, "--out", str(out)])
    shot = tmp_path / "page.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,2000",
                    (out / "index.html").as_uri()], check=True, capture_output=True, timeout=120)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1280)
    # a blank page is one colour; the plots' bars and text make many, over much of the page
    assert pixels.std() > 0.05
    rows_drawn = (pixels.std(axis=(1, 2)) > 0.01).mean()
    assert rows_drawn > 0.3
