"""The wheel ships the templates and installs the `sparsegen` command."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_templates(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sparsegen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.name for p in (ROOT / "templates").iterdir() if p.is_file())
    assert templates, "templates/ is empty"
    for name in templates:
        assert f"sparsegen/templates/{name}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "sparsegen = sparsegen.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_templates_found_from_source_tree():
    from sparsegen.jit.render import templates_dir

    assert templates_dir() == ROOT / "templates" or templates_dir().name == "templates"
