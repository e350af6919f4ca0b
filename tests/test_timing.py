"""KV_PUSH_TIMING stage lines (common/timing.py): off by default, one parseable line per stamp."""

from __future__ import annotations

import os
import subprocess
import sys

from kv_push.common import timing


def test_off_unless_the_environment_turns_it_on():
    code = "from kv_push.common import timing; print(timing.ENABLED)"
    env = {k: v for k, v in os.environ.items() if k != timing.ENV}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    on = subprocess.run([sys.executable, "-c", code], env={**env, timing.ENV: "1"},
                        capture_output=True, text=True)
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True")


def test_a_stamp_is_one_line_that_parse_reads_back(tmp_path, monkeypatch, capsys):
    timing.stamp("p_pair", "t1", key="r1", rank=0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(timing.PREFIX)
    (rec,) = timing.parse(["noise", "INFO 12-03 prefix " + err.strip(), "kv_push_timing {bad"])
    assert (rec["stage"], rec["tid"], rec["key"], rec["rank"], rec["pid"]) == (
        "p_pair", "t1", "r1", 0, os.getpid())
    path = tmp_path / "timing.log"
    monkeypatch.setattr(timing, "_FILE", str(path))
    timing.stamp("router_in", "t2")
    timing.stamp("router_out", "t2")
    assert [r["stage"] for r in timing.parse(path.read_text().splitlines())] == [
        "router_in", "router_out"]
