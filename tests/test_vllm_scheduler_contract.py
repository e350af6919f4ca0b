"""vLLM's scheduler keeps the contract the decoder's early failure reports rely on.

A decoder whose producer went silent fails the request at once, reporting the request's pushed
blocks as load errors, but names the request in ``finished_recving`` only once no WRITE of the
producer can land in those blocks (``common/connector_worker.py``). That is safe only if vLLM,
told of the failure, never frees or reuses the blocks before ``finished_recving`` -- and useful
only if, with ``kv_load_failure_policy=fail``, it ends the request (answers its client) at once.
``tests/vllm_scheduler_probe.py`` drives each tested vLLM version's real scheduler through the
cases; this checks its answers. A vLLM that changes this breaks here, not in production. It
also checks that a step in which every request waits for its KV schedules no token: the
decoder's worker waits for an outcome only in such a step (``idle_step_wait_s``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

try:
    from e2e_support import tiny_model_path, venvs
except ModuleNotFoundError:  # imported as a package module
    from tests.e2e_support import tiny_model_path, venvs

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).with_name("vllm_scheduler_probe.py")


@pytest.fixture(scope="module", params=venvs(), ids=lambda v: f"vllm-{v[0]}")
def answers(request) -> dict:
    version, python = request.param
    if not Path(python).exists():
        pytest.fail(f"vLLM {version} environment {python} is missing: run `make test`")
    run = subprocess.run([python, str(PROBE), str(tiny_model_path())], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["vllm"].startswith(version), got["vllm"]
    return got


def test_fail_ends_the_request_at_once_and_holds_its_blocks_until_finished_recving(answers):
    a = answers["early/fail"]
    assert a["waiting"] == "WAITING_FOR_REMOTE_KVS" and len(a["pushed"]) == 3
    assert a["blocks"][:2] == a["c_blocks"][:2]  # B's first blocks: the cached prefix C shares
    assert a["report_ended"] == [["B", "error"]]  # the client is answered in that step
    assert a["after_report"] == "FINISHED_ERROR"
    assert a["blocks_after_report"] == a["blocks"]  # ... but every block is still B's
    assert a["c_after_report"] == "RUNNING"  # the request sharing its prefix is untouched
    assert a["fillers_on_pushed"] == []  # fillers that want every block get none of B's
    assert a["second_report_ended"] == [] and a["after_second_report"] == "FINISHED_ERROR"
    assert a["after_finished_recving"] is None and a["blocks_after_finished_recving"] is None
    # its blocks came back only now (with the prefix blocks, where C is done with them too)
    assert a["free_after_finished_recving"] - a["free_before_finished_recving"] >= len(a["pushed"])


def test_recompute_waits_for_finished_recving_then_computes_into_the_same_blocks(answers):
    a = answers["early/recompute"]
    assert a["report_ended"] == [] and a["after_report"] == "WAITING_FOR_REMOTE_KVS"
    assert a["computed_after_report"] == 32  # cut back to the local prefix (2 blocks of 16)
    assert a["blocks_after_report"] == a["blocks"] and a["fillers_on_pushed"] == []
    assert a["second_report_ended"] == [] and a["after_second_report"] == "WAITING_FOR_REMOTE_KVS"
    assert a["later"] == "RUNNING" and a["later_blocks"] == a["blocks"]
    assert a["later_computed"] > 32  # it computed the pushed part itself


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_report_after_the_clients_abort_changes_nothing(answers, policy):
    a = answers[f"abort_first/{policy}"]
    assert a["after_abort"] == "FINISHED_ABORTED" and a["blocks"] == a["pushed"]  # held
    assert a["report_ended"] == [] and a["filler"] == "RUNNING"
    assert a["filler_on_pushed"] == []
    assert a["after_finished_recving"] is None
    # B's blocks came back only now
    assert a["free_after_finished_recving"] - a["free_before_finished_recving"] == len(a["pushed"])


def test_a_step_where_every_request_waits_for_its_kv_schedules_no_token(answers):
    # StepPlan.idle (connector_scheduler) is total_num_scheduled_tokens == 0: in such a step
    # the decoder's worker may wait for an outcome (idle_step_wait_s); never in one that runs
    # a model
    a = answers["idle"]
    assert [tuple(x) for x in a["alone"]] == [("WAITING_FOR_REMOTE_KVS", 0)] * 2
    b, c, tokens = a["with_c_running"]
    assert (b, c) == ("WAITING_FOR_REMOTE_KVS", "RUNNING") and tokens > 0
    state, tokens = a["b_after_finished_recving"]
    assert state == "RUNNING" and tokens > 0
