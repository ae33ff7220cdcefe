"""What grew in the web process between two tracemalloc snapshots of ``soak --trace-memory DIR``.

Run: ``.venv/bin/python scripts/memory_trace_diff.py DIR [--top 15] [--frames 6]``: the first
snapshot after the warm-up (the second one) against the last, grouped by traceback, largest growth
first, with the RSS and traced totals of each snapshot (``rss.jsonl``).
"""

import argparse
import tracemalloc
from pathlib import Path

IGNORED = [
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--frames", type=int, default=6, help="frames of each traceback shown")
    args = parser.parse_args()
    folder = Path(args.folder)
    for line in (folder / "rss.jsonl").read_text().splitlines():
        print(line)
    snapshots = sorted(folder.glob("snapshot-*.pickle"))
    if len(snapshots) < 3:
        raise SystemExit(
            f"{folder}: need at least 3 snapshots (the first is the warm-up), got {len(snapshots)}"
        )
    first, last = snapshots[1], snapshots[-1]
    before = tracemalloc.Snapshot.load(str(first)).filter_traces(IGNORED)
    after = tracemalloc.Snapshot.load(str(last)).filter_traces(IGNORED)
    stats = after.compare_to(before, "traceback")
    total = sum(s.size_diff for s in stats)
    print(
        f"\n{first.name} → {last.name}: traced {total / 2**20:+.2f} MB in all; largest growth by traceback:"
    )
    for stat in stats[: args.top]:
        print(
            f"\n{stat.size_diff / 2**20:+.3f} MB ({stat.count_diff:+d} blocks), now {stat.size / 2**20:.2f} MB"
        )
        for frame in stat.traceback.format(limit=args.frames, most_recent_first=True):
            print("   ", frame)


if __name__ == "__main__":
    main()
