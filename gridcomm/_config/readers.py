"""One reader per setting, and the only module of gridcomm that touches ``os.environ``; it does
so at call time (when :mod:`gridcomm._config.settings` resolves a settings object), never at import.
Readers only read; the one change to the environment is :func:`withhold_token`, at the end of a
resolve.

Order of precedence for every setting: explicit argument, ``GRIDCOMM_*``, compatible conventions
(cupyx, torchrun/Kubeflow, Kubernetes Indexed Job), then a default or a :class:`ConfigError` that
names the variable, its value and the fix. The variables are listed in
:mod:`gridcomm._config.registry`. The defaults, bounds and checks of the values are in
:mod:`gridcomm._config.values`, the TLS files' loading in :mod:`gridcomm._config.tls_files`; their
names are importable from here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gridcomm._config.tls_files import TlsFiles as TlsFiles
from gridcomm._config.tls_files import read_tls
from gridcomm._config.values import BACKENDS as BACKENDS
from gridcomm._config.values import DEBUG_FLAGS as DEBUG_FLAGS
from gridcomm._config.values import DEFAULT_FLIGHT_RECORD as DEFAULT_FLIGHT_RECORD
from gridcomm._config.values import DEFAULT_HEARTBEAT_TIMEOUT_S as DEFAULT_HEARTBEAT_TIMEOUT_S
from gridcomm._config.values import DEFAULT_HOST as DEFAULT_HOST
from gridcomm._config.values import DEFAULT_JOB_ID as DEFAULT_JOB_ID
from gridcomm._config.values import DEFAULT_METRICS_LINGER_S as DEFAULT_METRICS_LINGER_S
from gridcomm._config.values import DEFAULT_PORT as DEFAULT_PORT
from gridcomm._config.values import DEFAULT_RANKS_PER_ROOT as DEFAULT_RANKS_PER_ROOT
from gridcomm._config.values import DEFAULT_RELAY_FANIN as DEFAULT_RELAY_FANIN
from gridcomm._config.values import DEFAULT_RELAY_PORT as DEFAULT_RELAY_PORT
from gridcomm._config.values import DEFAULT_STALL_TIMEOUT_S as DEFAULT_STALL_TIMEOUT_S
from gridcomm._config.values import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from gridcomm._config.values import MAX_FLIGHT_RECORD as MAX_FLIGHT_RECORD
from gridcomm._config.values import MAX_METRICS_LINGER_S as MAX_METRICS_LINGER_S
from gridcomm._config.values import MAX_WORLD_SIZE as MAX_WORLD_SIZE
from gridcomm._config.values import NCCL_ENGINES as NCCL_ENGINES
from gridcomm._config.values import RELAY_AUTO_WORLD as RELAY_AUTO_WORLD
from gridcomm._config.values import RELAY_MODES as RELAY_MODES
from gridcomm._config.values import SESSION_MODES as SESSION_MODES
from gridcomm._config.values import _check_int, _first, _parse_int
from gridcomm._config.values import auto_relay_fanin as auto_relay_fanin
from gridcomm._config.values import format_relay_address as format_relay_address
from gridcomm._config.values import format_target as format_target
from gridcomm._config.values import parse_duration as parse_duration
from gridcomm._config.values import parse_int as parse_int
from gridcomm._config.values import parse_target as parse_target
from gridcomm._config.values import validate_host as validate_host
from gridcomm._config.values import validate_token as validate_token
from gridcomm._errors import ConfigError


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def tls(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
    """TLS settings, or None (plaintext) when no GRIDCOMM_TLS_* file is set.

    GRIDCOMM_TLS_CERT / _KEY: the coordinator's certificate and key (PEM files).
    GRIDCOMM_TLS_CA: the CA that clients trust for the coordinator (and that the coordinator
    trusts for client certificates). GRIDCOMM_TLS_REQUIRE_CLIENT_CERT=1: mTLS.
    GRIDCOMM_TLS_CLIENT_CERT / _KEY: the certificate a rank presents (default: the shared one).
    GRIDCOMM_TLS_SERVER_NAME: the name to verify in the coordinator's certificate.
    """
    return read_tls(_env(environ))


def world_size(explicit: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks: argument, GRIDCOMM_WORLD_SIZE, WORLD_SIZE (torchrun, Kubeflow PET_NNODES
    is not a rank count and is ignored)."""
    if explicit is not None:
        return _check_int("world_size", explicit, minimum=1, maximum=MAX_WORLD_SIZE)
    env = _env(environ)
    found = _first(env, ("GRIDCOMM_WORLD_SIZE", "WORLD_SIZE"))
    if found is None:
        raise ConfigError(
            "the world size is not known: pass n_devices/world_size, or set GRIDCOMM_WORLD_SIZE "
            "(WORLD_SIZE from torchrun also works)."
        )
    return _parse_int(found[0], found[1], minimum=1, maximum=MAX_WORLD_SIZE)


