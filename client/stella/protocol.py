"""The wire protocol: every message declared once, as a frozen typed class, and
validated completely at the boundary.

A message is a ZeroMQ multipart message. Frame 0 is the header, a MessagePack map
whose ``type`` field names the message class; array payloads follow as raw
little-endian frames, each named by number in the header (a :class:`TensorEntry`
says which frame holds a tensor's indices and which its values). Arrays never
travel inside MessagePack and are never pickled.

:func:`decode_request` and :func:`decode_reply` check everything that can be
checked without the model: exact field types (``proto: 1.0`` or ``true`` is not the
int 1), required fields, unknown fields, ranges and string lengths, that the frame
references of a message cover its payload frames exactly once and in order, and
the size of every value frame. :func:`stella.payload.decode_tensors` then checks
the entries against the model's layout, decodes the indices (strictly increasing,
in range) and checks that values are finite: what it returns,
:class:`~stella.payload.SparseTensor`, is what the kernel may trust without
checking again.

This is the single place that declares message types; the server imports it
(never the other way round). Adding a message type means: a class here, added to
:data:`Request` or :data:`Reply`, one handler in the server's service, one
:class:`~stella.client.Client` method. ``docs/protocol.md``'s message tables are
generated from this module (``python -m stella.protocol_docs``), and a
test fails when they differ.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import msgspec

from . import codec
from .errors import CodecError, OversizedMessage, ProtocolError
from .layout import MAX_NUMEL  # int32 indices

__all__ = [
    # constants and types
    "PROTOCOL_VERSION", "key_fingerprint", "IndexCoding", "PullCoding", "TrainingMode", "PullMode", "ValueDtype",
    "ModelDtype", "MAX_HEADER_BYTES", "MAX_TENSORS", "MAX_NAME_BYTES", "MAX_FRAMES", "MAX_PARTS", "MAX_NUMEL",
    "MODEL_DTYPES", "MAX_SHARDS", "MAX_ADDRESS_BYTES", "MAX_CHUNK_BYTES", "MAX_TRANSFER_BYTES", "MAX_CHUNK_FRAMES",
    # the parts of messages
    "TensorSpec", "TensorEntry", "BroadcastInfo", "WorkerReport", "WorkerStatus",
    # requests
    "Join", "Leave", "Register", "Push", "Pull", "Status", "SetOptimizer", "Heartbeat", "Fetch", "Upload",
    # replies
    "Joined", "Left", "Registered", "PushOk", "Delta", "StatusReply", "OptimizerSet", "HeartbeatOk", "Error",
    "Chunked", "Chunk", "Uploaded",
    # framing and the payloads' coding
    "Request", "Reply", "Received", "encode", "encode_header", "decode_request", "decode_reply", "tag_of",
    "check_payload",
]

PROTOCOL_VERSION = 16
MAX_HEADER_BYTES = 1 << 20  # headers are small maps; anything bigger is refused
MAX_TENSORS = 65536  # tensors in a model, entries in a push or delta
MAX_NAME_BYTES = 1024  # tensor and worker names
MAX_FRAMES = 2 * MAX_TENSORS + 1  # header + an index and a value frame per entry
MAX_PARTS = 2  # the server's tensors: the parts of its range of the flat model (TensorEntry)
MAX_SHAPE_DIMS = 8
MAX_SHARDS = 1024  # shards of one job, in a ``shards`` list
MAX_ADDRESS_BYTES = 256  # one shard's address
MAX_CHUNK_BYTES = 64 << 20  # one piece of a transfer (a ``fetch``'s answer, an ``upload``)
MAX_TRANSFER_BYTES = 1 << 42  # a transfer's bytes: a model's values (stella-ps --max-model-bytes bounds it further)
MAX_CHUNK_FRAMES = 8  # the frames one piece may come in (it may span frames of the message it is part of)

MODEL_DTYPES = ("float32", "float16", "bfloat16")


def key_fingerprint(z85_key: str) -> str:
    """What logs, ``status`` and errors show of a CurveZMQ public key (Z85), never the key
    itself: 16 hex digits of its SHA-256. The server and the client compute it here alike."""
    return hashlib.sha256(z85_key.encode()).hexdigest()[:16]

Int32 = Annotated[int, msgspec.Meta(ge=0, le=MAX_NUMEL)]
Version = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
ReqId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Session = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
WorkerId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
TransferId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
ByteOffset = Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_BYTES)]
FrameNo = Annotated[int, msgspec.Meta(ge=0, lt=MAX_FRAMES)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_BYTES)]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_BYTES)]
ModelDtype = Literal["float32", "float16", "bfloat16"]
IndexCoding = Literal["raw32", "varint", "u16chunk", "rice", "block16"]
TrainingMode = Literal["gradient", "update"]
PullMode = Literal["broadcast", "exact"]  # what pulls answer: the compressed broadcast or exact values
PullCoding = Literal["raw32", "varint", "u16chunk", "rice"]  # block16 codes only whole blocks
EntryCoding = Literal["raw32", "varint", "u16chunk", "rice", "block16", "dense"]
ValueDtype = codec.ValueDtype  # q4/q2: quantised (codec.QUANT_DTYPES)
# Optimizer hyper-parameters travel as a map of scalars (and ``betas`` pairs); their
# names and ranges are the server's to check (stella_ps.optim).
HParam = bool | int | float | str | list[float]
HParams = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], HParam], msgspec.Meta(max_length=32)]
# A sharded job's shard addresses, in shard order (``stella-ps --shards``, ``--shard-list``): ZeroMQ
# endpoints; the host ``*`` stands for the host the client reached this server at (stella.shards.connect)
ShardList = Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADDRESS_BYTES)]],
                      msgspec.Meta(max_length=MAX_SHARDS)]


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered tensor: its name, shape and dtype (the model's layout)."""

    name: TensorName
    shape: Annotated[tuple[Int32, ...], msgspec.Meta(max_length=MAX_SHAPE_DIMS)]
    dtype: ModelDtype

    def __post_init__(self) -> None:
        if self.numel > MAX_NUMEL:
            raise ValueError(f"tensor {self.name!r}: {self.numel} elements > {MAX_NUMEL} (int32 indices)")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One of the server's tensors in a ``push`` or ``delta``: on the wire the array
    ``[tensor, count, coding, value_dtype, index_frame, value_frame]``. The server holds
    its range of the flat model (:mod:`stella.layout`) as at most two tensors, its
    *parts*: 0, the coordinates of the large tensors (a push selects among them), and 1,
    the dense suffix of small ones (a push sends it whole); so a push is at most one
    index frame and two value frames, whatever the model's number of tensors.

    ``coding`` "dense" means no index frame (``index_frame`` is nil) and ``count``
    equal to the tensor's size; frame numbers count the payload frames from 0.
    ``value_dtype`` "q4"/"q2" (quantised, see ``docs/compression.md``) is refused in
    a ``delta``.
    """

    tensor: Int32  # the part of the server's range (its tensor): 0 or 1
    count: Int32  # values (and indices) this entry carries
    coding: EntryCoding
    value_dtype: ValueDtype
    index_frame: FrameNo | None
    value_frame: FrameNo


Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


class BroadcastInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The server's broadcast, as a worker or a planner must know it (``stella-ps
    --broadcast-values``, ``--broadcast-factor``): the coding of its values and the
    coordinates a message carries as a multiple of the mean count of the step's pushes,
    each pushed coordinate counted by its bits against f16's (:func:`stella.codec.broadcast_share`;
    the dense suffix goes whole). Sent in :class:`Registered` and :class:`StatusReply`,
    so that no client copies the server's settings."""

    values: ValueDtype
    factor: Annotated[float, msgspec.Meta(gt=0.0, le=1e6)]


class WorkerReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a worker measured over its latest iteration, carried by its push (optional)
    so that the server's status and metrics show the whole job: seconds of computation
    (the training loop between two ``step()`` calls), of exchange (compress, push, the
    server's step, pull; in the background) and of waiting for that exchange inside
    ``step()``, the density of the push, and the bytes sent and received so far."""

    step: Count  # the worker's iterations so far
    compute_s: Seconds
    exchange_s: Seconds
    wait_s: Seconds
    density: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    bytes_pushed: Count = 0
    bytes_pulled: Count = 0
    # what the worker's controller chose for this push (stella.adapt) and the rates it measured
    value_dtype: ValueDtype | None = None
    local_steps: Count = 0  # update mode: the local steps (H) this round made
    accumulate: Count = 0  # micro-batches per step (gradient accumulation)
    up_bps: Annotated[float, msgspec.Meta(ge=0.0, le=1e13)] = 0.0  # measured uplink, bytes/s (0: not yet)
    down_bps: Annotated[float, msgspec.Meta(ge=0.0, le=1e13)] = 0.0
    # the densest push worth the worker's own work a round (the controller's cap; 0: not said)
    max_density: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0


class WorkerStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One live worker as ``status`` reports it: who it is, when the server last heard
    from it, what it sent, and its latest :class:`WorkerReport` (None before its first)."""

    worker: WorkerId
    name: Name
    key_fingerprint: str  # "insecure" without keys
    last_seen_s: Seconds  # seconds since its last request
    pushes: Count
    pulls: Count
    report: WorkerReport | None = None
    key_name: Name = ""  # the allowlist's name for its key (the text after the key on its line)


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    proto: int = PROTOCOL_VERSION
    req: ReqId = 0


# ----------------------------------------------------------------------- requests
class Join(_Message, tag="join", frozen=True):
    """Join the job; the server assigns a worker id, or confirms the one asked for.
    ``session`` (the token of an earlier ``joined`` reply) moves a worker id that is
    still live on another connection to this one: a client reconnecting after a
    network failure keeps its id and its queued pushes."""

    worker: WorkerId | None = None
    name: Name = ""
    session: Session | None = None
    # on a reconnect: the newest model version this client saw (the server warns when it is
    # behind it: it restarted without the job's newest state)
    version: Version | None = None


class Leave(_Message, tag="leave", frozen=True):
    """Leave cleanly; pushes already sent still count."""

    worker: WorkerId


class Register(_Message, tag="register", frozen=True):
    """Declare the model layout: its tensors in registration order, the dense cut that
    lays them out flat (:class:`stella.layout.FlatLayout`, the server's ``dense_below``
    from ``joined``) and the range ``[start, stop)`` of the flat model this server holds
    (the whole model unless the job is sharded). With ``values``, one float32 frame per
    part of the range follows (its large tensors' coordinates, then its dense suffix:
    see :class:`TensorEntry`), needed only to initialise the store."""

    worker: WorkerId
    tensors: Annotated[list[TensorSpec], msgspec.Meta(min_length=1, max_length=MAX_TENSORS)]
    optimizer: HParams
    values: bool
    # what the workers push: "gradient" or "update" (docs/optimizer.md); None: not said. A job
    # takes the mode of its first registration that says one and refuses the other.
    mode: TrainingMode | None = None
    # a probe (no values) that finds another worker uploading the model may be held this
    # long for that upload to end, and then joins it; 0: answered at once
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=24 * 3600 * 1000)] = 0
    # :func:`model_digest` of the values this worker holds (sent or not): one that equals the
    # digest of the values the model was created with learns it (``Registered.base``), and
    # need not pull a snapshot of what it has
    digest: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)] | None = None
    dense_below: Annotated[int, msgspec.Meta(ge=0, le=MAX_NUMEL)] = 0
    start: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    stop: Annotated[int, msgspec.Meta(ge=1, le=2**62)] | None = None  # None: the end of the model
    # the version of the job's model these values are (a worker resuming from its checkpoint): the
    # registration that creates the model starts the version count there, as a server resuming from
    # its own checkpoint does; ignored once the model exists
    version: Annotated[int, msgspec.Meta(ge=0, le=2**53)] = 0
    # with ``values``: the values are those of this worker's finished ``upload`` of that id (sent in
    # pieces before, over a slow link), and no value frame follows
    upload: TransferId | None = None


