"""Placeholder main job until the parity matrix lands: a short demo of the oracle."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import lossspec

    for kind in lossspec.KINDS:
        case = lossspec.make_case(kind, "random")
        reference = case.reference()
        print(f"{case.name:45s} loss={reference.loss:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
