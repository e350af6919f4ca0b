"""What vLLM's own scheduler does with a KV load failure reported before the request's
``finished_recving`` -- the contract the decoder's early failure reports rely on
(``common/connector_worker.py``). Run with the python of a vLLM environment:

    python tests/vllm_scheduler_probe.py MODEL_DIR   # prints one JSON object per scenario

It drives vLLM's real ``Scheduler`` in-process (no workers, no model run: each step's output is
made up here) with a stand-in connector that asks for remote KV for the requests marked remote
and records the blocks vLLM allocated for it. ``tests/test_vllm_scheduler_contract.py`` runs it
under each vLLM version the suite tests and checks the answers.

Scenarios (each under ``kv_load_failure_policy`` fail and recompute):

* ``early`` -- request B (2 blocks of prompt from the local prefix cache, 3 to be pushed) waits
  for remote KV; a running request C shares B's cached prefix. The 3 pushed blocks are reported
  as load errors; then fillers ask for every block there is; the report comes again (another
  TP rank, a later step); then ``finished_recving`` names B.
* ``abort_first`` -- the client aborts B before the report; the report comes anyway (the
  engine's worker did not know yet), then ``finished_recving``.
* ``idle`` -- the tokens each step schedules while B waits for remote KV alone (none: the step
  runs no model, where the decoder's worker may wait for an outcome, ``idle_step_wait_s``),
  with another request running, and once B's KV is reported.
"""

from __future__ import annotations

import copy
import json
import logging
import sys

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

BLOCK = 16
NUM_BLOCKS = 40
#: request id -> the block ids vLLM allocated for its remote KV (what our worker would report)
ALLOC: dict[str, list[int]] = {}


class ProbeConnector(KVConnectorBase_V1):
    """Scheduler half only: remote KV for requests whose kv_transfer_params say ``remote``."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if (request.kv_transfer_params or {}).get("remote") and request.request_id not in ALLOC:
            return len(request.prompt_token_ids) - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            ALLOC[request.request_id] = list(blocks.get_unhashed_block_ids())

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    # worker half: never used here
    def start_load_kv(self, *a, **k):
        pass

    def wait_for_layer_load(self, *a):
        pass

    def save_kv_layer(self, *a, **k):
        pass

    def wait_for_save(self):
        pass


def _scheduler(model: str, policy: str):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vc = VllmConfig(
        model_config=ModelConfig(model=model, max_model_len=1024, dtype="float32"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         async_scheduling=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ProbeConnector", kv_connector_module_path="vllm_scheduler_probe",
            kv_role="kv_consumer", kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK, log_stats=False)


class Run:
    def __init__(self, model: str, policy: str):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        ALLOC.clear()
        self.s = _scheduler(model, policy)

    def add(self, rid: str, tokens: list[int], remote: bool = False) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": {"remote": True}} if remote else None
        self.s.add_request(Request(request_id=rid, prompt_token_ids=tokens,
                                   sampling_params=SamplingParams(max_tokens=4, extra_args=extra),
                                   pooling_params=None, block_hasher=self.hasher))

    def step(self, **connector_output) -> list[tuple[str, str]]:
        """One engine step; ``connector_output``: what the workers report in it. Returns the
        requests that ended in it, with their finish reason."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.s.schedule()
        self.scheduled_tokens = so.total_num_scheduled_tokens  # 0: a step that runs no model
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7] for _ in ids])
        out.kv_connector_output = (KVConnectorOutput(**connector_output)
                                   if connector_output else None)
        outs = self.s.update_from_output(so, out)
        return [(o.request_id, str(o.finish_reason)) for v in outs.values() for o in v.outputs
                if o.finish_reason is not None]

    def free(self) -> int:
        return self.s.kv_cache_manager.block_pool.get_num_free_blocks()

    def blocks(self, rid: str) -> list[int] | None:
        if rid not in self.s.requests:
            return None
        try:
            return list(self.s.kv_cache_manager.get_block_ids(rid)[0])
        except (KeyError, IndexError):
            return None

    def state(self, rid: str) -> str | None:
        r = self.s.requests.get(rid)
        return r.status.name if r is not None else None