def rank(explicit: int | None, size: int, environ: Mapping[str, str] | None = None) -> int:
    """This process's rank: argument, GRIDCOMM_RANK, RANK, JOB_COMPLETION_INDEX."""
    if explicit is not None:
        value = _check_int("rank", explicit, minimum=0)
        name = "rank"
    else:
        env = _env(environ)
        found = _first(env, ("GRIDCOMM_RANK", "RANK", "JOB_COMPLETION_INDEX"))
        if found is None:
            raise ConfigError(
                "this process's rank is not known: pass rank, or set GRIDCOMM_RANK "
                "(RANK from torchrun and JOB_COMPLETION_INDEX from an Indexed Job also work)."
            )
        name = found[0]
        value = _parse_int(found[0], found[1], minimum=0)
    if value >= size:
        raise ConfigError(f"{name}={value} is out of range for world size {size}; ranks are 0..{size - 1}.")
    return value


def local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    env = _env(environ)
    found = _first(env, ("GRIDCOMM_LOCAL_RANK", "LOCAL_RANK"))
    return None if found is None else _parse_int(found[0], found[1], minimum=0)


def coordinator_address(
    host: str | None = None, port: int | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, int]:
    """Where the coordinator is: arguments, GRIDCOMM_HOST/PORT, CUPYX_DISTRIBUTED_HOST/PORT,
    MASTER_ADDR/MASTER_PORT, then cupyx's defaults 127.0.0.1:13333."""
    env = _env(environ)
    name = "host"
    if host is None:
        found = _first(env, ("GRIDCOMM_HOST", "CUPYX_DISTRIBUTED_HOST", "MASTER_ADDR"))
        host = DEFAULT_HOST if found is None else found[1]
        name = "host" if found is None else found[0]
    host = validate_host(name, host)
    if port is None:
        found = _first(env, ("GRIDCOMM_PORT", "CUPYX_DISTRIBUTED_PORT", "MASTER_PORT"))
        port = DEFAULT_PORT if found is None else _parse_int(found[0], found[1], minimum=1, maximum=65535)
    else:
        port = _check_int("port", port, minimum=0, maximum=65535)
    return host, port


