from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_JOINED: _ClassVar[MemberState]
    MEMBER_STATE_LEFT: _ClassVar[MemberState]
    MEMBER_STATE_FAILED: _ClassVar[MemberState]

class FailureCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CAUSE_UNSPECIFIED: _ClassVar[FailureCause]
    FAILURE_CAUSE_STALL: _ClassVar[FailureCause]
    FAILURE_CAUSE_MISMATCH: _ClassVar[FailureCause]

class Recovery(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_NONE: _ClassVar[Recovery]
    RECOVERY_REBUILD: _ClassVar[Recovery]
    RECOVERY_SHRINK: _ClassVar[Recovery]
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_JOINED: MemberState
MEMBER_STATE_LEFT: MemberState
MEMBER_STATE_FAILED: MemberState
FAILURE_CAUSE_UNSPECIFIED: FailureCause
FAILURE_CAUSE_STALL: FailureCause
FAILURE_CAUSE_MISMATCH: FailureCause
RECOVERY_NONE: Recovery
RECOVERY_REBUILD: Recovery
RECOVERY_SHRINK: Recovery

class Caller(_message.Message):
    __slots__ = ("job_id", "rank", "incarnation", "generation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    incarnation: int
    generation: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("rank", "hostname", "incarnation", "state", "joined_at_unix_s", "process_tag")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PROCESS_TAG_FIELD_NUMBER: _ClassVar[int]
    rank: int
    hostname: str
    incarnation: int
    state: MemberState
    joined_at_unix_s: float
    process_tag: str
    def __init__(self, rank: _Optional[int] = ..., hostname: _Optional[str] = ..., incarnation: _Optional[int] = ..., state: _Optional[_Union[MemberState, str]] = ..., joined_at_unix_s: _Optional[float] = ..., process_tag: _Optional[str] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("rank", "reason", "at_unix_s", "reported_by", "cause")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REPORTED_BY_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reason: str
    at_unix_s: float
    reported_by: int
    cause: FailureCause
    def __init__(self, rank: _Optional[int] = ..., reason: _Optional[str] = ..., at_unix_s: _Optional[float] = ..., reported_by: _Optional[int] = ..., cause: _Optional[_Union[FailureCause, str]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("communicator", "entered", "kind", "age_s", "inside", "rank", "recent", "completed", "gpu_wait_s", "digest", "probe_counts", "probe_digests", "probe_prints", "probe_lost", "inside_s")
    COMMUNICATOR_FIELD_NUMBER: _ClassVar[int]
    ENTERED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    INSIDE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    GPU_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PROBE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROBE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PROBE_PRINTS_FIELD_NUMBER: _ClassVar[int]
    PROBE_LOST_FIELD_NUMBER: _ClassVar[int]
    INSIDE_S_FIELD_NUMBER: _ClassVar[int]
    communicator: str
    entered: int
    kind: str
    age_s: float
    inside: bool
    rank: int
    recent: _containers.RepeatedScalarFieldContainer[str]
    completed: int
    gpu_wait_s: float
    digest: int
    probe_counts: _containers.RepeatedScalarFieldContainer[int]
    probe_digests: _containers.RepeatedScalarFieldContainer[int]
    probe_prints: _containers.RepeatedScalarFieldContainer[str]
    probe_lost: _containers.RepeatedScalarFieldContainer[int]
    inside_s: float
    def __init__(self, communicator: _Optional[str] = ..., entered: _Optional[int] = ..., kind: _Optional[str] = ..., age_s: _Optional[float] = ..., inside: bool = ..., rank: _Optional[int] = ..., recent: _Optional[_Iterable[str]] = ..., completed: _Optional[int] = ..., gpu_wait_s: _Optional[float] = ..., digest: _Optional[int] = ..., probe_counts: _Optional[_Iterable[int]] = ..., probe_digests: _Optional[_Iterable[int]] = ..., probe_prints: _Optional[_Iterable[str]] = ..., probe_lost: _Optional[_Iterable[int]] = ..., inside_s: _Optional[float] = ...) -> None: ...

class DigestProbe(_message.Message):
    __slots__ = ("communicator", "counts", "prints", "rank")
    COMMUNICATOR_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PRINTS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    communicator: str
    counts: _containers.RepeatedScalarFieldContainer[int]
    prints: bool
    rank: int
    def __init__(self, communicator: _Optional[str] = ..., counts: _Optional[_Iterable[int]] = ..., prints: bool = ..., rank: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "incarnation", "hostname", "wait_s", "generation", "recovery", "relay_address", "wants_relay", "relay_rank", "wire", "first_contact", "fanin")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WANTS_RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAY_RANK_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    FIRST_CONTACT_FIELD_NUMBER: _ClassVar[int]
    FANIN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    incarnation: int
    hostname: str
    wait_s: float
    generation: int
    recovery: Recovery
    relay_address: str
    wants_relay: bool
    relay_rank: int
    wire: int
    first_contact: bool
    fanin: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., incarnation: _Optional[int] = ..., hostname: _Optional[str] = ..., wait_s: _Optional[float] = ..., generation: _Optional[int] = ..., recovery: _Optional[_Union[Recovery, str]] = ..., relay_address: _Optional[str] = ..., wants_relay: bool = ..., relay_rank: _Optional[int] = ..., wire: _Optional[int] = ..., first_contact: bool = ..., fanin: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("generation", "world_size", "members", "heartbeat_timeout_s", "member_ranks", "relay_address", "host_relay", "retry_after_s", "leader", "fanin", "wire")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMBER_RANKS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_RELAY_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    FANIN_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    world_size: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    heartbeat_timeout_s: float
    member_ranks: _containers.RepeatedScalarFieldContainer[int]
    relay_address: str
    host_relay: bool
    retry_after_s: float
    leader: int
    fanin: int
    wire: int
    def __init__(self, generation: _Optional[int] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., heartbeat_timeout_s: _Optional[float] = ..., member_ranks: _Optional[_Iterable[int]] = ..., relay_address: _Optional[str] = ..., host_relay: bool = ..., retry_after_s: _Optional[float] = ..., leader: _Optional[int] = ..., fanin: _Optional[int] = ..., wire: _Optional[int] = ...) -> None: ...

class SetRequest(_message.Message):
    __slots__ = ("caller", "key", "value", "total_bytes", "offset")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    value: bytes
    total_bytes: int
    offset: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class SetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("caller", "key", "wait_s", "offset", "version")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    wait_s: float
    offset: int
    version: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., wait_s: _Optional[float] = ..., offset: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("value", "total_bytes", "version")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    total_bytes: int
    version: int
    def __init__(self, value: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("caller", "name", "seq", "wait_s", "participants")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    name: str
    seq: int
    wait_s: float
    participants: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., name: _Optional[str] = ..., seq: _Optional[int] = ..., wait_s: _Optional[float] = ..., participants: _Optional[_Iterable[int]] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("caller", "wait_s", "progress")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    wait_s: float
    progress: _containers.RepeatedCompositeFieldContainer[Progress]
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., wait_s: _Optional[float] = ..., progress: _Optional[_Iterable[_Union[Progress, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("failures", "generation", "digest_probes")
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_PROBES_FIELD_NUMBER: _ClassVar[int]
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    generation: int
    digest_probes: _containers.RepeatedCompositeFieldContainer[DigestProbe]
    def __init__(self, failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ..., generation: _Optional[int] = ..., digest_probes: _Optional[_Iterable[_Union[DigestProbe, _Mapping]]] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("caller", "reason")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    reason: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BarrierStatus(_message.Message):
    __slots__ = ("name", "seq", "arrived_ranks", "missing_ranks", "waiting_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_RANKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    seq: int
    arrived_ranks: _containers.RepeatedScalarFieldContainer[int]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    waiting_s: float
    def __init__(self, name: _Optional[str] = ..., seq: _Optional[int] = ..., arrived_ranks: _Optional[_Iterable[int]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., waiting_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("job_id", "world_size", "generation", "members", "missing_ranks", "barriers", "failures", "uptime_s", "serving", "progress", "late", "stragglers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    BARRIERS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    world_size: int
    generation: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    barriers: _containers.RepeatedCompositeFieldContainer[BarrierStatus]
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    uptime_s: float
    serving: bool
    progress: _containers.RepeatedCompositeFieldContainer[Progress]
    late: _containers.RepeatedScalarFieldContainer[str]
    stragglers: _containers.RepeatedCompositeFieldContainer[StragglerStatus]
    def __init__(self, job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., generation: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., barriers: _Optional[_Iterable[_Union[BarrierStatus, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., serving: bool = ..., progress: _Optional[_Iterable[_Union[Progress, _Mapping]]] = ..., late: _Optional[_Iterable[str]] = ..., stragglers: _Optional[_Iterable[_Union[StragglerStatus, _Mapping]]] = ...) -> None: ...

class StragglerStatus(_message.Message):
    __slots__ = ("rank", "lag_s", "communicator")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATOR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    lag_s: float
    communicator: str
    def __init__(self, rank: _Optional[int] = ..., lag_s: _Optional[float] = ..., communicator: _Optional[str] = ...) -> None: ...

class SessionOp(_message.Message):
    __slots__ = ("id", "join", "set", "get", "barrier", "leave", "heartbeat", "add", "compare_set", "delete_key", "keys", "aggregate")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    COMPARE_SET_FIELD_NUMBER: _ClassVar[int]
    DELETE_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    id: int
    join: JoinRequest
    set: SetRequest
    get: GetRequest
    barrier: BarrierRequest
    leave: LeaveRequest
    heartbeat: HeartbeatRequest
    add: AddRequest
    compare_set: CompareSetRequest
    delete_key: DeleteKeyRequest
    keys: KeysRequest
    aggregate: Aggregate
    def __init__(self, id: _Optional[int] = ..., join: _Optional[_Union[JoinRequest, _Mapping]] = ..., set: _Optional[_Union[SetRequest, _Mapping]] = ..., get: _Optional[_Union[GetRequest, _Mapping]] = ..., barrier: _Optional[_Union[BarrierRequest, _Mapping]] = ..., leave: _Optional[_Union[LeaveRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatRequest, _Mapping]] = ..., add: _Optional[_Union[AddRequest, _Mapping]] = ..., compare_set: _Optional[_Union[CompareSetRequest, _Mapping]] = ..., delete_key: _Optional[_Union[DeleteKeyRequest, _Mapping]] = ..., keys: _Optional[_Union[KeysRequest, _Mapping]] = ..., aggregate: _Optional[_Union[Aggregate, _Mapping]] = ...) -> None: ...

class Aggregate(_message.Message):
    __slots__ = ("ranks", "lost", "relay")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RelayedRank]
    lost: _containers.RepeatedCompositeFieldContainer[RelayedRank]
    relay: str
    def __init__(self, ranks: _Optional[_Iterable[_Union[RelayedRank, _Mapping]]] = ..., lost: _Optional[_Iterable[_Union[RelayedRank, _Mapping]]] = ..., relay: _Optional[str] = ...) -> None: ...

class RelayedRank(_message.Message):
    __slots__ = ("rank", "incarnation", "hostname", "generation", "age_s", "progress_same")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_SAME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    hostname: str
    generation: int
    age_s: float
    progress_same: bool
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., hostname: _Optional[str] = ..., generation: _Optional[int] = ..., age_s: _Optional[float] = ..., progress_same: bool = ...) -> None: ...

class AggregateAnswer(_message.Message):
    __slots__ = ("progress_resend",)
    PROGRESS_RESEND_FIELD_NUMBER: _ClassVar[int]
    progress_resend: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, progress_resend: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[SessionOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[SessionOp, _Mapping]]] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class SessionResult(_message.Message):
    __slots__ = ("id", "code", "details", "metadata", "join", "set", "get", "barrier", "leave", "heartbeat", "add", "compare_set", "delete_key", "keys", "aggregate")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    COMPARE_SET_FIELD_NUMBER: _ClassVar[int]
    DELETE_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    details: str
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    join: JoinResponse
    set: SetResponse
    get: GetResponse
    barrier: BarrierResponse
    leave: LeaveResponse
    heartbeat: HeartbeatResponse
    add: AddResponse
    compare_set: CompareSetResponse
    delete_key: DeleteKeyResponse
    keys: KeysResponse
    aggregate: AggregateAnswer
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ..., join: _Optional[_Union[JoinResponse, _Mapping]] = ..., set: _Optional[_Union[SetResponse, _Mapping]] = ..., get: _Optional[_Union[GetResponse, _Mapping]] = ..., barrier: _Optional[_Union[BarrierResponse, _Mapping]] = ..., leave: _Optional[_Union[LeaveResponse, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatResponse, _Mapping]] = ..., add: _Optional[_Union[AddResponse, _Mapping]] = ..., compare_set: _Optional[_Union[CompareSetResponse, _Mapping]] = ..., delete_key: _Optional[_Union[DeleteKeyResponse, _Mapping]] = ..., keys: _Optional[_Union[KeysResponse, _Mapping]] = ..., aggregate: _Optional[_Union[AggregateAnswer, _Mapping]] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SessionResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SessionResult, _Mapping]]] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("caller", "key", "amount", "request_id")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    amount: int
    request_id: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., amount: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class AddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class CompareSetRequest(_message.Message):
    __slots__ = ("caller", "key", "expected", "desired", "request_id")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    expected: bytes
    desired: bytes
    request_id: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ..., request_id: _Optional[int] = ...) -> None: ...

class CompareSetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class DeleteKeyRequest(_message.Message):
    __slots__ = ("caller", "key", "request_id")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    request_id: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class DeleteKeyResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: bool = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("caller", "keys", "wait_s")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    keys: _containers.RepeatedScalarFieldContainer[str]
    wait_s: float
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., keys: _Optional[_Iterable[str]] = ..., wait_s: _Optional[float] = ...) -> None: ...

class KeysResponse(_message.Message):
    __slots__ = ("present", "count")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    count: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., count: _Optional[int] = ...) -> None: ...