class Push(_Message, tag="push", frozen=True):
    """One step's update, computed on model ``version``; ``hparams`` (optional) change
    optimizer hyper-parameters from the step this push joins on."""

    worker: WorkerId
    version: Version
    tensors: Annotated[list[TensorEntry], msgspec.Meta(max_length=MAX_TENSORS)]
    hparams: HParams | None = None
    report: WorkerReport | None = None  # the worker's timings, for status and metrics
    # the samples (or micro-batches) this update represents: the server weights each push
    # of a step by them (docs/optimizer.md, "Weighting by samples"); nil: one unit
    samples: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] | None = None
    # the worker's last push (close()): its whole error-feedback residual, larger than a round's top-k. Once
    # per registration the server's clip relative to the job's pushes allows it more (docs/security.md)
    final: bool = False
    # the payload frames are this worker's finished ``upload`` of that id (a push larger than a
    # few MiB over a slow link: close()'s residual), and none follows
    upload: TransferId | None = None
    # the pull of the same round, riding on this push (one message a round, not two): the server
    # handles it once the push is queued and answers it as it would the pull sent alone (its own
    # ``req``); a push it refuses takes the pull with it, unhandled
    pull: Pull | None = None


class Pull(_Message, tag="pull", frozen=True):
    """What changed since ``since`` (-1: a full snapshot); with ``wait_for``, answered
    once the version reaches it or ``timeout_ms`` passes."""

    worker: WorkerId
    since: Annotated[int, msgspec.Meta(ge=-1, le=2**62)]
    wait_for: Version | None = None
    timeout_ms: Annotated[int, msgspec.Meta(ge=0, le=24 * 3600 * 1000)] = 60_000
    coding: PullCoding = "raw32"
    # an answer of more payload bytes than this (a snapshot over a slow link) comes as a ``chunked``
    # reply: a transfer this worker then fetches in pieces, which a reconnect resumes; 0: whole
    chunk_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_BYTES)] = 0


