"""The connector's own samples out of a perf profile of a whole ``vllm_workload.py`` run.

A profile of the run is mostly vLLM (its engine step, its start-up); this keeps the samples
taken inside the connector's timed calls, by the call intervals the bench writes::

    KVOFFLOAD_BENCH_TRACE=/tmp/calls.txt perf record -F 1999 -k CLOCK_MONOTONIC -o /tmp/p.data \\
        -- .venv-vllm/bin/python benches/vllm_workload.py --b 512 --attention full \\
        --connectors ours
    perf script -i /tmp/p.data -F time,ip,sym,dso --ns > /tmp/p.script
    python3 benches/ab/perf_calls.py /tmp/calls.txt < /tmp/p.script

It prints the samples per connector method, then per shared object and per symbol (the top
``--top``), over the whole run's calls or only one method's (``--method``).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="the file KVOFFLOAD_BENCH_TRACE named")
    ap.add_argument("--method", help="only samples inside this connector method")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    calls = []
    with open(a.trace) as f:
        for line in f:
            name, t0, t1 = line.split()
            calls.append((float(t0), float(t1), name))
    calls.sort()
    starts = [c[0] for c in calls]
    by_method: collections.Counter[str] = collections.Counter()
    by_dso: collections.Counter[str] = collections.Counter()
    by_sym: collections.Counter[str] = collections.Counter()
    total = 0
    for line in sys.stdin:
        head, _, rest = line.strip().partition(":")
        try:
            t = float(head)
        except ValueError:
            continue
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > calls[i][1]:
            continue
        name = calls[i][2]
        if a.method and name != a.method:
            continue
        total += 1
        sym, _, dso = rest.strip().partition(" ")[2].rpartition(" (")
        dso = dso.rstrip(")").rsplit("/", 1)[-1]
        by_method[name] += 1
        by_dso[dso] += 1
        by_sym[f"{dso}: {sym.strip()}"] += 1
    print(f"{total} samples inside {len(calls)} calls")
    for title, counter in (("method", by_method), ("object", by_dso), ("symbol", by_sym)):
        print(f"\n## by {title}")
        for key, n in counter.most_common(a.top):
            print(f"{n:8d} {100 * n / max(1, total):5.1f}%  {key}")


if __name__ == "__main__":
    main()
