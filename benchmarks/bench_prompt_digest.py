"""What a prompt's digest costs on vLLM's scheduler thread (once per request, on P and on D).

Compares ``messages.prompt_digest`` (the ids pickled as a list) with the former encoding (the ids
packed into an int64 ``array``) on random token ids of several prompt lengths, same run.
Writes ``benchmarks/results/prompt_digest.json``.

    .venv/bin/python benchmarks/bench_prompt_digest.py
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import timeit
from array import array
from pathlib import Path

from kv_push.common.messages import prompt_digest


def former(ids: list[int]) -> str:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=8).hexdigest()


def main() -> None:
    rows = []
    for n in (1024, 4096, 16384, 65536):
        ids = [random.randrange(152_000) for _ in range(n)]
        row = {"tokens": n}
        for name, fn in (("pickle_list", prompt_digest), ("int64_array", former)):
            best = min(timeit.repeat(lambda: fn(ids), number=20, repeat=7)) / 20
            row[f"{name}_ms"] = round(best * 1e3, 4)
        row["ratio"] = round(row["pickle_list_ms"] / row["int64_array_ms"], 3)
        rows.append(row)
        print(row)
    out = Path(__file__).parent / "results" / "prompt_digest.json"
    out.write_text(json.dumps({"load_avg": os.getloadavg(), "cpus": os.cpu_count(),
                               "cases": rows}, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
