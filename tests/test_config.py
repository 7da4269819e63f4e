"""Configuration precedence: argument > GRIDCOMM_* > cupyx > torchrun > Kubernetes > error."""

from __future__ import annotations

import pytest

from gridcomm import ConfigError, _config


def test_explicit_argument_wins():
    env = {"GRIDCOMM_WORLD_SIZE": "8", "WORLD_SIZE": "4"}
    assert _config.world_size(2, env) == 2
    assert _config.world_size(None, env) == 8
    assert _config.world_size(None, {"WORLD_SIZE": "4"}) == 4


def test_rank_sources_in_order():
    assert _config.rank(None, 8, {"GRIDCOMM_RANK": "1", "RANK": "2", "JOB_COMPLETION_INDEX": "3"}) == 1
    assert _config.rank(None, 8, {"RANK": "2", "JOB_COMPLETION_INDEX": "3"}) == 2
    assert _config.rank(None, 8, {"JOB_COMPLETION_INDEX": "3"}) == 3
    with pytest.raises(ConfigError, match="GRIDCOMM_RANK"):
        _config.rank(None, 8, {})


def test_rank_out_of_range_names_variable():
    with pytest.raises(ConfigError, match=r"JOB_COMPLETION_INDEX=9 is out of range for world size 8"):
        _config.rank(None, 8, {"JOB_COMPLETION_INDEX": "9"})


def test_address_sources():
    env = {"CUPYX_DISTRIBUTED_HOST": "a", "CUPYX_DISTRIBUTED_PORT": "1", "MASTER_ADDR": "b", "MASTER_PORT": "2"}
    assert _config.coordinator_address(None, None, env) == ("a", 1)
    assert _config.coordinator_address(None, None, {"MASTER_ADDR": "b", "MASTER_PORT": "2"}) == ("b", 2)
    assert _config.coordinator_address(None, None, {}) == ("127.0.0.1", 13333)
    assert _config.coordinator_address("x", 5, env) == ("x", 5)
    assert _config.coordinator_address(None, None, {"GRIDCOMM_HOST": "[::1]", "GRIDCOMM_PORT": "7"}) == ("::1", 7)


@pytest.mark.parametrize(
    "env, words",
    [
        ({"GRIDCOMM_PORT": "http"}, "GRIDCOMM_PORT='http' is not an integer"),
        ({"GRIDCOMM_PORT": "70000"}, "GRIDCOMM_PORT=70000 is out of range"),
        ({"GRIDCOMM_HOST": "a b"}, "is not a host name"),
    ],
)
def test_bad_address_env(env, words):
    with pytest.raises(ConfigError, match=words):
        _config.coordinator_address(None, None, env)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_bad_timeouts(value):
    with pytest.raises(ConfigError, match="GRIDCOMM_TIMEOUT_S"):
        _config.timeout_s(None, {"GRIDCOMM_TIMEOUT_S": value})


def test_token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("abc\n")
    assert _config.token(None, {"GRIDCOMM_TOKEN_FILE": str(path)}) == "abc"
    assert _config.token(None, {"GRIDCOMM_TOKEN": "x", "GRIDCOMM_TOKEN_FILE": str(path)}) == "x"
    with pytest.raises(ConfigError, match="cannot be read"):
        _config.token(None, {"GRIDCOMM_TOKEN_FILE": str(tmp_path / "missing")})
    assert _config.token(None, {}) is None


def test_parse_target():
    assert _config.parse_target("h:1") == ("h", 1)
    assert _config.parse_target("[::1]:2") == ("::1", 2)
    assert _config.format_target("::1", 2) == "[::1]:2"
    for bad in ("h", ":1", "h:x", "[::1]2"):
        with pytest.raises(ConfigError):
            _config.parse_target(bad)


def test_backend_and_mode():
    assert _config.backend(None, {}) == "nccl"
    assert _config.backend(None, {"GRIDCOMM_BACKEND": "host"}) == "host"
    with pytest.raises(ConfigError, match="GRIDCOMM_BACKEND='gloo'"):
        _config.backend(None, {"GRIDCOMM_BACKEND": "gloo"})
    with pytest.raises(ConfigError):
        _config.coordinator_mode({"GRIDCOMM_COORDINATOR": "nope"})


def test_config_reads_environment_at_call_time(monkeypatch):
    monkeypatch.setenv("GRIDCOMM_WORLD_SIZE", "5")
    assert _config.world_size() == 5
    monkeypatch.setenv("GRIDCOMM_WORLD_SIZE", "6")
    assert _config.world_size() == 6
