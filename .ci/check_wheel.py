"""Check a built lmloss wheel: its metadata (what pip reads) and its contents (what `import lmloss` needs).

Usage: python .ci/check_wheel.py dist/lmloss-*.whl  (run from the repository root by .ci/run)
Exits 1 with one line per problem.
"""

from __future__ import annotations

import email.parser
import re
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"bench", "hf", "trl", "sft", "peers", "peers-gpu", "dev"}


def main(path: str) -> int:
    source_version = re.search(r'^__version__ = "([^"]+)"', (ROOT / "src/lmloss/__init__.py").read_text(), re.M)
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    problems = []
    if meta["Name"] != "lmloss":
        problems.append(f"Name is {meta['Name']!r}")
    if not source_version or meta["Version"] != source_version.group(1):
        problems.append(f"Version {meta['Version']!r} differs from lmloss.__version__ in src/lmloss/__init__.py")
    requires = meta.get_all("Requires-Dist") or []
    core = [r for r in requires if "extra ==" not in r]
    if core != ["torch>=2.11"]:
        problems.append(f"the core requirements are {core}, expected only torch>=2.11")
    missing_extras = EXTRAS - set(meta.get_all("Provides-Extra") or [])
    if missing_extras:
        problems.append(f"extras missing: {sorted(missing_extras)}")
    if not re.search(r"^lmloss = lmloss\.cli:main$", entry_points, re.M):
        problems.append("the lmloss console script is missing from entry_points.txt")
    sources = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src/lmloss").rglob("*.py")}
    missing = sorted(sources - names)
    if missing:
        problems.append(f"modules missing from the wheel: {missing[:5]}")
    stale = sorted(n for n in names if n.endswith(".py") and n not in sources)
    if stale:  # e.g. from an old build/ directory: setuptools copies build/lib into the wheel
        problems.append(f"modules in the wheel that src/ does not have: {stale[:5]}")
    if not any(n.startswith("lmloss/sft/data/") for n in names):
        problems.append("the sft package data (lmloss/sft/data/*) is missing")
    if any(n.startswith("tests/") for n in names):
        problems.append("the tests are in the wheel")
    for p in problems:
        print(f"{path}: {p}")
    if not problems:
        print(f"{Path(path).name}: metadata and contents ok ({len(names)} files, extras {sorted(EXTRAS)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
