"""Configuration: one table of environment variables (:mod:`.registry`), one reader per setting and
the only access to the process environment (:mod:`.readers`), the settings objects resolved once per
``init_process_group`` / ``Coordinator`` / ``CoordinatorClient`` (:mod:`.settings`), and cluster
detection (:mod:`.cluster`). A leaf: it imports nothing of gridcomm but its errors.

The readers are re-exported here for the helpers that parse command-line values (``parse_target``,
``parse_duration``) and for tests; the layers above take a settings object instead.
"""

from __future__ import annotations

from gridcomm._config.readers import (
    BACKENDS,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_JOB_ID,
    DEFAULT_PORT,
    DEFAULT_RANKS_PER_ROOT,
    DEFAULT_RELAY_FANIN,
    DEFAULT_RELAY_PORT,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    MAX_WORLD_SIZE,
    NCCL_ENGINES,
    RELAY_AUTO_WORLD,
    RELAY_MODES,
    SESSION_MODES,
    TlsFiles,
    auto_relay_fanin,
    backend,
    bind_address,
    coordinator_address,
    coordinator_mode,
    data_host,
    debug_flags,
    demo_iters,
    flight_record,
    format_relay_address,
    format_target,
    health_port,
    heartbeat_timeout_s,
    job_id,
    launch_backend,
    launch_port,
    local_rank,
    metrics_port,
    nccl_engine,
    parse_duration,
    parse_int,
    parse_target,
    process_environ,
    rank,
    ranks_per_root,
    relay_address,
    relay_addresses,
    relay_fanin,
    relay_mode,
    session_mode,
    shared_memory,
    stall_timeout_s,
    timeout_s,
    tls,
    token,
    trace_dir,
    validate_host,
    validate_token,
    world_size,
)
from gridcomm._config.settings import ClientSettings, CoordinatorSettings, NcclSettings, PlaneSettings, Settings

__all__ = [
    "BACKENDS", "DEFAULT_HEARTBEAT_TIMEOUT_S", "DEFAULT_HOST", "DEFAULT_JOB_ID", "DEFAULT_PORT",
    "DEFAULT_RANKS_PER_ROOT", "DEFAULT_TIMEOUT_S", "MAX_WORLD_SIZE", "NCCL_ENGINES", "SESSION_MODES",
    "ClientSettings", "CoordinatorSettings", "NcclSettings", "PlaneSettings", "Settings", "TlsFiles", "backend",
    "bind_address", "coordinator_address", "coordinator_mode", "data_host", "demo_iters", "format_target",
    "health_port", "heartbeat_timeout_s", "job_id", "launch_backend", "launch_port", "local_rank", "metrics_port", "nccl_engine",
    "parse_duration", "parse_int", "parse_target", "process_environ", "rank", "ranks_per_root", "session_mode", "relay_address", "relay_addresses", "format_relay_address", "DEFAULT_RELAY_PORT", "relay_mode", "RELAY_MODES", "relay_fanin", "auto_relay_fanin", "RELAY_AUTO_WORLD",
    "DEFAULT_RELAY_FANIN",
    "shared_memory", "stall_timeout_s", "debug_flags", "flight_record", "trace_dir", "DEFAULT_STALL_TIMEOUT_S", "timeout_s", "tls", "token", "validate_host", "validate_token", "world_size",
]
