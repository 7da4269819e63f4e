"""Every environment variable gridcomm reads, in one table: its name, type, default and meaning.

The README's configuration table is generated from :data:`VARIABLES` (``python
scripts/settings_table.py --write``) and tests/test_config.py fails when the two differ, so a
variable added here without being documented (or documented without being read) is caught.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One ``GRIDCOMM_*`` variable: ``argument`` is the explicit argument that wins over it (if
    any), ``conventions`` the other programs' names read after it (cupyx, torchrun, Kubernetes)."""

    name: str
    type: str
    default: str
    meaning: str
    argument: str = ""
    conventions: tuple[str, ...] = ()


VARIABLES: tuple[Variable, ...] = (
    Variable("GRIDCOMM_HOST", "host", "`127.0.0.1` (cupyx's)", "the coordinator's address, as ranks dial it",
             "`host=`", ("CUPYX_DISTRIBUTED_HOST", "MASTER_ADDR")),
    Variable("GRIDCOMM_PORT", "port", "`13333` (cupyx's); under torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE`, "
             "which holds `MASTER_PORT`) a port in 20000-31999 derived from `TORCHELASTIC_RUN_ID` and `MASTER_PORT`, "
             "the same for every rank of the job", "the coordinator's port", "`port=`",
             ("CUPYX_DISTRIBUTED_PORT", "MASTER_PORT")),
    Variable("GRIDCOMM_BIND", "host", "`0.0.0.0` (a warning is logged when no token is set)",
             "the listen address of rank 0's embedded coordinator (and of `gridcomm serve`)", "`bind=` (`Coordinator`)"),
    Variable("GRIDCOMM_RANK", "int >= 0", "`ConfigError`", "this process's rank", "`rank=`",
             ("RANK", "JOB_COMPLETION_INDEX")),
    Variable("GRIDCOMM_LOCAL_RANK", "int >= 0", "0", "this process's rank on its host", "", ("LOCAL_RANK",)),
    Variable("GRIDCOMM_WORLD_SIZE", "int >= 1", "`ConfigError`", "the number of ranks",
             "`n_devices=`/`world_size=`", ("WORLD_SIZE",)),
    Variable("GRIDCOMM_TOKEN", "string", "none (no authentication)",
             "the shared secret every coordinator RPC carries", "`token=`"),
    Variable("GRIDCOMM_TOKEN_FILE", "path", "none", "a file holding the token (a mounted Secret)"),
    Variable("GRIDCOMM_TOKEN_INHERIT", "bool", "off",
             "keep `GRIDCOMM_TOKEN` in the environment once read, so child processes inherit it (by default it is "
             "removed, and only `gridcomm launch` passes it on, to its ranks)"),
    Variable("GRIDCOMM_TIMEOUT_S", "seconds", "300 s", "the bound on a whole call (join, barrier, rebuild ...)",
             "`timeout_s=`"),
    Variable("GRIDCOMM_HEARTBEAT_TIMEOUT_S", "seconds", "15 s",
             "a rank not heard from for this long is declared failed", "`heartbeat_timeout_s=` (`Coordinator`)"),
    Variable("GRIDCOMM_STALL_TIMEOUT_S", "seconds, `0` off", "120 s (at most `GRIDCOMM_TIMEOUT_S`)",
             "how long ranks may wait in a collective (or barrier) that a live rank has not entered before that rank "
             "is failed as stalled (read where the coordinator runs)", "`stall_timeout_s=` (`Coordinator`)"),
    Variable("GRIDCOMM_DEBUG", "`collectives`", "none",
             "`collectives`: every rank fingerprints each collective (kind, op, count x dtype, root) and the "
             "coordinator names the first one ranks called differently"),
    Variable("GRIDCOMM_FLIGHT_RECORD", "int >= 0, `0` off", "256",
             "collectives each communicator's flight record keeps (number, kind, op, count x dtype, root, entered and "
             "returned times)"),
    Variable("GRIDCOMM_TRACE_DIR", "path", "none",
             "each rank writes its flight record there (`rank-N.json`) at a failure, `abort()` or SIGTERM; "
             "`gridcomm trace DIR` merges them"),
    Variable("GRIDCOMM_JOB_ID", "string", "`default`", "the job's name; a rank of another job is refused",
             "`job_id=`"),
    Variable("GRIDCOMM_BACKEND", "`auto`, `nccl`, `host`", "`nccl`", "the communicator backend", "`backend=`"),
    Variable("GRIDCOMM_COORDINATOR", "`embedded`, `external`", "`embedded`",
             "`embedded`: rank 0 hosts the coordinator; `external`: every rank dials a `gridcomm serve`"),
    Variable("GRIDCOMM_SESSION", "`client`, `off`", "`client`",
             "how calls travel: a Session stream per client, or one unary RPC per call (`process` was removed)",
             "`session=`"),
    Variable("GRIDCOMM_RELAY", "`auto`, `on`, `off`", "`auto` (on from 256 ranks)",
             "the relay tree: rank `k x FANIN` hosts a relay for its group; the others' streams go to it after the "
             "join, and it carries their barriers, gets and heartbeats to the coordinator as aggregates; `on` also "
             "makes `gridcomm launch` host one for the ranks it starts"),
    Variable("GRIDCOMM_RELAY_FANIN", "`auto`, int >= 2", "`auto` (32 up to 1,024 ranks, then the power of two "
             "at or above the square root of the world size)",
             "ranks per relay of the tree (its own rank included); the coordinator's sets the groups of a join "
             "without `GRIDCOMM_RELAY_ADDRESSES` (if `auto` there, the ranks')"),
    Variable("GRIDCOMM_RELAY_ADDRESS", "host:port", "none (the coordinator)",
             "the relay a rank's Session stream dials (set by `gridcomm launch`); its unary calls, and everything "
             "once the relay is gone, go to the coordinator"),
    Variable("GRIDCOMM_RELAY_ADDRESSES", "template of host:port", "derived in an Indexed Job or JobSet "
             "(`<job>-{leader}.<subdomain>:13336`), else none",
             "where each group's relay of the tree listens: `{leader}` is the rank hosting it, `{group}` its index; "
             "a rank joins through its group's relay (the coordinator then sees one connection per group), and "
             "joins the coordinator directly if that relay does not answer within 20 s"),
    Variable("GRIDCOMM_HEALTH_PORT", "port", "none",
             "this rank's plaintext grpc.health.v1 port (`\"\"` liveness, `gridcomm.v1.Coordinator` readiness); "
             "`gridcomm launch` gives its rank i this port + i"),
    Variable("GRIDCOMM_RESTART_COUNT", "int >= 1", "unset (a first start)",
             "set by `gridcomm launch --max-restarts` in a rank's restarted process: the job's restarts so far, this "
             "one included (`TORCHELASTIC_RESTART_COUNT` likewise)"),
    Variable("GRIDCOMM_METRICS_PORT", "port", "none",
             "the Prometheus /metrics port of the process hosting the coordinator",
             "`metrics_port=` (`Coordinator`), `gridcomm serve --metrics-port`"),
    Variable("GRIDCOMM_METRICS_LINGER_S", "seconds, `0` off", "30 s (at most 600 s)",
             "with a metrics port, how long rank 0's process keeps serving `/metrics` and status after the job's "
             "end, or after its latest rank failure where that came first, so the last scrapes see it (a SIGTERM "
             "meanwhile waits for it; read where the coordinator runs)"),
    Variable("GRIDCOMM_DATA_HOST", "host", "this host's address on the route to the coordinator",
             "the address the host backend's data plane listens on and publishes"),
    Variable("GRIDCOMM_SHM", "bool", "on", "whether host-backend ranks of one host exchange through /dev/shm"),
    Variable("GRIDCOMM_NCCL_ENGINE", "`auto`, `nccl4py`, `cupy`", "`auto`",
             "what drives NCCL: nccl4py (init that can be aborted at its deadline) where usable, else CuPy's binding"),
    Variable("GRIDCOMM_RANKS_PER_ROOT", "int >= 1", "128", "ranks per NCCL bootstrap root (nccl4py)"),
    Variable("GRIDCOMM_SUBDOMAIN", "DNS name", "the pod's subdomain from its FQDN",
             "the domain rank 0's derived Kubernetes name lives in"),
    Variable("GRIDCOMM_TLS_CERT", "path (PEM)", "plaintext", "the coordinator's certificate"),
    Variable("GRIDCOMM_TLS_KEY", "path (PEM)", "plaintext", "the coordinator's key"),
    Variable("GRIDCOMM_TLS_CA", "path (PEM)", "the system's roots", "the CA ranks trust (and mTLS verifies with)"),
    Variable("GRIDCOMM_TLS_REQUIRE_CLIENT_CERT", "bool", "off", "mTLS: the coordinator requires client certificates"),
    Variable("GRIDCOMM_TLS_CLIENT_CERT", "path (PEM)", "the shared certificate (with mTLS)",
             "the certificate a rank presents"),
    Variable("GRIDCOMM_TLS_CLIENT_KEY", "path (PEM)", "the shared key (with mTLS)", "the key a rank presents"),
    Variable("GRIDCOMM_TLS_SERVER_NAME", "DNS name", "the dialled host", "the name to verify in the coordinator's certificate"),
)

BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


def table() -> str:
    """The README's configuration table (Markdown), one row per variable."""
    rows = ["| variable | explicit argument; conventions read after it | type | default | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for v in VARIABLES:
        sources = "; ".join(part for part in (v.argument, ", ".join(f"`{c}`" for c in v.conventions)) if part)
        rows.append(f"| `{v.name}` | {sources or '-'} | {v.type} | {v.default} | {v.meaning} |")
    return "\n".join(rows) + "\n"
