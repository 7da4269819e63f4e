"""``gridcomm.TorchStore``: a ``torch.distributed.Store`` on gridcomm's control plane.

Imported only when ``gridcomm.TorchStore`` is first used (torch is optional). Each operation is
one coordinator operation on the rank's client (on its Session stream, else unary): ``set``/``get``
are Set/Get, ``add``/``compare_set``/``delete_key`` are Add/CompareSet/DeleteKey (with a request id,
so a call repeated after a broken stream is not applied twice), ``wait``/``check``/``num_keys`` are
Keys. The rank joins the job when the store is made, so its client's watcher reports a dead peer,
and every later store call of the other ranks fails naming it.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from gridcomm._client.client import SHORT_CALL_S, CoordinatorClient, check_text
from gridcomm._communicator.process_group import Job
from gridcomm._errors import ConfigError, GridcommError, RendezvousTimeout
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._runtime import health as _health

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The longest wait one call takes (torch passes timedelta.max for "no timeout"): 30 days.
MAX_WAIT_S = 30 * 86400.0
#: The most keys one wait or check names (the coordinator's bound on a Keys request).
MAX_KEYS = 1024


def _key(key: Any) -> str:
    check_text("a TorchStore key", key)
    return str(key)


def _value(key: str, value: Any) -> bytes:
    """torch hands values as bytes (or str, as its own callers write them)."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, Sequence) and all(isinstance(b, int) for b in value):
        try:
            return bytes(value)
        except ValueError:
            pass
    raise ConfigError(f"value for key {key!r} must be bytes or str, not {type(value).__name__}.")


def _seconds(timeout: Any) -> float:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ConfigError(f"a timeout must be a datetime.timedelta, not {type(timeout).__name__}.")
    if seconds != seconds or seconds <= 0:
        raise ConfigError(f"a timeout must be more than 0 s, not {seconds} s.")
    return min(seconds, MAX_WAIT_S)


