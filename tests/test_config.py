"""Configuration precedence: argument > GRIDCOMM_* > cupyx > torchrun > Kubernetes > error."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

import gridcomm
from gridcomm import ConfigError, _config
from gridcomm._config import registry


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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gridcomm")


def _sources() -> dict[str, str]:
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "_proto")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    return found


def test_exactly_one_module_touches_os_environ():
    ways = ("os.environ", "os.getenv", "os.putenv", "os.unsetenv", "from os import")
    touching = sorted(path for path, text in _sources().items() if any(way in text for way in ways))
    assert touching == [os.path.join("gridcomm", "_config", "readers.py")], touching


REGISTRY = os.path.join("gridcomm", "_config", "registry.py")


def _named_in_code(sources: dict[str, str]) -> set[str]:
    """The GRIDCOMM_* names the package's code mentions, the registry itself left out (a name it
    lists is not thereby read)."""
    named = set()
    for path, text in sources.items():
        if path != REGISTRY:
            named |= set(re.findall(r"GRIDCOMM_[A-Z0-9_]*[A-Z0-9]", text))
    # GRIDCOMM_TLS_* is how messages refer to the family, not a variable.
    named.discard("GRIDCOMM_TLS")
    return named


def test_every_gridcomm_variable_in_the_code_is_in_the_registry():
    named = _named_in_code(_sources())
    assert named - set(registry.BY_NAME) == set(), "read or named, but not in gridcomm/_config/registry.py"
    assert set(registry.BY_NAME) - named == set(), "in the registry, but nothing reads it"


def test_a_variable_only_the_registry_names_is_caught():
    """The check above sees a registered variable that no code reads (as if one were planted)."""
    sources = _sources()
    planted = dict(sources)
    planted[REGISTRY] = sources[REGISTRY] + '\nVariable("GRIDCOMM_PLANTED_UNREAD", "bool", "off", "read by nothing")\n'
    assert "GRIDCOMM_PLANTED_UNREAD" not in _named_in_code(planted)
    assert set(registry.BY_NAME) <= _named_in_code(sources)


def test_readme_configuration_table_is_the_registry():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    assert begin in readme and end in readme
    section = readme.split(begin, 1)[1].split(end, 1)[0]
    assert section == registry.table(), "README is stale: run python scripts/settings_table.py --write"
    # And, row by row, what a reader sees: each variable with its default; no name the registry lacks.
    rows = {line.split("|")[1].strip(" `"): line for line in section.splitlines()[2:]}
    for variable in registry.VARIABLES:
        assert variable.default in rows[variable.name].split("|")[4], variable.name
    assert set(re.findall(r"GRIDCOMM_[A-Z0-9_]*[A-Z0-9]", section)) <= set(registry.BY_NAME)
    check = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "settings_table.py")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_settings_resolve_once_in_order_and_are_frozen():
    env = {"GRIDCOMM_WORLD_SIZE": "4", "WORLD_SIZE": "9", "GRIDCOMM_RANK": "2", "RANK": "3",
           "MASTER_ADDR": "master.example", "GRIDCOMM_TIMEOUT_S": "12", "GRIDCOMM_SHM": "off",
           "GRIDCOMM_NCCL_ENGINE": "cupy", "GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_BACKEND": "host"}
    s = _config.Settings.resolve(environ=env)
    assert (s.world_size, s.rank, s.client.host, s.client.port) == (4, 2, "master.example", _config.DEFAULT_PORT)
    assert (s.timeout_s, s.plane.shm, s.nccl.engine, s.embedded, s.backend) == (12.0, False, "cupy", False, "host")
    assert s.source == "gridcomm"
    # An explicit argument wins over every variable.
    s = _config.Settings.resolve(2, 1, backend="nccl", host="h", port=1234, timeout_s=3, environ=env)
    assert (s.world_size, s.rank, s.backend, s.client.host, s.client.port, s.timeout_s) == (2, 1, "nccl", "h", 1234, 3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.client.timeout_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("env", "words"), [
    ({"GRIDCOMM_SHM": "maybe"}, "GRIDCOMM_SHM='maybe'"),
    ({"GRIDCOMM_NCCL_ENGINE": "mpi"}, "GRIDCOMM_NCCL_ENGINE='mpi'"),
    ({"GRIDCOMM_RANKS_PER_ROOT": "0"}, "GRIDCOMM_RANKS_PER_ROOT='0'"),
    ({"GRIDCOMM_TIMEOUT_S": "-1"}, "GRIDCOMM_TIMEOUT_S='-1'"),
    ({"GRIDCOMM_SESSION": "process"}, "GRIDCOMM_SESSION=process was removed"),
    ({"GRIDCOMM_RELAY_FANIN": "1"}, "GRIDCOMM_RELAY_FANIN=1 is out of range"),
    ({"GRIDCOMM_RELAY_FANIN": "wide"}, "GRIDCOMM_RELAY_FANIN='wide' must be `auto`"),
])
def test_a_bad_variable_is_a_config_error_naming_it(env, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        _config.Settings.resolve(2, 0, environ={**env})


@pytest.mark.parametrize(("world", "value", "fanin"), [
    # auto: 32 while 32 x 32 covers the job, then the next power of two whose square does
    (256, None, 32), (1024, None, 32), (1025, None, 64), (2048, "auto", 64), (4096, None, 64),
    (8192, None, 128), (16384, None, 128), (100_000, "AUTO", 512),
    # a number is taken as it is, at any size
    (8192, "32", 32), (300, "8", 8),
])
def test_relay_fanin_auto_grows_with_the_square_root_of_the_world(world, value, fanin):
    environ = {} if value is None else {"GRIDCOMM_RELAY_FANIN": value}
    settings = _config.Settings.resolve(world, 0, environ=environ).client
    assert settings.fanin(world) == fanin
    assert fanin * fanin >= world or value is not None


def test_settings_read_the_process_environment_at_call_time(monkeypatch):
    monkeypatch.setenv("GRIDCOMM_TIMEOUT_S", "7")
    assert _config.Settings.resolve(2, 0).timeout_s == 7.0
    monkeypatch.setenv("GRIDCOMM_TIMEOUT_S", "8")
    assert _config.Settings.resolve(2, 0).timeout_s == 8.0
    assert _config.ClientSettings.resolve("h", 1, 0, 2).timeout_s == 8.0


@pytest.mark.parametrize(("value", "words"), [
    ("127.0.0.1:25921", ["GRIDCOMM_HOST='127.0.0.1:25921' holds a port", "GRIDCOMM_HOST='127.0.0.1'",
                         "GRIDCOMM_PORT=25921"]),
    ("http://job-0.svc:13333", ["GRIDCOMM_HOST='http://job-0.svc:13333' is a URL", "GRIDCOMM_PORT"]),
])
def test_a_host_setting_with_a_port_or_a_scheme_is_refused_at_once_naming_it(value, words):
    from gridcomm._config import coordinator_address

    with pytest.raises(gridcomm.ConfigError) as caught:
        coordinator_address(None, None, {"GRIDCOMM_HOST": value})
    for word in words:
        assert word in str(caught.value)


def test_ipv6_literals_are_still_hosts():
    from gridcomm._config import coordinator_address

    assert coordinator_address(None, None, {"GRIDCOMM_HOST": "::1"})[0] == "::1"
    assert coordinator_address(None, None, {"GRIDCOMM_HOST": "[fd00::5]", "GRIDCOMM_PORT": "7"}) == ("fd00::5", 7)


def test_a_blank_token_is_refused_not_taken_for_no_authentication():
    from gridcomm._config import token

    with pytest.raises(gridcomm.ConfigError, match="GRIDCOMM_TOKEN is blank"):
        token(None, {"GRIDCOMM_TOKEN": "  \t "})
    assert token(None, {"GRIDCOMM_TOKEN": " s3cret\n"}) == "s3cret"  # every rank reads it the same way
    assert token(None, {"GRIDCOMM_TOKEN": ""}) is None
    with pytest.raises(gridcomm.ConfigError, match="token is padded with whitespace"):
        token(" s3cret")


@pytest.mark.timeout(60)
def test_use_mpi_is_accepted_as_cupyx_accepts_it_with_a_warning(caplog, monkeypatch):
    monkeypatch.setenv("GRIDCOMM_BIND", "127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with caplog.at_level("WARNING", logger="gridcomm._communicator.process_group"):
        comm = gridcomm.init_process_group(1, 0, backend="host", host="127.0.0.1", port=port, use_mpi=True)
    try:
        x = np.ones(2)
        comm.all_reduce(x, x)
        assert list(x) == [1.0, 1.0]
    finally:
        comm.stop()
    assert any("use_mpi=True" in r.getMessage() for r in caplog.records)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_the_embedded_coordinator_takes_the_jobs_environment_not_the_processs(monkeypatch):
    """Rank 0's coordinator settings come from the environment the job was resolved from."""
    from gridcomm._communicator.process_group import Job

    for name in ("GRIDCOMM_STALL_TIMEOUT_S", "GRIDCOMM_METRICS_LINGER_S", "GRIDCOMM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    env = {"GRIDCOMM_STALL_TIMEOUT_S": "7", "GRIDCOMM_METRICS_LINGER_S": "3", "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_JOB_ID": "passed-down"}
    job = Job.configure(1, 0, backend="host", host="127.0.0.1", port=_free_port(), timeout_s=30, token=None,
                        environ=env)
    comm = job.start()
    try:
        assert job.coordinator is not None
        server = job.coordinator.settings
        assert (server.stall_timeout_s, server.metrics_linger_s, server.job_id) == (7.0, 3.0, "passed-down")
    finally:
        comm.stop()


@pytest.mark.timeout(60)
def test_a_stall_bound_above_the_call_timeout_names_where_that_timeout_came_from(monkeypatch):
    """timeout_s= is named as the argument, not as GRIDCOMM_TIMEOUT_S (which is not set)."""
    monkeypatch.delenv("GRIDCOMM_TIMEOUT_S", raising=False)
    monkeypatch.setenv("GRIDCOMM_STALL_TIMEOUT_S", "60")
    monkeypatch.setenv("GRIDCOMM_BIND", "127.0.0.1")
    with pytest.raises(ConfigError) as caught:
        gridcomm.init_process_group(1, 0, backend="host", host="127.0.0.1", port=_free_port(), timeout_s=10)
    assert "longer than the call timeout timeout_s=10" in str(caught.value), caught.value
    assert "GRIDCOMM_TIMEOUT_S" not in str(caught.value), caught.value
    with pytest.raises(ConfigError, match=re.escape("the call timeout GRIDCOMM_TIMEOUT_S=50")):
        _config.stall_timeout_s(None, {"GRIDCOMM_STALL_TIMEOUT_S": "60", "GRIDCOMM_TIMEOUT_S": "50"})
    with pytest.raises(ConfigError, match=re.escape("the call timeout (300 s, the default)")):
        _config.stall_timeout_s(None, {"GRIDCOMM_STALL_TIMEOUT_S": "400"})


class _ReadsRecorded(dict):
    """A process environment that records which of gridcomm's variables are looked up."""

    def __init__(self, base, watched):
        super().__init__(base)
        self.watched = watched
        self.read: list[str] = []

    def _note(self, key):
        if key in self.watched:
            self.read.append(key)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self._note(key)
        return super().pop(key, *default)


@pytest.mark.timeout(60)
def test_nothing_reads_the_environment_after_the_job_is_resolved(monkeypatch):
    """Resolved once: starting the job, its collectives, a split and the stop read no variable of
    the registry (nor a convention it names) from the process environment."""
    from gridcomm._communicator.process_group import Job

    monkeypatch.setenv("GRIDCOMM_BIND", "127.0.0.1")
    monkeypatch.setenv("GRIDCOMM_DEBUG", "collectives")
    job = Job.configure(1, 0, backend="host", host="127.0.0.1", port=_free_port(), timeout_s=30, token=None)
    watched = set(registry.BY_NAME) | {c for v in registry.VARIABLES for c in v.conventions}
    spy = _ReadsRecorded(os.environ, watched)
    monkeypatch.setattr(os, "environ", spy)
    comm = job.start()
    try:
        x = np.ones(2)
        comm.all_reduce(x, x)
        child = comm.split(0)
        assert child is not None
        child.all_reduce(x, x)
        assert comm._tracker.fingerprints and child._tracker.fingerprints
    finally:
        comm.stop()
    assert spy.read == [], f"read after resolve: {sorted(set(spy.read))}"


def test_reading_the_token_changes_nothing_and_only_a_resolve_that_succeeds_withholds_it(monkeypatch):
    """A reader reads; GRIDCOMM_TOKEN leaves the process environment (for its children) once a
    rank's settings are resolved, never when the resolve fails, never from a mapping passed in."""
    from gridcomm._config import readers

    monkeypatch.setattr(readers, "_taken_token", None)
    monkeypatch.setenv("GRIDCOMM_TOKEN", "s3cret")
    monkeypatch.delenv("GRIDCOMM_TOKEN_INHERIT", raising=False)
    assert _config.token() == "s3cret"
    assert os.environ.get("GRIDCOMM_TOKEN") == "s3cret"
    monkeypatch.setenv("GRIDCOMM_BACKEND", "gloo")
    with pytest.raises(ConfigError, match="GRIDCOMM_BACKEND"):
        _config.Settings.resolve(2, 1)
    assert os.environ.get("GRIDCOMM_TOKEN") == "s3cret"
    monkeypatch.delenv("GRIDCOMM_BACKEND")
    assert _config.Settings.resolve(2, 1).client.token == "s3cret"
    assert "GRIDCOMM_TOKEN" not in os.environ
    assert _config.token() == "s3cret"  # still this process's secret
    passed = {"GRIDCOMM_TOKEN": "other"}
    assert _config.Settings.resolve(2, 1, environ=passed).client.token == "other"
    assert passed == {"GRIDCOMM_TOKEN": "other"}


@pytest.mark.timeout(60)
def test_nothing_reads_the_environment_after_an_external_coordinator_and_its_rank_are_resolved(monkeypatch):
    """The same for a standalone coordinator (resolved at construction) and a rank dialling it."""
    from gridcomm._communicator.process_group import Job

    monkeypatch.setenv("GRIDCOMM_COORDINATOR", "external")
    monkeypatch.setenv("GRIDCOMM_STALL_TIMEOUT_S", "20")
    server = gridcomm.Coordinator(1, bind="127.0.0.1", port=0, token="t0ken")
    job_env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_TOKEN": "t0ken"}
    watched = set(registry.BY_NAME) | {c for v in registry.VARIABLES for c in v.conventions}
    spy = _ReadsRecorded(os.environ, watched)
    monkeypatch.setattr(os, "environ", spy)
    server.start()
    try:
        job = Job.configure(1, 0, backend="host", host="127.0.0.1", port=server.port, timeout_s=30, token=None,
                            environ=job_env)
        comm = job.start()
        try:
            x = np.ones(2)
            comm.all_reduce(x, x)
        finally:
            comm.stop()
    finally:
        server.stop()
    assert server.settings.stall_timeout_s == 20.0
    assert spy.read == [], f"read after resolve: {sorted(set(spy.read))}"
