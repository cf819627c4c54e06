"""Print shard I of N of the test suite (``I/N``, from 1): test classes (or module-level tests),
each whole, so a class's ``setUpClass`` runs in one shard only, dealt greedily by their number of
collected tests to the shard with the fewest so far (collection order breaks ties). The shards
together hold every collected test exactly once. Used by ``.ci/gpu_test`` when
``SPARSETP_TEST_SHARD`` is set (one device call cannot hold the whole suite on every GPU).

    python3 .ci/shard_tests.py 1/2 [pytest collection arguments...]
"""

from __future__ import annotations

import subprocess
import sys


def _groups(args: list[str]) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args], capture_output=True, text=True,
                          check=False)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    if done.returncode or not ids:
        sys.exit(f"shard_tests: collection failed (rc {done.returncode}):\n"
                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    groups: dict[str, int] = {}
    for node in ids:
        parts = node.split("::")
        # file::Class::test[param] -> file::Class; file::test[param] -> file::test
        key = "::".join(parts[:2]).split("[")[0]
        groups[key] = groups.get(key, 0) + 1
    return groups


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].count("/") != 1:
        sys.exit("usage: shard_tests.py I/N [pytest arguments...]")
    i, n = (int(x) for x in sys.argv[1].split("/"))
    if not 1 <= i <= n:
        sys.exit(f"shard {i}/{n}: I must be in 1..N")
    groups = _groups(sys.argv[2:] or ["tests"])
    load, mine = [0] * n, []
    for key, count in sorted(groups.items(), key=lambda kv: -kv[1]):
        s = load.index(min(load))
        load[s] += count
        if s == i - 1:
            mine.append(key)
    print("\n".join(mine))


if __name__ == "__main__":
    main()