class Status(_Message, tag="status", frozen=True):
    """The server's counters; needs no join."""


class SetOptimizer(_Message, tag="set_optimizer", frozen=True):
    """Change optimizer hyper-parameters from the next step that closes on."""

    worker: WorkerId
    hparams: HParams


class Heartbeat(_Message, tag="heartbeat", frozen=True):
    """"This worker is alive", from any connection of the client that holds the
    ``session`` token of the worker's ``joined`` reply (the client sends it every
    ``heartbeat_s`` from a socket of its own, so a busy training loop never misses
    one). The reply is the server's heartbeat."""

    worker: WorkerId
    session: Session


class Fetch(_Message, tag="fetch", frozen=True):
    """Bytes ``[offset, offset + length)`` of this worker's transfer ``transfer`` (a
    ``chunked`` reply's): the answer is a ``chunk``. A transfer outlives a reconnect that
    keeps the worker's id (a session), so a piece lost with the link is fetched again,
    not the whole; one the server no longer holds is refused with code ``transfer``."""

    worker: WorkerId
    transfer: TransferId
    offset: ByteOffset
    length: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_BYTES)]


class Upload(_Message, tag="upload", frozen=True):
    """A piece of a large message's payload, sent ahead of the message that names the
    upload: the model's values the server asked this worker for (``registered`` with
    ``needs_values``; then ``register``), or a registered worker's push (then ``push``).
    Bytes ``[offset, offset + n)`` of the payload frames laid end to end (``sizes`` their
    bytes), in 1 to ``MAX_CHUNK_FRAMES`` payload frames. The reply says how many bytes the
    server holds: a piece that does not start there changes nothing, and an upload cut by
    a reconnect goes on from there."""

    worker: WorkerId
    transfer: TransferId
    offset: ByteOffset
    sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_BYTES)]],
                     msgspec.Meta(min_length=1, max_length=MAX_CHUNK_FRAMES)]


# ------------------------------------------------------------------------ replies
class Joined(_Message, tag="joined", frozen=True):
    worker: WorkerId
    version: Version
    workers: int  # live workers
    initialised: bool
    session: Session = 0  # token for heartbeats and for taking the id back on reconnect
    heartbeat_s: float = 0.0  # send a heartbeat this often; 0: the server checks no liveness
    # the server's liveness timeout: a client that hears no heartbeat reply for this long reconnects
    liveness_s: float = 0.0
    shard: str = ""  # "I/N": the server is shard I of N of a sharded job (stella.shards); "": not sharded
    # the server's dense cut (stella-ps --dense-below): how a registration lays the model out flat
    dense_below: Annotated[int, msgspec.Meta(ge=0, le=MAX_NUMEL)] = 0
    # every shard of the job, in shard order, this one included (empty: not said): a client given
    # one address reaches them all (stella.shards.connect)
    shards: ShardList = []


class Left(_Message, tag="left", frozen=True):
    worker: WorkerId
    version: Version


class Registered(_Message, tag="registered", frozen=True):
    """``needs_values``: the model is not initialised yet; register again with values
    (nothing was registered). Otherwise the worker takes part from the next step."""

    version: Version
    created: bool
    needs_values: bool
    optimizer: dict[str, Any] | None
    numel: int
    mode: TrainingMode | None = None  # the job's training mode, once a registration said one
    pull: PullMode | None = None  # what the server's pulls answer: "broadcast" (per step) or "exact"
    broadcast: BroadcastInfo | None = None  # the broadcast's settings (None: exact pulls)
    # the version whose model equals the registered values (this registration created the
    # model, or its digest equals that of the values it was created with): a pull since
    # ``base`` brings the worker up to date (nothing to pull if it is ``version``); None: pull a snapshot
    base: Version | None = None


# a range ``[start, stop)`` of the flat model whose pushed values the server scaled down, and
# the factor it kept (in [0, 1)): the push-norm bound (docs/security.md)
Clip = tuple[Count, Count, Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]]


