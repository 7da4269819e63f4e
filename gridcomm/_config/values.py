"""What a setting's value may be: the defaults and bounds, and the parsing and checks of a value
once :mod:`gridcomm._config.readers` has found it (in an argument or the environment). Nothing here
reads the environment (:func:`_first` looks in the mapping it is given); every name is also
importable from :mod:`gridcomm._config.readers`.
"""

from __future__ import annotations

import ipaddress
import math
import operator
from collections.abc import Mapping

from gridcomm._errors import ConfigError

#: cupyx.distributed's defaults, kept so a cupyx program switches by changing its import.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 13333

#: Bound on a whole call (join, barrier, get, rebuild) unless the caller or GRIDCOMM_TIMEOUT_S says otherwise.
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_JOB_ID = "default"

#: A rank not heard from for this long is declared failed (GRIDCOMM_HEARTBEAT_TIMEOUT_S).
DEFAULT_HEARTBEAT_TIMEOUT_S = 15.0
BACKENDS = ("auto", "nccl", "host")

#: How long ranks may wait in a collective a live rank has not entered before it is named
#: (GRIDCOMM_STALL_TIMEOUT_S); never more than the call timeout. Why 120 s: far above a step's
#: skew between ranks in a healthy job (and 8x the liveness bound), so one rank's long solo work
#: between collectives (an evaluation, a checkpoint it writes alone) is not a stall; far below
#: torch's 10-minute NCCL watchdog and the 300 s call timeout, whose expiry names nobody useful.
DEFAULT_STALL_TIMEOUT_S = 120.0

#: What GRIDCOMM_DEBUG may name (comma-separated).
DEBUG_FLAGS = ("collectives",)

#: The most ranks one coordinator is started for. Why a bound: a world size comes from the
#: command line or the environment, and a coordinator sized for a billion ranks dies on a
#: MemoryError before it can say why; 2**20 is far above any job gridcomm is built for.
MAX_WORLD_SIZE = 1 << 20

#: Collectives each communicator's flight record keeps by default (GRIDCOMM_FLIGHT_RECORD).
DEFAULT_FLIGHT_RECORD = 256
MAX_FLIGHT_RECORD = 1 << 20

#: Values of GRIDCOMM_SESSION.
SESSION_MODES = ("client", "off")
#: Values of GRIDCOMM_RELAY.
RELAY_MODES = ("auto", "on", "off")

#: From this world size on, GRIDCOMM_RELAY=auto builds the relay tree.
RELAY_AUTO_WORLD = 256

#: The smallest fan-in GRIDCOMM_RELAY_FANIN=auto picks (up to 1,024 ranks it is this).
DEFAULT_RELAY_FANIN = 32

#: The port of a tree relay whose address is derived from a Kubernetes pod name (the coordinator's
#: default port is 13333, a rank's health port 13334, its metrics port 13335 in deploy/).
DEFAULT_RELAY_PORT = 13336

#: How long the process hosting the coordinator keeps serving /metrics and status when it stops
#: with a grace (rank 0 at the job's end or after a failure): GRIDCOMM_METRICS_LINGER_S. Why 30 s:
#: two scrapes at Prometheus's slowest common interval (15 s, the shipped ServiceMonitor's), so
#: the last one sees the failure; and no more than Kubernetes' default 30 s termination grace.
DEFAULT_METRICS_LINGER_S = 30.0

#: A linger above this is refused: a typo must not hold a finished pod for hours.
MAX_METRICS_LINGER_S = 600.0

#: Values of GRIDCOMM_NCCL_ENGINE.
NCCL_ENGINES = ("auto", "nccl4py", "cupy")

