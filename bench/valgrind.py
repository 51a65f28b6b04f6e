"""The valgrind runner the in-process instruction-count benches share (bench.callgrind_*).

Each of them runs its own script again under valgrind, inside the source tree it measures
(``cwd`` and ``PYTHONPATH`` = that tree) with ``--inner N``, and reads the total Ir. Only the
outer process imports this module (lazily, in its ``_ir``): the inner run imports from the
measured tree, which may be an older one without it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def callgrind_prefix(out: Path) -> list[str]:
    """The command line that runs what follows it under callgrind, writing ``out``."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]


def callgrind_total(out: Path) -> int:
    """The total instruction count (Ir) of the callgrind output file ``out``."""
    m = re.search(r"^(?:summary|totals):\s+(\d+)", out.read_text(errors="replace"), re.M)
    if not m:
        raise RuntimeError(f"{out}: no totals line")
    return int(m.group(1))


def callgrind_ir(script: str, tree: Path, n: int, *, system_malloc: bool = True) -> int:
    """Total Ir of ``python script --inner n`` run in ``tree`` under callgrind
    (``PYTHONHASHSEED=0``; ``system_malloc``: ``PYTHONMALLOC=malloc``)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    if system_malloc:
        env["PYTHONMALLOC"] = "malloc"
    with tempfile.TemporaryDirectory(prefix="cg-") as d:
        out = Path(d) / "cg.out"
        subprocess.run([*callgrind_prefix(out), sys.executable, str(Path(script).resolve()), "--inner", str(n)],
                       cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return callgrind_total(out)
