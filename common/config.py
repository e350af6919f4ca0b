"""One frozen configuration, parsed and validated once at start-up.

Sources, later ones winning: defaults, ``kv_connector_extra_config`` (a dict from vLLM's
``--kv-transfer-config``), then environment variables for the few settings operators set per
host (``KV_PUSH_SIDE_CHANNEL_HOST``, ``KV_PUSH_SIDE_CHANNEL_PORT``, ``KV_PUSH_BACKEND``). Unknown
keys and bad values raise ``ConfigError`` naming the key.

The shared secret comes from the environment only (``KV_PUSH_SECRET``), or from a file named by
``secret_file`` / ``KV_PUSH_SECRET_FILE`` (``auth.load_secret``): vLLM prints
``kv_connector_extra_config`` in its start-up "non-default args" log line, so a ``secret`` key
there is refused. The key never appears in ``repr`` or in an error message.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .backend import BACKENDS, NIXL_BACKENDS
from .auth import SECRET_ENV, SECRET_FILE_ENV, SecretError, load_secret


class ConfigError(ValueError):
    pass


#: values of ``early_prefill_done``
EARLY_PREFILL_DONE = ("auto", "off")
#: values of ``layerwise``
LAYERWISE = ("auto", "off")


@dataclass(frozen=True)
class PushConfig:
    #: where a producer worker listens for decoders' handshakes (its tp_rank is added to the port)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    #: memory backend: a name in ``backend.BACKENDS`` (host, cuda, neuron), or "" to detect
    backend: str = ""
    #: NIXL backends for the agent; empty: the memory backend's own choice (host and cuda: UCX,
    #: neuron: LIBFABRIC). p5en over EFA: ("LIBFABRIC",).
    nixl_backends: tuple[str, ...] = ()
    #: liveness interval: 4 heartbeats go out per interval; a peer silent for 1.5 intervals is
    #: *unresponsive*: its transfers are failed, but it is not taken for dead (blocks it may
    #: write stay fenced) -- only its side-channel lifeline closing proves death
    heartbeat_interval_s: float = 5.0
    #: a registration or prefill that never finds its other half is dropped after this long
    rendezvous_ttl_s: float = 120.0
    #: a decoder gives up waiting for a transfer's completions after this long
    transfer_timeout_s: float = 60.0
    #: a handshake with a peer must finish within this
    handshake_timeout_s: float = 5.0
    #: a decoder re-sends an unanswered ``Cancel`` after this long, then doubling (up to 8x)
    cancel_retry_s: float = 1.0
    #: a decoder keeps blocks fenced at most this long for a producer that neither answers the
    #: cancel nor dies; then it treats it as dead: closes its lifeline, drops it, frees the blocks
    #: (this bounds how long a WRITE may stay in flight)
    fence_timeout_s: float = 30.0
    #: HMAC key for control messages and router-signed transfer parameters; empty disables
    #: authentication. Set from the environment only (see the module docstring).
    secret: bytes = field(default=b"", repr=False)
    #: a file holding the secret (its path is no secret; the contents are read at start-up)
    secret_file: str = ""
    #: connections a producer worker's side channel serves at once (handshakes and lifelines
    #: together: about one per decoder TP rank that talks to this rank); more are refused
    max_side_channel_connections: int = 1024
    #: producer and decoder share a host (Neuron: needs FI_EFA_ENABLE_SHM_TRANSFER=0)
    colocated: bool = False
    #: a WRITE is posted in chunks of at most this many bytes / regions, one chunk per loop
    #: step, so a long copy never keeps the transfer thread from heartbeating for long
    max_post_bytes: int = 64 << 20
    max_post_regions: int = 8192
    #: how long the transfer thread sleeps when idle (it spins while transfers are in flight)
    idle_poll_s: float = 0.001
    #: how long it sleeps when quiet: no role holds anything a peer's message could be awaited
    #: for (no prefill, registration, want, handshake, WRITE), and nothing but heartbeats came
    #: for ``quiet_after_s``. Work handed in by the engine or the side channel wakes it at
    #: once. At 1 ms an idle worker spent ~8% of a core polling NIXL (2026-12-04, CPU box)
    quiet_poll_s: float = 0.02
    quiet_after_s: float = 1.0
    #: how long it sleeps while what it holds waits only for a hand-off from the engine (a
    #: producer's registrations waiting for their prefills, whose hand-off wakes it): polling
    #: NIXL meanwhile takes CPU from the prefill on the producer's cores. A decoder's Cancel of
    #: such a registration is answered up to this much later. Set it to ``idle_poll_s`` to poll
    #: as before 2026-12-05
    prefill_wait_poll_s: float = 0.02
    #: how long it sleeps between polls while a decoder waits for a WRITE (a registered want):
    #: over UCX the WRITE into D and its notice progress only while D polls
    await_poll_s: float = 0.0002
    #: how long a decoder worker waits, in an engine step that runs no model (every request
    #: there waits for its KV), for a transfer's outcome before it returns to vLLM: an outcome
    #: that comes meanwhile is reported in that step, not at the next step's look (vLLM steps
    #: such an engine about once a millisecond). A new request or an abort that reaches the
    #: engine meanwhile waits as long; 0: never wait
    idle_step_wait_s: float = 0.002
    #: staged transfers (pack into a registered staging buffer, a few large WRITEs, unpack):
    #: "auto" uses them when both sides have a staging pool with room, else the region path
    #: (counted in ``staged_fallback{reason}``); "off" allocates no pool and never stages
    staged: str = "auto"
    #: bytes of the staging pool a decoder (resp. producer) worker allocates and registers next
    #: to its KV; -1: the memory backend's default (cuda: 2 GiB, host: 0 = no pool), 0: none.
    #: A decoder slot holds one request's KV for this rank; a producer holds one request's
    #: sub-slice per decoder rank it writes to, so requests larger than the pool take the
    #: region path. See docs/gpu.md for ``--gpu-memory-utilization``.
    decoder_staging_bytes: int = -1
    producer_staging_bytes: int = -1
    #: target bytes of one staged chunk (one WRITE + one notice; a group of whole layers)
    staging_chunk_bytes: int = 512 << 20
    #: a producer announces a prefill when the step that completes it ran (its KV is written),
    #: not one engine step later at vLLM's ``request_finished``: "auto" does so where that is
    #: provably safe (vLLM runs one batch at a time: no async scheduling, no pipeline
    #: parallelism; full attention only; see ``connector_scheduler``), "off" never
    early_prefill_done: str = "auto"
    #: layer-wise streaming on a producer with a staging pool (``producer.py``, "Layer-wise
    #: streaming"): a prefill that completes in a step is packed layer by layer as vLLM's
    #: ``save_kv_layer`` reports each layer written, and each layer group is WRITTEN as soon as
    #: it is packed and the decoder's registration is there. "auto": wherever the producer
    #: stages (needs a producer staging pool) and vLLM runs one batch at a time (as for
    #: ``early_prefill_done``: ``connector._layerwise``); "off": pack after the prefill only
    layerwise: str = "auto"

    @property
    def peer_timeout_s(self) -> float:
        return 1.5 * self.heartbeat_interval_s

    def validate(self) -> "PushConfig":
        for name in (
            "heartbeat_interval_s", "rendezvous_ttl_s", "transfer_timeout_s",
            "handshake_timeout_s", "idle_poll_s", "await_poll_s", "cancel_retry_s",
            "fence_timeout_s", "quiet_poll_s", "prefill_wait_poll_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.quiet_after_s < 0:
            raise ConfigError(f"quiet_after_s must not be negative, got {self.quiet_after_s!r}")
        if not 0 <= self.idle_step_wait_s <= 0.05:
            raise ConfigError("idle_step_wait_s must be between 0 and 0.05 (it delays what "
                              f"reaches an idle engine meanwhile), got {self.idle_step_wait_s!r}")
        if self.max_side_channel_connections < 1:
            raise ConfigError("max_side_channel_connections must be at least 1, got "
                              f"{self.max_side_channel_connections!r}")
        if self.fence_timeout_s <= self.cancel_retry_s:
            raise ConfigError(f"fence_timeout_s ({self.fence_timeout_s}) must exceed "
                              f"cancel_retry_s ({self.cancel_retry_s})")
        if self.max_post_bytes <= 0 or self.max_post_regions <= 0:
            raise ConfigError("max_post_bytes and max_post_regions must be positive")
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"side_channel_port {self.side_channel_port} is not a port")
        if self.backend not in ("", *BACKENDS):
            raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if any(b not in NIXL_BACKENDS for b in self.nixl_backends):
            raise ConfigError(
                f"nixl_backends must be from {NIXL_BACKENDS}, got {self.nixl_backends}")
        if self.staged not in ("auto", "off"):
            raise ConfigError(f"staged must be auto or off, got {self.staged!r}")
        for name in ("decoder_staging_bytes", "producer_staging_bytes"):
            if getattr(self, name) < -1:
                raise ConfigError(f"{name} must be -1 (backend default), 0 (none) or a size in "
                                  f"bytes, got {getattr(self, name)!r}")
        if self.early_prefill_done not in EARLY_PREFILL_DONE:
            raise ConfigError(f"early_prefill_done must be one of {', '.join(EARLY_PREFILL_DONE)}"
                              f", got {self.early_prefill_done!r}")
        if self.layerwise not in LAYERWISE:
            raise ConfigError(f"layerwise must be one of {', '.join(LAYERWISE)}, got "
                              f"{self.layerwise!r}")
        if self.staging_chunk_bytes <= 0:
            raise ConfigError(f"staging_chunk_bytes must be positive, got "
                              f"{self.staging_chunk_bytes!r}")
        return self

    @classmethod
    def from_sources(
        cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> "PushConfig":
        env = os.environ if env is None else env
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in (extra or {}).items():
            if key == "secret":
                raise ConfigError(
                    "kv_connector_extra_config must not carry 'secret': vLLM prints that dict in "
                    "its start-up log ('non-default args'), so the key would end up in logs. Set "
                    f"{SECRET_ENV} in the environment, or 'secret_file' (a path) to a file "
                    "holding the key, on every producer, decoder and router")
            if key not in fields:
                close = difflib.get_close_matches(key, [k for k in fields if k != "secret"],
                                                  n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"unknown kv_connector_extra_config key {key!r}{hint}; known: "
                    f"{sorted(k for k in fields if k != 'secret')}"
                )
            values[key] = _coerce(key, fields[key], raw)
        for key, var in (
            ("side_channel_host", "KV_PUSH_SIDE_CHANNEL_HOST"),
            ("side_channel_port", "KV_PUSH_SIDE_CHANNEL_PORT"),
            ("backend", "KV_PUSH_BACKEND"),
        ):
            if env.get(var):
                values[key] = _coerce(var, fields[key], env[var])
        try:
            values["secret"] = load_secret(env, values.get("secret_file", ""))
        except SecretError as e:
            raise ConfigError(f"secret ({SECRET_ENV} / {SECRET_FILE_ENV} / secret_file): "
                              f"{e}") from None
        return cls(**values).validate()


def _coerce(key: str, f: dataclasses.Field, raw: Any) -> Any:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    try:
        if isinstance(default, bool):
            if isinstance(raw, str):
                if raw.lower() in ("1", "true", "yes"):
                    return True
                if raw.lower() in ("0", "false", "no"):
                    return False
                raise ValueError(raw)
            return bool(raw)
        if isinstance(default, bytes):
            if isinstance(raw, str):
                return raw.encode()
            if isinstance(raw, (bytes, bytearray, memoryview)):
                return bytes(raw)
            raise TypeError(raw)  # bytes(1234) would be 1234 zero bytes: never a usable key
        if isinstance(default, tuple):
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(str(i).strip() for i in items if str(i).strip())
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, int):
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: cannot use {raw!r} (expected {type(default).__name__})") from None