def early(model: str, policy: str) -> dict:
    from vllm.v1.request import RequestStatus

    r = Run(model, policy)
    prefix = list(range(100, 148))  # 3 blocks
    r.add("A", prefix + [1])  # computed locally and cached: B's and C's prefix
    r.step()
    r.step()
    r.s.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    r.step()
    r.add("C", prefix[:32] + list(range(500, 520)))  # running, shares 2 blocks with B
    r.step()
    r.add("B", prefix[:32] + list(range(300, 340)), remote=True)
    r.step()
    got: dict = {"waiting": r.state("B"), "computed": r.s.requests["B"].num_computed_tokens,
                 "pushed": list(ALLOC["B"]), "blocks": r.blocks("B"), "c_blocks": r.blocks("C")}
    ended = r.step(invalid_block_ids=set(ALLOC["B"]))
    got.update(report_ended=ended, after_report=r.state("B"),
               computed_after_report=r.s.requests["B"].num_computed_tokens,
               blocks_after_report=r.blocks("B"), c_after_report=r.state("C"))
    for i in range(3):  # fillers: 10 blocks each, more than is free
        r.add(f"F{i}", list(range(1000 + 200 * i, 1000 + 200 * i + 160)))
    for _ in range(3):
        r.step()
    got["fillers_on_pushed"] = sorted(
        set(ALLOC["B"]) & {b for i in range(3) for b in (r.blocks(f"F{i}") or [])})
    got["second_report_ended"] = [e for e in r.step(invalid_block_ids=set(ALLOC["B"]))
                                  if not e[0].startswith("F")]
    got["after_second_report"] = r.state("B")
    got["free_before_finished_recving"] = r.free()
    r.step(finished_recving={"B"})
    got["after_finished_recving"] = r.state("B")
    got["blocks_after_finished_recving"] = r.blocks("B")
    got["free_after_finished_recving"] = r.free()
    for _ in range(3):
        r.step()
    got["later"] = r.state("B")
    got["later_computed"] = (r.s.requests["B"].num_computed_tokens
                             if "B" in r.s.requests else None)
    got["later_blocks"] = r.blocks("B")
    return got


def abort_first(model: str, policy: str) -> dict:
    from vllm.v1.request import RequestStatus

    r = Run(model, policy)
    r.add("B", list(range(300, 340)), remote=True)
    r.step()
    r.s.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    got: dict = {"after_abort": r.state("B"), "blocks": r.blocks("B"),
                 "pushed": list(ALLOC["B"]), "free_after_abort": r.free()}
    r.add("F", list(range(1000, 1100)))
    got["report_ended"] = r.step(invalid_block_ids=set(ALLOC["B"]))
    got["filler_on_pushed"] = sorted(set(ALLOC["B"]) & set(r.blocks("F") or []))
    got["filler"] = r.state("F")
    got["free_before_finished_recving"] = r.free()
    r.step(finished_recving={"B"})
    got["after_finished_recving"] = r.state("B")
    got["free_after_finished_recving"] = r.free()
    return got


def idle(model: str, policy: str) -> dict:
    """Scheduled tokens per step while B waits for remote KV alone, then with C running, then
    after B's ``finished_recving`` (the decoder's idle-step wait keys on the first being 0)."""
    r = Run(model, policy)
    r.add("B", list(range(300, 340)), remote=True)
    got: dict = {"alone": []}
    for _ in range(2):
        r.step()
        got["alone"].append((r.state("B"), r.scheduled_tokens))
    r.add("C", list(range(500, 520)))
    r.step()
    r.step()
    got["with_c_running"] = (r.state("B"), r.state("C"), r.scheduled_tokens)
    r.step(finished_recving={"B"})
    r.step()
    got["b_after_finished_recving"] = (r.state("B"), r.scheduled_tokens)
    return got


def main() -> None:
    logging.disable(logging.WARNING)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])  # vLLM imports the connector by module name
    import vllm

    # the connector vLLM instantiates comes from the module vllm_scheduler_probe, not from
    # __main__: run the scenarios from that module too, so they share its ALLOC
    import vllm_scheduler_probe as probe

    model = sys.argv[1]
    out = {"vllm": vllm.__version__}
    for policy in ("fail", "recompute"):
        out[f"early/{policy}"] = probe.early(model, policy)
        out[f"abort_first/{policy}"] = probe.abort_first(model, policy)
    out["idle"] = probe.idle(model, "fail")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