class TorchStore(dist.Store):  # type: ignore[misc]
    """A ``torch.distributed.Store`` on gridcomm's coordinator, for
    ``torch.distributed.init_process_group("gloo" or "nccl", store=..., rank=r, world_size=n)``.

    Same arguments and environment as :class:`CoordinatorClient` (``GRIDCOMM_*``, torchrun's
    ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, an Indexed Job's index); rank 0 hosts
    the coordinator unless ``GRIDCOMM_COORDINATOR=external``, as with ``init_process_group``. Making
    it joins the job (every rank waits for the others, up to ``timeout_s``); from then on the
    job has gridcomm's token, TLS, health port and failure detection: a dead rank turns the others'
    store calls into :class:`RankFailedError` naming it. A wait that runs out raises
    ``torch.distributed.DistStoreError``, as torch's own stores do. ``close()`` (also at exit)
    leaves the job; on the coordinator's rank it waits (bounded) for every rank to leave first::

        store = gridcomm.TorchStore()                    # from the environment
        torch.distributed.init_process_group("gloo", store=store, rank=store.rank, world_size=store.world_size)
    """

    def __init__(self, host: str | None = None, port: int | None = None, rank: int | None = None,
                 world_size: int | None = None, token: str | None = None, timeout_s: float | None = None) -> None:
        super().__init__()
        self._job = Job.configure(world_size, rank, backend="host", host=host, port=port, timeout_s=timeout_s,
                                  token=token)
        self.rank = self._job.rank
        self.world_size = self._job.world_size
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._closed = False
        self._health = _health.process_health() or _health.running()
        job = self._job
        try:
            dial = job.host_coordinator()
            job.client = CoordinatorClient(settings=dial, coordinator_rank=0 if job.settings.embedded else None)
            job.client.join()
        except BaseException:
            if job.client is not None:
                job.client.close()
            if job.coordinator is not None:
                job.coordinator.stop(grace_s=min(5.0, job.timeout_s))
            raise
        self._client: CoordinatorClient = job.client
        self.set_timeout(datetime.timedelta(seconds=min(job.timeout_s, MAX_WAIT_S)))
        if self._health is not None:
            self._health.set_ready(self, True)
            self._client.on_failure(self._on_failure)
        atexit.register(self.close)

    # ------------------------------------------------------------------ plumbing
    def _on_failure(self, error: GridcommError) -> None:
        log.warning("rank %d: %s", self.rank, error)
        if self._health is not None:
            self._health.set_ready(self, False)

    def _request_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def _op(self, kind: str, request: Any, what: str) -> Any:
        return self._client._op(kind, request, f"rank {self.rank}: {what}", SHORT_CALL_S)

    def _waiting(self, what: str, timeout: Any, attempt: Callable[[float, float], _T]) -> _T:
        """A wait in bounded slices (as the client's get and barrier); DistStoreError when it runs out."""
        total = _seconds(self.timeout if timeout is None else timeout)  # type: ignore[attr-defined]
        try:
            return self._client._long_poll(f"rank {self.rank}: {what}", total, attempt,
                                           lambda missing: "another rank has not set it yet")
        except RendezvousTimeout as exc:
            raise dist.DistStoreError(str(exc)) from exc

    def _keys(self, keys: Any) -> list[str]:
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise ConfigError(f"keys must be a list of str, not {type(keys).__name__}.")
        names = [_key(k) for k in keys]
        if len(names) > MAX_KEYS:
            raise ConfigError(f"{len(names)} keys in one call; at most {MAX_KEYS}.")
        return names

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: Any) -> None:
        key = _key(key)
        self._client.set(key, _value(key, value))

    def get(self, key: str) -> bytes:
        key = _key(key)
        seconds = _seconds(self.timeout)  # type: ignore[attr-defined]
        try:
            return self._client.get(key, timeout_s=seconds)
        except RendezvousTimeout as exc:
            raise dist.DistStoreError(str(exc)) from exc

    def add(self, key: str, amount: int) -> int:
        key = _key(key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise ConfigError(f"add to key {key!r}: the amount must be an int, not {type(amount).__name__}.")
        request = pb.AddRequest(caller=self._client.caller, key=key, amount=amount, request_id=self._request_id())
        return int(self._op("add", request, f"add to {key!r}").value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        key = _key(key)
        request = pb.CompareSetRequest(caller=self._client.caller, key=key, expected=_value(key, expected),
                                       desired=_value(key, desired), request_id=self._request_id())
        return bytes(self._op("compare_set", request, f"compare_set of {key!r}").value)

    def delete_key(self, key: str) -> bool:
        key = _key(key)
        request = pb.DeleteKeyRequest(caller=self._client.caller, key=key, request_id=self._request_id())
        return bool(self._op("delete_key", request, f"delete_key {key!r}").deleted)

    def num_keys(self) -> int:
        return int(self._op("keys", pb.KeysRequest(caller=self._client.caller), "num_keys").count)

    def check(self, keys: list[str]) -> bool:
        names = self._keys(keys)
        answer = self._op("keys", pb.KeysRequest(caller=self._client.caller, keys=names), "check")
        return all(answer.present)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = self._keys(keys)
        client = self._client
        what = f"wait for {len(names)} key(s) {names[:4]!r}"

        def attempt(wait_s: float, call_s: float) -> pb.KeysResponse:
            return client._op("keys", pb.KeysRequest(caller=client.caller, keys=names, wait_s=wait_s),
                              f"rank {self.rank}: {what}", call_s)

        if names:
            self._waiting(what, timeout, attempt)

    # ------------------------------------------------------------------ gridcomm
    @property
    def client(self) -> CoordinatorClient:
        """The rank's :class:`CoordinatorClient` (joined)."""
        return self._client

    def close(self) -> None:
        """Leaves the job (idempotent; also run at exit). On the rank that hosts the coordinator,
        waits (bounded) for every rank to leave or fail before the server stops."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._health is not None:
            self._health.set_ready(self, False)
        try:
            self._client.leave(SHORT_CALL_S if self._client.failure is None else 2.0)
        except GridcommError as exc:
            log.warning("rank %d: could not leave the job: %s", self.rank, exc)
        finally:
            self._client.close()
            if self._job.coordinator is not None:
                self._job.coordinator.stop(grace_s=self._job.grace_s)

    def __enter__(self) -> TorchStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gridcomm.TorchStore rank {self.rank} of {self.world_size} at {self._client.target}>"
