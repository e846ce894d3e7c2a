"""Exit 0 when every BF16-engine row of a ``bench_vllm.py --parts mismatch`` JSON is sane (token-mult-prob-error
below 2: the engine and the HF forward compute the same model), 1 otherwise (or when there is no such row).

    python benchmarks/h200_session_check.py OUT/bench_vllm.json

``benchmarks/h200_session.sh`` step 4 uses it to choose its last measurement: decode when the control is sane, the
control again with ``--enforce-eager`` (graphs and compile out) when it is not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SANE_TMPE = 2.0


def bf16_control_sane(results: dict) -> bool:
    rows = [r for r in results.get("mismatch", []) if r.get("arm") == "BF16"]
    return bool(rows) and all(r.get("tmpe") is not None and r["tmpe"] < SANE_TMPE for r in rows)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else None
    if path is None or not path.is_file():
        print(f"h200_session_check: no results at {path}")
        return 1
    sane = bf16_control_sane(json.loads(path.read_text()))
    print(f"h200_session_check: BF16 control {'sane' if sane else 'NOT sane (or missing)'}")
    return 0 if sane else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