class PushOk(_Message, tag="push_ok", frozen=True):
    step: Version  # the step this push joined (counting this worker's queued pushes)
    version: Version  # the server's version now
    # where the push-norm bound scaled this push down (one entry a server; a sharded client's
    # reply lists its shards'): what was scaled off never reached the model, and is the
    # worker's to send again (its error-feedback residual takes it back)
    clipped: Annotated[list[Clip], msgspec.Meta(max_length=MAX_TENSORS)] = []


class Delta(_Message, tag="delta", frozen=True):
    """What changed after ``since``, in one of two forms:

    - ``add`` false: per tensor, the changed coordinates with their current float32
      values (exact pulls), or, with ``full``, every tensor dense (a snapshot);
    - ``add`` true: the server's compressed broadcast: the messages of the steps after
      ``since``, in order, to be *added* to the replica one after another (values in
      the broadcast's coding, q4/q2 included); ``parts[i]`` entries make step ``i``'s
      message (their sum is the entry count; a tensor appears at most once per part).
    """

    version: Version
    full: bool
    tensors: Annotated[list[TensorEntry], msgspec.Meta(max_length=MAX_TENSORS)]
    add: bool = False
    parts: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TENSORS)]],
                     msgspec.Meta(max_length=MAX_TENSORS)] = []
    # milliseconds the server held the pull (waiting for the step, encoding) before it
    # sent this reply: the rest of the time the worker saw is the link's
    held_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0
    # milliseconds the server's latest step took to apply (its share of a round that grows with the pushes)
    step_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0
    # the pushes the server's latest step combined (0: no step yet): the workers whose steps its mean
    # averages (stella.BatchNoise's world)
    pushes: Count = 0


class StatusReply(_Message, tag="status", frozen=True):
    version: Version
    initialised: bool
    workers: list[int]  # live worker ids
    worker_keys: dict[int, str]  # live worker id -> fingerprint of its key ("insecure" without keys)
    insecure: bool  # the server runs without encryption and authentication
    expected_workers: int
    pending_pushes: int
    steps: int
    pushes: int
    pulls: int
    late_pushes: int
    bytes_in: int
    bytes_out: int
    messages: int
    errors: int
    uptime_s: float
    numel: int
    tensors: int
    optimizer: dict[str, Any] | None
    server_version: str = ""  # the stella-ps release
    live: list[WorkerStatus] | None = None  # per live worker, in id order
    checkpoint_age_s: float | None = None  # seconds since the last checkpoint; None: none written
    # liveness (README "Operations"): seconds since each live worker was last heard from,
    # and the workers declared gone (no heartbeat for liveness_timeout_s), with their age
    last_seen_s: dict[int, float] = {}
    gone_workers: dict[int, float] = {}  # gone worker id -> seconds since it was last heard from
    liveness_timeout_s: float = 0.0  # 0: liveness is not checked
    step_deadline_s: float | None = None  # the deadline a step waits for missing workers now; None: no deadline
    checkpoint_version: int | None = None  # version of the newest checkpoint written or resumed from
    behind_workers: list[int] = []  # silent, and a deadline closed a step without them: not waited for until they push
    mode: TrainingMode | None = None  # the job's training mode, once a registration said one
    shard: str = ""  # "I/N" of a sharded job's shard; "": not sharded
    pull: PullMode | None = None  # what the server's pulls answer
    broadcast: BroadcastInfo | None = None  # the broadcast's settings (None: exact pulls)
    dense_below: Annotated[int, msgspec.Meta(ge=0, le=MAX_NUMEL)] = 0  # the server's dense cut (stella.layout)
    shards: ShardList = []  # the job's shards in order, as ``joined`` says them (``stella status`` of one address)
    # a checkpoint write that failed (README "Operations"): why the latest failed, e.g. "ENOSPC: No space left on
    # device" (None: the latest succeeded, or none failed), and the failures since the server started
    checkpoint_error: str | None = None
    checkpoint_failures: int = 0


class HeartbeatOk(_Message, tag="heartbeat_ok", frozen=True):
    version: Version


class OptimizerSet(_Message, tag="optimizer_set", frozen=True):
    optimizer: dict[str, Any]
    version: Version


class Chunked(_Message, tag="chunked", frozen=True):
    """The answer to this request is large: its frames (the answer's header first, then
    its payload frames; ``sizes`` their bytes) laid end to end are transfer ``transfer``,
    to be fetched in pieces (``fetch``); the reassembled frames are the answer."""

    transfer: TransferId
    sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TRANSFER_BYTES)]],
                     msgspec.Meta(min_length=1, max_length=MAX_FRAMES)]