def bind_address(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The address rank 0's embedded coordinator listens on (separate from the advertised host)."""
    if explicit is not None:
        return validate_host("bind", explicit)
    found = _first(_env(environ), ("GRIDCOMM_BIND",))
    return "0.0.0.0" if found is None else validate_host(found[0], found[1])


def timeout_s(explicit: float | None = None, environ: Mapping[str, str] | None = None) -> float:
    """The bound on a whole call: argument, GRIDCOMM_TIMEOUT_S, then 300 s."""
    if explicit is not None:
        return parse_duration("timeout_s", explicit)
    found = _first(_env(environ), ("GRIDCOMM_TIMEOUT_S",))
    return DEFAULT_TIMEOUT_S if found is None else parse_duration(found[0], found[1])


def heartbeat_timeout_s(explicit: float | None = None, environ: Mapping[str, str] | None = None) -> float:
    """The liveness bound: argument, GRIDCOMM_HEARTBEAT_TIMEOUT_S, then 15 s."""
    if explicit is not None:
        return parse_duration("heartbeat_timeout_s", explicit)
    found = _first(_env(environ), ("GRIDCOMM_HEARTBEAT_TIMEOUT_S",))
    return DEFAULT_HEARTBEAT_TIMEOUT_S if found is None else parse_duration(found[0], found[1])


def timeout_source(explicit: float | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Where the call timeout :func:`timeout_s` returns comes from: ``timeout_s`` (the argument),
    ``GRIDCOMM_TIMEOUT_S``, or ``""`` (the default), for messages that name it."""
    if explicit is not None:
        return "timeout_s"
    return "" if _first(_env(environ), ("GRIDCOMM_TIMEOUT_S",)) is None else "GRIDCOMM_TIMEOUT_S"


def stall_timeout_s(explicit: float | None = None, environ: Mapping[str, str] | None = None, *,
                    call_timeout_s: float | None = None, call_timeout_name: str | None = None) -> float:
    """The stall bound: argument, GRIDCOMM_STALL_TIMEOUT_S (``0``: off), then 120 s, or the call
    timeout (``call_timeout_s``, else GRIDCOMM_TIMEOUT_S) where that is shorter; a bound above the
    call timeout is refused (the calls would time out, naming nobody useful, before the stall is
    named). ``call_timeout_name`` is where ``call_timeout_s`` came from (see timeout_source), so
    the refusal names the setting to change."""
    env = _env(environ)
    if call_timeout_s is None:
        call_s, call_name = timeout_s(None, env), timeout_source(None, env)
    else:
        call_s, call_name = call_timeout_s, "call_timeout_s" if call_timeout_name is None else call_timeout_name
    if explicit is not None:
        name, value = "stall_timeout_s", parse_duration("stall_timeout_s", explicit, allow_zero=True)
    else:
        found = _first(env, ("GRIDCOMM_STALL_TIMEOUT_S",))
        if found is None:
            return min(DEFAULT_STALL_TIMEOUT_S, call_s)
        name, value = found[0], parse_duration(found[0], found[1], allow_zero=True)
    if value > call_s:
        shown = f"{call_name}={call_s:g}" if call_name else f"({call_s:g} s, the default)"
        raise ConfigError(f"{name}={value:g} is longer than the call timeout {shown}: every wait would end first, "
                          f"naming nobody; set {name} to at most {call_s:g} (0 turns it off).")
    return value


def debug_flags(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """GRIDCOMM_DEBUG: comma-separated checks to turn on (``collectives``: mismatched collectives)."""
    found = _first(_env(environ), ("GRIDCOMM_DEBUG",))
    if found is None:
        return frozenset()
    flags = frozenset(f.strip().lower() for f in found[1].split(",") if f.strip())
    unknown = sorted(flags - set(DEBUG_FLAGS))
    if unknown:
        raise ConfigError(f"GRIDCOMM_DEBUG={found[1]!r} names {', '.join(unknown)}; it knows "
                          f"{', '.join(DEBUG_FLAGS)} (comma-separated).")
    return flags


def flight_record(environ: Mapping[str, str] | None = None) -> int:
    """GRIDCOMM_FLIGHT_RECORD: collectives each communicator's flight record keeps (0: none)."""
    found = _first(_env(environ), ("GRIDCOMM_FLIGHT_RECORD",))
    if found is None:
        return DEFAULT_FLIGHT_RECORD
    try:
        value = int(found[1])
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_FLIGHT_RECORD:
        raise ConfigError(f"GRIDCOMM_FLIGHT_RECORD={found[1]!r} must be an integer from 0 (off) to "
                          f"{MAX_FLIGHT_RECORD}.")
    return value


def trace_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """GRIDCOMM_TRACE_DIR: where each rank writes its flight record at a failure (None: nowhere)."""
    found = _first(_env(environ), ("GRIDCOMM_TRACE_DIR",))
    return None if found is None else found[1]


#: The token :func:`withhold_token` took out of this process's environment.
_taken_token: str | None = None


def token(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The shared secret: argument, GRIDCOMM_TOKEN, then the contents of GRIDCOMM_TOKEN_FILE.

    Reads only: a token :func:`withhold_token` took out of the process environment is still
    this process's (the default ``environ``)."""
    if explicit is not None:
        return validate_token("token", explicit)
    env = _env(environ)
    if env is os.environ and env.get("GRIDCOMM_TOKEN", "") == "" and _taken_token is not None:
        return _taken_token
    raw = env.get("GRIDCOMM_TOKEN")
    if raw is not None and raw != "" and not raw.strip():
        # Why not "unset": every other setting reads blank as unset, but a secret that is set to
        # spaces is a mistake (a templated Secret with nothing in it), and unset means no
        # authentication at all.
        validate_token("GRIDCOMM_TOKEN", raw)
    found = _first(env, ("GRIDCOMM_TOKEN",))
    if found is not None:
        return validate_token(found[0], found[1])
    found = _first(env, ("GRIDCOMM_TOKEN_FILE",))
    if found is None:
        return None
    try:
        with open(found[1], encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError as exc:
        raise ConfigError(f"GRIDCOMM_TOKEN_FILE={found[1]!r} cannot be read: {exc.strerror}; is the file (in "
                          "Kubernetes: the Secret mounted there, with its key) in place?") from exc
    return validate_token("GRIDCOMM_TOKEN_FILE", text)


def withhold_token(environ: Mapping[str, str] | None = None) -> None:
    """Takes GRIDCOMM_TOKEN out of the process environment (``environ`` None or the process's)
    once its settings are resolved, and remembers it for :func:`token`, unless
    GRIDCOMM_TOKEN_INHERIT asks to keep it there. Why: the processes the program starts (a data
    loader, a shell-out, a crash reporter) would otherwise carry the secret. ``/proc/PID/environ``
    (readable by the same user only) still shows the start-up environment; GRIDCOMM_TOKEN_FILE
    keeps the secret out of it altogether. The one place gridcomm changes the environment; an
    ``environ`` mapping passed in is never changed."""
    global _taken_token
    env = _env(environ)
    if env is not os.environ or token_inherited(env):
        return
    found = _first(env, ("GRIDCOMM_TOKEN",))
    if found is not None:
        _taken_token = validate_token(found[0], found[1])
        os.environ.pop("GRIDCOMM_TOKEN", None)


def job_id(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    if explicit is None:
        found = _first(_env(environ), ("GRIDCOMM_JOB_ID",))
        explicit = DEFAULT_JOB_ID if found is None else found[1]
    if not isinstance(explicit, str) or not explicit or len(explicit) > 256 or not explicit.isprintable():
        raise ConfigError(f"job id {explicit!r} must be a printable string of 1 to 256 characters.")
    return explicit


def backend(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    if explicit is None:
        found = _first(_env(environ), ("GRIDCOMM_BACKEND",))
        explicit, name = ("nccl", "backend") if found is None else (found[1], found[0])
    else:
        name = "backend"
    if explicit not in BACKENDS:
        raise ConfigError(f"{name}={explicit!r} is not a backend; choose one of {', '.join(BACKENDS)}.")
    return explicit


def coordinator_mode(environ: Mapping[str, str] | None = None) -> str:
    found = _first(_env(environ), ("GRIDCOMM_COORDINATOR",))
    mode = "embedded" if found is None else found[1]
    if mode not in ("embedded", "external"):
        raise ConfigError(f"GRIDCOMM_COORDINATOR={mode!r} must be 'embedded' or 'external'.")
    return mode


def session_mode(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """How a client carries its waiting calls: ``client`` (default: a Session stream of its own)
    or ``off`` (unary RPCs only); argument, then GRIDCOMM_SESSION."""
    value = explicit
    if value is None:
        found = _first(_env(environ), ("GRIDCOMM_SESSION",))
        value = found[1].strip().lower() if found else "client"
    if value == "process":
        # Why refused, not mapped: the stream shared by a process's clients was removed (it
        # served only ranks that share a process, which no deployment has).
        raise ConfigError("GRIDCOMM_SESSION=process was removed: every client has a stream of its own now; "
                          "unset it, or use 'client' or 'off'.")
    if value not in SESSION_MODES:
        raise ConfigError(f"GRIDCOMM_SESSION={value!r} must be one of {', '.join(SESSION_MODES)}.")
    return value


def relay_fanin(environ: Mapping[str, str] | None = None) -> int | None:
    """GRIDCOMM_RELAY_FANIN: ranks per relay of the tree (the relay's own rank included); None
    (unset or ``auto``): derived from the world size, see auto_relay_fanin."""
    found = _first(_env(environ), ("GRIDCOMM_RELAY_FANIN",))
    if found is None or found[1].strip().lower() == "auto":
        return None
    if not found[1].strip().isdigit():
        raise ConfigError(f"{found[0]}={found[1]!r} must be `auto` or a whole number of ranks per relay, "
                          "at least 2.")
    return _parse_int(found[0], found[1].strip(), minimum=2, maximum=4096)


def relay_mode(environ: Mapping[str, str] | None = None) -> str:
    """GRIDCOMM_RELAY: the relay tree (``auto``: from RELAY_AUTO_WORLD ranks on; ``on``: at any
    size, and ``gridcomm launch`` hosts a relay for the ranks it starts; ``off``: never)."""
    found = _first(_env(environ), ("GRIDCOMM_RELAY",))
    value = found[1].strip().lower() if found else "auto"
    if value not in RELAY_MODES:
        raise ConfigError(f"GRIDCOMM_RELAY={value!r} must be one of {', '.join(RELAY_MODES)}.")
    return value


def relay_address(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """GRIDCOMM_RELAY_ADDRESS (host:port): the relay this rank's Session stream dials instead of
    the coordinator (set by ``gridcomm launch``), or None."""
    value = explicit
    if value is None:
        found = _first(_env(environ), ("GRIDCOMM_RELAY_ADDRESS",))
        if found is None or not found[1].strip():
            return None
        value = found[1].strip()
    try:
        return format_target(*parse_target(value))
    except ConfigError as exc:
        raise ConfigError(f"GRIDCOMM_RELAY_ADDRESS: {exc}") from None


def relay_addresses(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """GRIDCOMM_RELAY_ADDRESSES: where the tree's relays listen, as a template of ``host:port`` in
    which ``{leader}`` is the rank that hosts a group's relay and ``{group}`` the group's index
    (Python format fields, e.g. ``train-{leader}.train:13336`` or ``10.0.0.1:2{group:04d}``); or
    None. Checked here by formatting it once, so a bad template is named at start, not at join."""
    value = explicit
    name = "relay_addresses"
    if value is None:
        found = _first(_env(environ), ("GRIDCOMM_RELAY_ADDRESSES",))
        if found is None or not found[1].strip():
            return None
        name, value = found[0], found[1].strip()
    if "{" not in value:
        raise ConfigError(f"{name}={value!r} names no relay per group: put {{leader}} (the rank that hosts a "
                          "group's relay) or {group} in it, e.g. 'train-{leader}.train:13336'.")
    format_relay_address(value, 0, 0, name)
    return value


def process_environ() -> Mapping[str, str]:
    """The process environment, for code that takes an ``environ`` mapping (cluster detection), so
    that this module stays the only one that touches ``os.environ``. Read it; do not change it."""
    return os.environ


def health_port(explicit: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """The plaintext grpc.health.v1 port of this rank: argument, GRIDCOMM_HEALTH_PORT, else None
    (no separate health port). Kubernetes probes it (deploy/k8s uses 13334)."""
    if explicit is not None:
        return _check_int("health_port", explicit, minimum=0, maximum=65535)
    found = _first(_env(environ), ("GRIDCOMM_HEALTH_PORT",))
    return None if found is None else _parse_int(found[0], found[1], minimum=1, maximum=65535)


def data_host(environ: Mapping[str, str] | None = None) -> str | None:
    """The address the host backend's data plane listens on and publishes to its peers:
    GRIDCOMM_DATA_HOST, else None (the address of this host on the route to the coordinator)."""
    found = _first(_env(environ), ("GRIDCOMM_DATA_HOST",))
    return None if found is None else validate_host(found[0], found[1])


def token_inherited(environ: Mapping[str, str] | None = None) -> bool:
    """GRIDCOMM_TOKEN_INHERIT: keep GRIDCOMM_TOKEN in the environment once read (child processes
    then inherit it); default off."""
    return _flag("GRIDCOMM_TOKEN_INHERIT", environ, default=False)


def _flag(name: str, environ: Mapping[str, str] | None, *, default: bool) -> bool:
    found = _first(_env(environ), (name,))
    if found is None:
        return default
    value = found[1].lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ConfigError(f"{name}={found[1]!r} must be 1/on/true/yes or 0/off/false/no.")


def shared_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Whether host-backend ranks of one host may exchange through /dev/shm: GRIDCOMM_SHM (``0``,
    ``off``, ``false`` or ``no`` turn it off, e.g. where /dev/shm is too small), default on."""
    return _flag("GRIDCOMM_SHM", environ, default=True)


def metrics_port(explicit: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """The Prometheus /metrics port of the process hosting the coordinator: argument,
    GRIDCOMM_METRICS_PORT, else None (no metrics endpoint). deploy/k8s uses 13335."""
    if explicit is not None:
        return _check_int("metrics_port", explicit, minimum=0, maximum=65535)
    found = _first(_env(environ), ("GRIDCOMM_METRICS_PORT",))
    return None if found is None else _parse_int(found[0], found[1], minimum=0, maximum=65535)


def metrics_linger_s(environ: Mapping[str, str] | None = None) -> float:
    """GRIDCOMM_METRICS_LINGER_S (``0``: none), else 30 s; at most 600 s."""
    found = _first(_env(environ), ("GRIDCOMM_METRICS_LINGER_S",))
    if found is None:
        return DEFAULT_METRICS_LINGER_S
    value = parse_duration(found[0], found[1], allow_zero=True)
    if value > MAX_METRICS_LINGER_S:
        raise ConfigError(f"{found[0]}={found[1]!r} is more than {MAX_METRICS_LINGER_S:g} s; the linger only has to "
                          "outlast two scrape intervals (e.g. 30 for a 15 s scrape).")
    return value


def nccl_engine(environ: Mapping[str, str] | None = None) -> str:
    """GRIDCOMM_NCCL_ENGINE as given: ``auto`` (unset or empty), ``nccl4py`` or ``cupy``."""
    env = _env(environ)
    value = (env.get("GRIDCOMM_NCCL_ENGINE") or "auto").strip().lower()
    if value not in NCCL_ENGINES:
        raise ConfigError(f"GRIDCOMM_NCCL_ENGINE={env.get('GRIDCOMM_NCCL_ENGINE')!r} is not one of "
                          f"{', '.join(NCCL_ENGINES)}; unset it (auto: nccl4py where installed, else CuPy's binding).")
    return value


def ranks_per_root(environ: Mapping[str, str] | None = None) -> int:
    """GRIDCOMM_RANKS_PER_ROOT: ranks per NCCL bootstrap root (default 128, at least 1)."""
    raw = (_env(environ).get("GRIDCOMM_RANKS_PER_ROOT") or "").strip()
    if not raw:
        return DEFAULT_RANKS_PER_ROOT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"GRIDCOMM_RANKS_PER_ROOT={raw!r} must be a whole number of ranks >= 1 (default "
                          f"{DEFAULT_RANKS_PER_ROOT}); unset it to use the default.")
    return value


def demo_iters(default: int, environ: Mapping[str, str] | None = None) -> int:
    """DEMO_ITERS, the iterations `gridcomm demo` times (set by the demo's parent for its ranks)."""
    found = _first(_env(environ), ("DEMO_ITERS",))
    return default if found is None else _parse_int(found[0], found[1], minimum=1)


def launch_backend(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The backend `gridcomm launch`/`demo` hand their ranks: argument, GRIDCOMM_BACKEND, then
    ``auto`` (a launcher picks per machine; a rank started by hand defaults to ``nccl``)."""
    if explicit is not None:
        return backend(explicit)
    found = _first(_env(environ), ("GRIDCOMM_BACKEND",))
    return "auto" if found is None else backend(None, {"GRIDCOMM_BACKEND": found[1]})


def launch_port(environ: Mapping[str, str] | None = None) -> int | None:
    """The coordinator port a launcher gives its ranks: GRIDCOMM_PORT, else None (a free one)."""
    found = _first(_env(environ), ("GRIDCOMM_PORT",))
    return None if found is None else _parse_int(found[0], found[1], minimum=1, maximum=65535)
