"""The `--shard I/N` option of tests/conftest.py: every test in exactly one shard, bad specs refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shard_items, shard_spec


@pytest.mark.parametrize("count,n", [(0, 3), (1, 3), (10, 3), (301, 3), (7, 7), (5, 8)])
def test_shards_cover_every_item_once_and_balance(count, n):
    items = [f"t{j}" for j in range(count)]
    parts = [shard_items(items, i, n) for i in range(1, n + 1)]
    kept = [k for k, _ in parts]
    assert sorted(sum(kept, [])) == sorted(items)
    assert max(map(len, kept)) - min(map(len, kept)) <= 1
    for k, dropped in parts:
        assert sorted(k + dropped) == sorted(items) and not set(k) & set(dropped)


@pytest.mark.parametrize("bad", ["", "3", "0/3", "4/3", "a/b", "1/0", "1/2/3"])
def test_bad_spec_is_refused(bad):
    with pytest.raises(ValueError, match="--shard"):
        shard_spec(bad)


def test_shard_option_selects_through_pytest(tmp_path):
    """A real pytest run: 2/3 of a 7-test file runs tests 1 and 4 (0-based) and deselects the rest."""
    here = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text((here / "conftest.py").read_text())
    (tmp_path / "test_many.py").write_text(
        "import pytest\n@pytest.mark.parametrize('j', range(7))\ndef test_j(j):\n    print('RAN', j)\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--shard", "2/3",
                          str(tmp_path / "test_many.py")], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(int(j) for j in re.findall(r"RAN (\d+)", out.stdout)) == [1, 4]
    assert "2 passed, 5 deselected" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--shard", "4/3",
                          str(tmp_path / "test_many.py")], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode != 0 and "I must be between 1 and N" in bad.stderr