class Chunk(_Message, tag="chunk", frozen=True):
    """A piece of a transfer from ``offset``: its payload frames (1 to
    ``MAX_CHUNK_FRAMES``) laid end to end."""

    transfer: TransferId
    offset: ByteOffset


class Uploaded(_Message, tag="uploaded", frozen=True):
    """The bytes of upload ``transfer`` the server holds (the next piece starts there)."""

    transfer: TransferId
    have: ByteOffset


class Error(_Message, tag="error", frozen=True):
    """The request was refused and changed nothing; ``code`` says why."""

    code: str
    message: str


Request = Join | Leave | Register | Push | Pull | Status | SetOptimizer | Heartbeat | Fetch | Upload
Reply = (Joined | Left | Registered | PushOk | Delta | StatusReply | OptimizerSet | HeartbeatOk | Error | Chunked
         | Chunk | Uploaded)
REQUEST_TYPES: tuple[type, ...] = Request.__args__
REPLY_TYPES: tuple[type, ...] = Reply.__args__



def _on_the_wire(cls: type[_Message]) -> type[_Message]:
    """The decoders' twin of a message class: the same message with ``proto`` and ``req``
    required (a header without them is refused; in code both have defaults, so that a
    message can be built before its request id is known). A subclass, so handlers
    matching ``case Push():`` match it."""
    tag = cls.__struct_config__.tag
    ns = {"__annotations__": {"proto": int, "req": ReqId}, "__doc__": cls.__doc__, "__module__": __name__}
    return type(cls.__name__, (cls,), ns, tag=tag, frozen=True, kw_only=True)


_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[tuple(_on_the_wire(t) for t in REQUEST_TYPES)])  # noqa: UP007
_reply_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[tuple(_on_the_wire(t) for t in REPLY_TYPES)])  # noqa: UP007


class _Envelope(msgspec.Struct):
    """Only for explaining a header that failed to decode: its version and type."""

    proto: Any = None
    type: Any = None
    req: Any = None


class _RequestId(msgspec.Struct):
    """Only the ``req`` of a header whose other fields cannot be read (skipped unread)."""

    req: Any = None


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_request_id_decoder = msgspec.msgpack.Decoder(_RequestId)


def _req_of(header: bytes | memoryview) -> int:
    try:
        req = _request_id_decoder.decode(header).req
    except Exception:  # anything a hostile header makes msgspec raise
        return -1
    return req if type(req) is int and 0 <= req < 2**63 else -1


# ------------------------------------------------------------------ encode/decode
def encode(msg: _Message, frames: Sequence[Any] = ()) -> list[Any]:
    """The multipart message for ``msg`` followed by its payload frames."""
    return [_encoder.encode(msg), *frames]


def encode_header(msg: _Message) -> bytes:
    """The header frame of ``msg`` alone (its payload frames go after it as they are)."""
    return _encoder.encode(msg)


@dataclass(slots=True, eq=False)
class Received:
    """A decoded message and its payload frames, cross-checked by the decoder (not
    changed after: a plain slotted class, which costs a third of a frozen one to make,
    once a message)."""

    msg: Any  # one of Request or Reply
    frames: tuple[memoryview, ...]

    def entries(self) -> Iterator[tuple[TensorEntry, memoryview | None, memoryview]]:
        """``(entry, index frame or None, value frame)`` for each tensor of a push or delta."""
        for e in self.msg.tensors:
            yield e, None if e.index_frame is None else self.frames[e.index_frame], self.frames[e.value_frame]


def request_id(header: bytes | memoryview) -> int:
    """The ``req`` of a header that may be malformed (-1 when it has none or cannot be
    read), so that an error reply can still name the request it refuses. Never raises."""
    return _req_of(header)


def _decode(frames: Sequence[Any], decoder: msgspec.msgpack.Decoder[Any], kind: str) -> Received:
    if not frames:
        raise ProtocolError("empty message: no header frame")
    if len(frames) > MAX_FRAMES:
        raise OversizedMessage(f"{len(frames)} frames > limit {MAX_FRAMES}")
    views = tuple(frames)
    for f in views:  # the server's frames are views already
        if type(f) is not memoryview:
            views = tuple(f if type(f) is memoryview else memoryview(f) for f in frames)
            break
    header = views[0]
    if header.nbytes > MAX_HEADER_BYTES:
        err = OversizedMessage(f"oversized header: {header.nbytes} bytes > {MAX_HEADER_BYTES}")
        err.req = request_id(header)  # not decoded otherwise: only its envelope, for the refusal
        raise err
    try:
        msg = decoder.decode(header)
    except Exception as e:  # msgspec's errors, RecursionError (nesting), UnicodeDecodeError...
        raise _explain(header, e, kind) from None
    try:
        if msg.proto != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {msg.proto!r} not supported (this side speaks {PROTOCOL_VERSION})")
        payload = views[1:]
        _check_frames(msg, payload)
    except ProtocolError as e:
        e.req = msg.req
        raise
    return Received(msg, payload)


