"""Rebuild the committed tiny models (data/tiny/) from their specs: the default `TinySpec()` and the tool
model of conf/model/tiny_tool.yaml. Run after changing either spec (tests/unit/test_tiny_shipped.py says when),
then commit data/tiny/.

    python scripts/ship_tiny.py            # builds what is missing or stale (~7 and ~27 min on 2 cores)
    python scripts/ship_tiny.py --rebuild  # builds both again
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="build every shipped model again")
    args = parser.parse_args()
    from pace.tiny import SHIPPED, build_tiny, shipped_specs

    keep = set()
    for name, spec in shipped_specs().items():
        target = SHIPPED / f"tiny-{spec.key()}"
        keep.add(target.name)
        if (target / "meta.json").exists() and not args.rebuild:
            print(f"{name}: {target.relative_to(ROOT)} is current")
            continue
        with tempfile.TemporaryDirectory() as cache:
            built = build_tiny(spec, cache, progress=True, shipped=False)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(built, target)
        print(f"{name}: built {target.relative_to(ROOT)}")
    for stale in SHIPPED.glob("tiny-*"):
        if stale.name not in keep:
            shutil.rmtree(stale)
            print(f"removed {stale.relative_to(ROOT)} (no current spec has its key)")


if __name__ == "__main__":
    main()
