"""``bench/against.py`` runs a benchmark on this tree and on another commit: each
run must import the tensortape of its own tree, whatever is installed (an
editable install of this tree included)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
    reason="needs a git checkout")


def test_each_run_imports_its_own_tree(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import os, tensortape\n"
                      "print('FROM', os.path.realpath(os.path.dirname(tensortape.__file__)))\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "against.py"), "HEAD",
                          "--pairs", "1", "--", str(script)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    here, other = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("FROM")]
    assert here == os.path.realpath(ROOT)
    assert other != here and os.path.basename(other) == "tree"     # the other commit's worktree
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert other not in listed                                      # and removed after