def _explain(header: memoryview, err: Exception, kind: str) -> ProtocolError:
    """A protocol error that names the problem, the version first: a peer speaking
    another version should hear that, not which field it lacks. Carries the header's
    ``req`` where the envelope can be read (the refusal names the request), else -1."""
    try:
        env = _envelope_decoder.decode(header)
    except msgspec.ValidationError:  # a subclass of DecodeError: valid MessagePack, not a map
        return ProtocolError("header must be a map")
    except Exception:  # corrupt, too deeply nested, invalid UTF-8: nothing more to read
        out = ProtocolError(f"malformed MessagePack header: {_reason(err)}")
        out.req = _req_of(header)  # where the rest can be skipped, the request is still named
        return out
    out = _explained(env, err, kind)
    out.req = env.req if type(env.req) is int and 0 <= env.req < 2**63 else -1
    return out


def _reason(err: Exception) -> str:
    if isinstance(err, RecursionError):
        return "nested too deeply"
    if isinstance(err, UnicodeDecodeError):
        return "a string is not valid UTF-8"
    return str(err)


def _explained(env: _Envelope, err: Exception, kind: str) -> ProtocolError:
    if env.proto != PROTOCOL_VERSION or type(env.proto) is not int:
        return ProtocolError(f"protocol version {env.proto!r} not supported (this side speaks {PROTOCOL_VERSION})")
    known = sorted(tag_of(t) for t in (REQUEST_TYPES if kind == "request" else REPLY_TYPES))
    if not isinstance(env.type, str) or env.type not in known:
        return ProtocolError(f"unknown {kind} type {env.type!r}; known: {known}")
    return ProtocolError(f"{env.type}: {_entry_field_names(_reason(err))}")


_ENTRY_FIELDS = TensorEntry.__struct_fields__


def _entry_field_names(text: str) -> str:
    """``$.tensors[3][1]`` -> ``$.tensors[3].count``: entries travel as arrays, but a
    reader of the error wants the field's name."""
    return re.sub(r"(\$\.tensors\[\d+\])\[(\d)\]",
                  lambda m: f"{m.group(1)}.{_ENTRY_FIELDS[int(m.group(2))]}", text)


def tag_of(msg: Any) -> str:
    """A message's ``type`` on the wire."""
    return str(msg.__struct_config__.tag)


def _check_frames(msg: Any, payload: tuple[memoryview, ...]) -> None:
    if isinstance(msg, Push) and msg.pull is not None:
        pull = msg.pull
        if pull.proto != PROTOCOL_VERSION or type(pull.proto) is not int:
            raise ProtocolError(f"push: its pull's protocol version {pull.proto!r} is not the push's")
        if pull.worker != msg.worker:
            raise ProtocolError(f"push: its pull is worker {pull.worker}'s, the push worker {msg.worker}'s")
        if pull.req == msg.req:
            raise ProtocolError("push: its pull needs a request id of its own")
    if isinstance(msg, Push) and msg.upload is not None:  # checked with the upload's frames (check_payload)
        if payload:
            raise ProtocolError("push: the payload is the upload's; no payload frame may follow")
        return
    check_payload(msg, payload)


def check_payload(msg: Any, payload: tuple[memoryview, ...]) -> None:
    """Check ``msg``'s payload frames against its header (what the decoders do; the server
    calls it on a push whose frames came ahead in an ``upload``)."""
    if isinstance(msg, Push):
        _check_run(msg, msg.tensors, payload, 0, len(payload), False)
    elif isinstance(msg, Delta):
        _check_delta(msg, payload)
    elif isinstance(msg, (Chunk, Upload)):
        if not 1 <= len(payload) <= MAX_CHUNK_FRAMES:
            raise ProtocolError(f"{tag_of(msg)}: expected 1 to {MAX_CHUNK_FRAMES} payload frames, got {len(payload)}")
        n = sum(f.nbytes for f in payload)
        if not 1 <= n <= MAX_CHUNK_BYTES:
            raise OversizedMessage(f"{tag_of(msg)}: a piece of {n} bytes (1 to {MAX_CHUNK_BYTES})")
    elif isinstance(msg, Register) and msg.values and msg.upload is not None:
        if payload:
            raise ProtocolError("register: the values are the upload's; no value frame may follow")
    elif isinstance(msg, Register) and msg.values:  # their sizes are the parts', which the server knows
        if not 1 <= len(payload) <= MAX_PARTS:
            raise ProtocolError(f"register: expected 1 or {MAX_PARTS} value frames (the parts of the range), "
                                f"got {len(payload)}")
    elif payload:
        raise ProtocolError(f"{tag_of(msg)}: expected no payload frames, got {len(payload)}")


