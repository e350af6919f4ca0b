"""Tests for kv_push.common.config: one frozen PushConfig from defaults, a dict and the env."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from kv_push.common.config import ConfigError, PushConfig

ENV_VARS = ("KV_PUSH_SECRET", "KV_PUSH_SECRET_FILE", "KV_PUSH_SIDE_CHANNEL_HOST",
            "KV_PUSH_SIDE_CHANNEL_PORT", "KV_PUSH_BACKEND")
#: fields kv_connector_extra_config cannot set as plain values: the secret comes from the
#: environment (or the file that secret_file names; tested below)
NOT_IN_TABLE = {"secret", "secret_file"}

# field -> [(value as given in kv_connector_extra_config, value expected in PushConfig)]
SETTABLE = {
    "side_channel_host": [("10.1.2.3", "10.1.2.3"), ("node-7.cluster", "node-7.cluster")],
    "side_channel_port": [("6000", 6000), (6001, 6001), (6002.0, 6002), ("0", 0),
                          ("65535", 65535)],
    "backend": [("host", "host"), ("cuda", "cuda"), ("neuron", "neuron"), ("", "")],
    "nixl_backends": [("UCX", ("UCX",)), ("LIBFABRIC", ("LIBFABRIC",)),
                      ("UCX,LIBFABRIC", ("UCX", "LIBFABRIC")),
                      (" LIBFABRIC , UCX ", ("LIBFABRIC", "UCX")),
                      (["LIBFABRIC"], ("LIBFABRIC",)), (("UCX", "LIBFABRIC"), ("UCX", "LIBFABRIC"))],
    "heartbeat_interval_s": [("0.25", 0.25), (2, 2.0), ("3", 3.0)],
    "rendezvous_ttl_s": [("30", 30.0), (45.5, 45.5)],
    "transfer_timeout_s": [("12.5", 12.5), (1, 1.0)],
    "handshake_timeout_s": [("2", 2.0), (0.5, 0.5)],
    "cancel_retry_s": [("0.5", 0.5), (2, 2.0)],
    "fence_timeout_s": [("45", 45.0), (10.5, 10.5)],
    "max_side_channel_connections": [("64", 64), (1, 1), (4096.0, 4096)],
    "colocated": [("true", True), ("TRUE", True), ("yes", True), ("1", True), (True, True),
                  ("false", False), ("No", False), ("0", False), (False, False)],
    "idle_poll_s": [("0.002", 0.002), (0.01, 0.01)],
    "await_poll_s": [("0.0001", 0.0001), (0.001, 0.001)],
    "quiet_poll_s": [("0.05", 0.05), (0.001, 0.001)],
    "prefill_wait_poll_s": [("0.01", 0.01), (0.001, 0.001)],
    "quiet_after_s": [("0", 0.0), (2, 2.0)],
    "idle_step_wait_s": [("0", 0.0), (0.001, 0.001), ("0.05", 0.05)],
    "max_post_bytes": [("1048576", 1 << 20), (4096, 4096)],
    "max_post_regions": [("16", 16), (1, 1)],
    "staged": [("auto", "auto"), ("off", "off")],
    "decoder_staging_bytes": [("-1", -1), (0, 0), ("1073741824", 1 << 30)],
    "producer_staging_bytes": [(-1, -1), ("0", 0), (4096, 4096)],
    "staging_chunk_bytes": [("536870912", 512 << 20), (1, 1)],
    "early_prefill_done": [("auto", "auto"), ("off", "off")],
    "layerwise": [("auto", "auto"), ("off", "off")],
}


def test_table_covers_every_field():
    assert set(SETTABLE) | NOT_IN_TABLE == {f.name for f in dataclasses.fields(PushConfig)}


def test_readme_table_lists_every_field():
    """The README's ``kv_connector_extra_config`` table names every PushConfig field an operator
    can set there (``secret`` is refused there, so it is not a row; ``secret_file`` is)."""
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### `kv_connector_extra_config`", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    fields = {f.name for f in dataclasses.fields(PushConfig)}
    assert fields - {"secret"} <= named, f"not in the README table: {fields - {'secret'} - named}"
    assert named <= fields, f"README rows for no field: {named - fields}"


def test_defaults_are_valid():
    c = PushConfig()
    assert c.validate() is c
    assert PushConfig.from_sources(None, env={}) == c
    assert PushConfig.from_sources({}, env={}) == c
    assert c.secret == b""
    assert c.peer_timeout_s == 1.5 * c.heartbeat_interval_s


def test_frozen():
    c = PushConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.side_channel_port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "key,raw,want", [(k, raw, want) for k, cases in SETTABLE.items() for raw, want in cases],
    ids=lambda v: repr(v)[:30],
)
def test_every_field_settable_with_coercion(key, raw, want):
    c = PushConfig.from_sources({key: raw}, env={})
    got = getattr(c, key)
    assert got == want
    assert type(got) is type(want)
    # nothing else moved
    others = {f.name for f in dataclasses.fields(PushConfig)} - {key}
    assert all(getattr(c, k) == getattr(PushConfig(), k) for k in others)


def test_all_fields_at_once():
    extra = {k: cases[0][0] for k, cases in SETTABLE.items()}
    c = PushConfig.from_sources(extra, env={})
    for k, cases in SETTABLE.items():
        assert getattr(c, k) == cases[0][1], k


@pytest.mark.parametrize("raw,want", [("s3cret", b"s3cret"), ("ключ", "ключ".encode())])
def test_secret_from_the_environment(raw, want):
    assert PushConfig.from_sources({}, env={"KV_PUSH_SECRET": raw}).secret == want


def test_secret_not_in_repr_or_str():
    c = PushConfig.from_sources({}, env={"KV_PUSH_SECRET": "hunter2-very-secret"})
    assert c.secret == b"hunter2-very-secret"
    assert "hunter2" not in repr(c) and "hunter2" not in str(c)


@pytest.mark.parametrize("value", ["hunter2-very-secret", b"hunter2-very-secret", 1234, None])
def test_secret_in_extra_config_is_refused_with_the_reason(value):
    """vLLM prints kv_connector_extra_config in its "non-default args" line: a key there is a
    key in the logs. Refused at start-up, saying why and what to do, never quoting it."""
    with pytest.raises(ConfigError) as e:
        PushConfig.from_sources({"secret": value}, env={"KV_PUSH_SECRET": "x"})
    msg = str(e.value)
    assert "non-default args" in msg and "KV_PUSH_SECRET" in msg and "secret_file" in msg
    assert "hunter2" not in msg


def test_secret_file(tmp_path):
    f = tmp_path / "kv.key"
    f.write_bytes(b"\x00from-file\xff\n")
    for extra, env in (({"secret_file": str(f)}, {}), ({}, {"KV_PUSH_SECRET_FILE": str(f)})):
        c = PushConfig.from_sources(extra, env=env)
        assert c.secret == b"\x00from-file\xff"  # the trailing newline is not part of the key
        assert "from-file" not in repr(c)
    # both a variable and a file: ambiguous
    with pytest.raises(ConfigError, match="use one") as e:
        PushConfig.from_sources({"secret_file": str(f)}, env={"KV_PUSH_SECRET": "other"})
    assert "other" not in str(e.value) and "from-file" not in str(e.value)
    # unusable files are named, their contents never shown
    with pytest.raises(ConfigError, match="cannot read"):
        PushConfig.from_sources({"secret_file": str(tmp_path / "missing")}, env={})
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(ConfigError, match="empty"):
        PushConfig.from_sources({"secret_file": str(tmp_path / "empty")}, env={})


@pytest.mark.parametrize("key", ["side_chanel_port", "heartbeat_interval", "SECRET", "", "tp_size"])
def test_unknown_key_is_named(key):
    with pytest.raises(ConfigError) as e:
        PushConfig.from_sources({"backend": "host", key: 1}, env={})
    assert repr(key) in str(e.value)


@pytest.mark.parametrize("key,raw", [
    ("heartbeat_interval_s", -1),
    ("heartbeat_interval_s", 0),
    ("heartbeat_interval_s", "0"),
    ("heartbeat_interval_s", "nan"),
    ("heartbeat_interval_s", "fast"),
    ("rendezvous_ttl_s", -5),
    ("transfer_timeout_s", "-0.1"),
    ("handshake_timeout_s", 0.0),
    ("cancel_retry_s", 0),
    ("fence_timeout_s", "-1"),
    ("fence_timeout_s", 0.5),  # not above cancel_retry_s (1.0)
    ("idle_poll_s", -0.001),
    ("await_poll_s", 0),
    ("max_post_bytes", 0),
    ("max_post_regions", -1),
    ("idle_poll_s", None),
    ("side_channel_port", -1),
    ("side_channel_port", 65536),
    ("side_channel_port", "70000"),
    ("side_channel_port", "port"),
    ("side_channel_port", "5600.5"),
    ("side_channel_port", 5600.5),
    ("side_channel_port", None),
    ("backend", "tpu"),
    ("backend", "CUDA"),
    ("nixl_backends", "GDS"),
    ("nixl_backends", "UCX,MOONCAKE"),
    ("nixl_backends", ["UCX", "TCP"]),
    ("nixl_backends", 5),
    ("colocated", "maybe"),
    ("colocated", "2"),
    ("colocated", ""),
    ("secret", 1234),
    ("secret", None),
    ("secret", "in-the-dict"),
    ("max_side_channel_connections", 0),
    ("max_side_channel_connections", "many"),
    ("staged", "on"),
    ("staged", "AUTO"),
    ("decoder_staging_bytes", -2),
    ("decoder_staging_bytes", "2G"),
    ("producer_staging_bytes", 1.5),
    ("staging_chunk_bytes", 0),
    ("staging_chunk_bytes", -4096),
    ("early_prefill_done", "on"),
    ("early_prefill_done", "AUTO"),
    ("early_prefill_done", True),
    ("early_prefill_done", ""),
    ("layerwise", "on"),
    ("layerwise", True),
    ("quiet_poll_s", 0),
    ("quiet_poll_s", "-0.02"),
    ("prefill_wait_poll_s", 0),
    ("quiet_after_s", -1),
    ("quiet_after_s", "soon"),
    ("idle_step_wait_s", -0.001),
    ("idle_step_wait_s", 0.5),
    ("idle_step_wait_s", "later"),
], ids=repr)
def test_bad_values_raise_config_error_naming_the_key(key, raw):
    with pytest.raises(ConfigError) as e:
        PushConfig.from_sources({key: raw}, env={})
    assert key in str(e.value)


def test_validate_catches_direct_construction():
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        PushConfig(heartbeat_interval_s=-1.0).validate()
    with pytest.raises(ConfigError, match="side_channel_port"):
        PushConfig(side_channel_port=1 << 16).validate()
    with pytest.raises(ConfigError, match="nixl_backends"):
        PushConfig(nixl_backends=("UCX", "ucx")).validate()


def test_env_overrides_win_over_dict():
    extra = {"side_channel_host": "dict-host", "side_channel_port": 1111, "backend": "host"}
    env = {"KV_PUSH_SECRET": "from-env", "KV_PUSH_SIDE_CHANNEL_HOST": "env-host",
           "KV_PUSH_SIDE_CHANNEL_PORT": "2222", "KV_PUSH_BACKEND": "neuron",
           "KV_PUSH_HEARTBEAT_INTERVAL_S": "99", "UNRELATED": "x"}
    c = PushConfig.from_sources(extra, env=env)
    assert (c.secret, c.side_channel_host, c.side_channel_port, c.backend) == (
        b"from-env", "env-host", 2222, "neuron")
    assert c.heartbeat_interval_s == PushConfig().heartbeat_interval_s  # not an override


def test_env_alone_and_empty_env_ignored():
    c = PushConfig.from_sources({}, env={"KV_PUSH_SECRET": "k", "KV_PUSH_BACKEND": "cuda"})
    assert (c.secret, c.backend) == (b"k", "cuda")
    # an empty variable does not override the dict
    c = PushConfig.from_sources({"backend": "host"},
                                env={"KV_PUSH_BACKEND": "", "KV_PUSH_SECRET": ""})
    assert (c.backend, c.secret) == ("host", b"")


def test_reads_os_environ_by_default(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KV_PUSH_SECRET", "os-secret")
    monkeypatch.setenv("KV_PUSH_SIDE_CHANNEL_PORT", "7000")
    c = PushConfig.from_sources({"side_channel_port": 1})
    assert (c.secret, c.side_channel_port) == (b"os-secret", 7000)
    # an explicit env mapping replaces os.environ entirely
    assert PushConfig.from_sources({}, env={}).secret == b""


@pytest.mark.parametrize("var,value,field_name", [
    ("KV_PUSH_SIDE_CHANNEL_PORT", "not-a-port", "KV_PUSH_SIDE_CHANNEL_PORT"),
    ("KV_PUSH_SIDE_CHANNEL_PORT", "99999", "side_channel_port"),
    ("KV_PUSH_BACKEND", "tpu", "backend"),
])
def test_bad_env_values(var, value, field_name):
    with pytest.raises(ConfigError) as e:
        PushConfig.from_sources({}, env={var: value})
    assert field_name in str(e.value)


@pytest.mark.parametrize("interval", ["0.1", 1, "2.5"])
def test_peer_timeout_derived(interval):
    c = PushConfig.from_sources({"heartbeat_interval_s": interval}, env={})
    assert c.peer_timeout_s == pytest.approx(1.5 * float(interval))
    with pytest.raises(ConfigError, match="peer_timeout_s"):
        PushConfig.from_sources({"peer_timeout_s": 3}, env={})  # derived, not settable


def test_a_bad_early_prefill_done_says_what_it_accepts():
    with pytest.raises(ConfigError, match=r"early_prefill_done must be one of auto, off, got 'yes'"):
        PushConfig.from_sources({"early_prefill_done": "yes"}, env={})


@pytest.mark.parametrize("key,meant", [("heartbeat_interval", "heartbeat_interval_s"),
                                       ("side_chanel_port", "side_channel_port"),
                                       ("secrt_file", "secret_file")])
def test_a_misspelt_key_gets_the_likely_one(key, meant):
    with pytest.raises(ConfigError) as e:
        PushConfig.from_sources({key: 1}, env={})
    assert f"did you mean {meant!r}?" in str(e.value)
    assert "'secret'" not in str(e.value).split("known:")[1]  # refused, never a "known" key


def test_the_refused_secret_key_is_never_suggested():
    with pytest.raises(ConfigError) as e:
        PushConfig.from_sources({"secrt": 1}, env={})
    assert "did you mean 'secret'" not in str(e.value)