#: Ranks per NCCL bootstrap root (GRIDCOMM_RANKS_PER_ROOT), as torch's TORCH_NCCL_RANKS_PER_ROOT.
DEFAULT_RANKS_PER_ROOT = 128


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def _parse_int(name: str, value: str, *, minimum: int, maximum: int | None = None) -> int:
    try:
        parsed = int(value, 10)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer; set it to a whole number such as {minimum}.") from None
    if parsed < minimum or (maximum is not None and parsed > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise ConfigError(f"{name}={parsed} is out of range; it must be at least {minimum}{upper}.")
    return parsed


def parse_duration(name: str, value: object, *, allow_zero: bool = False) -> float:
    """Parses a duration in seconds (``*_s``) and checks it is finite and positive."""
    try:
        parsed = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a number of seconds; use e.g. {name}=30.") from None
    if not math.isfinite(parsed) or parsed < 0 or (parsed == 0 and not allow_zero):
        raise ConfigError(f"{name}={value!r} must be a finite number of seconds greater than 0.")
    return parsed


def validate_host(name: str, host: object) -> str:
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host.strip()):
        raise ConfigError(f"{name}={host!r} is not a host name or address; use e.g. 'job-0.svc' or '10.0.0.1'.")
    host = host.strip()
    if "://" in host:
        raise ConfigError(f"{name}={host!r} is a URL; give the host name or address alone (e.g. 'job-0.svc'), "
                          "and the port in its own setting (GRIDCOMM_PORT).")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            bare, _, port = host.rpartition(":")
            raise ConfigError(f"{name}={host!r} holds a port; set {name}={bare!r} and the port in its own setting "
                              f"(GRIDCOMM_PORT={port}, or port=).") from None
    return host


def format_target(host: str, port: int) -> str:
    """host:port as gRPC wants it (IPv6 literals in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_target(target: str) -> tuple[str, int]:
    """Parses HOST:PORT (or [V6]:PORT) from the command line."""
    text = target.strip()
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or not text[close + 1 :].startswith(":"):
            raise ConfigError(f"address {target!r} is not [IPV6]:PORT.")
        host, port_text = text[1:close], text[close + 2 :]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"address {target!r} is not HOST:PORT; e.g. 127.0.0.1:13333.")
    return validate_host("host", host), _parse_int("port", port_text, minimum=1, maximum=65535)


def validate_token(name: str, value: object) -> str:
    if isinstance(value, str) and value and value != value.strip():
        # Why refused: a blank token is no secret, and one with spaces around it was almost
        # surely pasted with them; the other ranks' copy would differ.
        raise ConfigError(f"{name} is {'blank' if not value.strip() else 'padded with whitespace'}; set the secret "
                          "itself (no spaces around it), or leave it unset for no authentication.")
    if not isinstance(value, str) or not value or not value.isprintable() or len(value) > 4096:
        raise ConfigError(f"{name} must be a non-empty printable string of at most 4096 characters.")
    return value


def auto_relay_fanin(world_size: int) -> int:
    """The fan-in of GRIDCOMM_RELAY_FANIN=auto: the smallest power of two at or above the square
    root of the world size, at least DEFAULT_RELAY_FANIN (32 up to 1,024 ranks, 64 up to 4,096,
    128 up to 16,384, 512 at 100,000). Why the square root: a barrier waits for the slowest
    relay's K child messages and then the coordinator's N / K relay messages, each about the same
    cost, so K x c + N / K x c is least at K = sqrt(N). Every rank derives the same value from
    the world size, so they agree on their groups without asking anyone."""
    fanin = DEFAULT_RELAY_FANIN
    while fanin * fanin < world_size:
        fanin *= 2
    return fanin


def format_relay_address(template: str, leader: int, group: int, name: str = "GRIDCOMM_RELAY_ADDRESSES") -> str:
    """One group's relay address from the template (see relay_addresses)."""
    try:
        text = template.format(leader=leader, group=group)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{name}={template!r} is not a template of {{leader}} and {{group}}: "
                          f"{type(exc).__name__}: {exc}") from None
    try:
        return format_target(*parse_target(text))
    except ConfigError as exc:
        raise ConfigError(f"{name}={template!r} gives {text!r} for group {group}: {exc}") from None


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = operator.index(value)  # type: ignore[arg-type]  # numpy integers
        except TypeError:
            raise ConfigError(f"{name}={value!r} must be an integer.") from None
    return _parse_int(name, str(value), minimum=minimum, maximum=maximum)


def parse_int(name: str, value: str, *, minimum: int, maximum: int | None = None) -> int:
    """Parses the integer setting ``name`` from text, with a ConfigError that names it when it is
    not a whole number in ``minimum..maximum``."""
    return _parse_int(name, value, minimum=minimum, maximum=maximum)