def _check_delta(msg: Delta, payload: tuple[memoryview, ...]) -> None:
    if (msg.parts and not msg.add) or (msg.add and msg.full):
        raise ProtocolError("delta: parts are for added messages, and a snapshot is not added")
    if not msg.add:  # one run of entries, exact values
        _check_run(msg, msg.tensors, payload, 0, len(payload), True)
        return
    # added messages: one part per step (none when no step was made), each a run of its own
    total = sum(msg.parts)
    if total != len(msg.tensors):
        raise ProtocolError(f"delta: parts add up to {total} entries, the delta has {len(msg.tensors)}")
    start = expect = 0
    for n in msg.parts:
        expect = _check_run(msg, msg.tensors[start:start + n], payload, expect, len(payload), False, last=False)
        start += n
    if expect != len(payload):
        raise ProtocolError(f"delta: {len(payload)} payload frames, the entries describe {expect}")


def _check_run(msg: Push | Delta, entries: Sequence[TensorEntry], payload: tuple[memoryview, ...], expect: int,
               nframes: int, exact: bool, last: bool = True) -> int:
    """Check one run of entries (a tensor at most once), whose frames start at ``expect``:
    frames are referenced in order, each exactly once, index before values, and every
    value frame has its size; ``exact``: values a replica installs, f32 only. Returns
    the frame after the run's; with ``last``, that must be the end of the payload."""
    seen: set[int] = set()
    for e in entries:
        t = e.tensor
        if t in seen:
            raise ProtocolError(f"{tag_of(msg)}: tensor {t} appears twice")
        seen.add(t)
        fi, fv = e.index_frame, e.value_frame
        if fi is None:
            if e.coding != "dense":
                raise ProtocolError(f"{tag_of(msg)}: tensor {t}: an index frame is required unless dense, "
                                    "and forbidden when dense")
        else:
            if e.coding == "dense":
                raise ProtocolError(f"{tag_of(msg)}: tensor {t}: an index frame is required unless dense, "
                                    "and forbidden when dense")
            if fi != expect:
                _frame_error(msg, t, fi, expect)
            expect += 1
        if fv != expect:
            _frame_error(msg, t, fv, expect)
        expect += 1
        if expect > nframes:
            raise ProtocolError(f"{tag_of(msg)}: tensor {t}: frame {expect - 1} missing ({nframes} payload frames)")
        if exact and e.value_dtype != "f32":
            # replicas that install values hold exact ones, or they would drift from the server's
            raise ProtocolError(f"delta: tensor {t}: value dtype {e.value_dtype!r}: values a replica installs are "
                                "exact (f32); coded values come only in an added (broadcast) delta")
        need = codec.value_frame_size(e.value_dtype, e.count)
        if payload[fv].nbytes != need:
            raise CodecError(f"{tag_of(msg)}: tensor {t} value frame ({e.value_dtype}): "
                             f"{payload[fv].nbytes} bytes for {e.count} values (need {need})")
    if last and expect != nframes:
        raise ProtocolError(f"{tag_of(msg)}: {nframes} payload frames, the entries describe {expect}")
    return expect


def _frame_error(msg: Push | Delta, tensor: int, ref: int, expect: int) -> None:
    raise ProtocolError(f"{tag_of(msg)}: tensor {tensor}: frame {ref} referenced where frame {expect} "
                        "comes next (frames go in entry order, index before values)")


def decode_request(frames: Sequence[Any]) -> Received:
    """Decode and validate a request (header frame first). Raises :class:`ProtocolError`
    (or its subclasses :class:`CodecError`, :class:`OversizedMessage`) naming the problem."""
    return _decode(frames, _request_decoder, "request")


def decode_reply(frames: Sequence[Any]) -> Received:
    """Decode and validate a reply, as :func:`decode_request` does a request."""
    return _decode(frames, _reply_decoder, "reply")
