"""Seconds per test file from a pytest junit XML report, written to tests/durations.json (the
order tests/conftest.py runs the files in: longest first).

    PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml bash .ci/run
    python scripts/test_durations.py /tmp/junit.xml
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_file(classname: str, root: Path) -> str | None:
    """The file a junit ``classname`` (``tests.test_x`` or ``tests.test_x.TestClass``) names,
    relative to ``root``, or None when no such file is there."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = Path(*parts[:n]).with_suffix(".py")
        if (root / path).is_file():
            return path.as_posix()
    return None


def durations(report: Path, root: Path) -> dict[str, float]:
    """Seconds per test file in ``report``, longest first (setup and teardown included, as
    junit counts them)."""
    try:
        tree = ET.parse(report)
    except (OSError, ET.ParseError) as e:
        raise SystemExit(f"{report}: not a junit XML report ({e})") from None
    seconds: dict[str, float] = defaultdict(float)
    for case in tree.iter("testcase"):
        path = test_file(case.get("classname", ""), root)
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    if not seconds:
        raise SystemExit(f"{report}: no test case of a file under {root}")
    return {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="pytest's --junitxml file")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "durations.json")
    args = parser.parse_args(argv)
    result = durations(args.report, REPO)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    total = sum(result.values())
    print(f"{args.out}: {len(result)} files, {total:,.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
