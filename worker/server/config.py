"""The worker's settings, typed: defaults, then the YAML file the operator mounts (`--config`), then
flags. Every value is checked against its field's type here, so a bad ConfigMap stops the worker
at start-up with a message naming the key, never deep inside the engine. Imports nothing heavy.

The internal secret is the one value that never comes from flags or the ConfigMap (argv is
world-readable; a ConfigMap is not a Secret): it comes from $TANDEM_INTERNAL_SECRET or the file
named by `internal_secret_file` (a mounted Secret), see tandem.contracts.internal_auth.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.contracts import timing
from tandem.contracts.internal_auth import SECRET_ENV, load_secret
from tandem.contracts.model_support import ModelBackend
from tandem.contracts.names import KV_PORT, KVBackend, Role
from tandem.worker.engine.parallel.placement import Placement, place

if TYPE_CHECKING:
    from tandem.worker.engine.config import EngineConfig
    from tandem.worker.kv.base import KVTransferConfig


_ENUMS = (Role, KVBackend, ModelBackend)

# A colocated or decode worker prefills in small chunks so the streams it is decoding wait one
# chunk per step (about 60-150 ms on one CPU core), not a whole prompt; a prefill worker has no
# streams to protect and takes whole prompts up to max_batched_tokens (None).
ROLE_PREFILL_CHUNK: dict[Role, int | None] = {Role.COLOCATED: 256, Role.DECODE: 256, Role.PREFILL: None}
# A decode worker prefills only what the router could not send to prefill (a saturated or missing
# prefill pool): its streams come first, so such a step lasts at most two ordinary steps, the chunk
# sized from measured step times (engine/chunk_sizing.py). A colocated worker's trade of TTFT
# against gaps is its chunk size's; a prefill worker has no streams.
ROLE_PREFILL_STALL: dict[Role, float | None] = {Role.COLOCATED: None, Role.DECODE: 2.0, Role.PREFILL: None}
# While a tenant served less lately is about (engine/scheduler.py FLOW_ACTIVE_S), the tenants served
# more prefill at most this many prompt tokens per step, all together: the step in flight when its
# next prompt arrives is that short. None: no cap.
DEFAULT_FLOW_CHUNK: int | None = 32


@dataclass
class WorkerConfig:
    role: Role = Role.COLOCATED
    model: str = ""  # a Hugging Face folder, or a hub id with HF_HOME holding a cache
    host: str = "0.0.0.0"
    port: int = 8000
    advertise_url: str | None = None  # default http://$POD_IP:PORT, else the listen host
    dtype: str = "auto"
    device: str = "auto"
    num_blocks: int | None = None
    kv_memory_fraction: float | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_waiting: int | None = None  # queued requests at most, then 429 + Retry-After; None: 2 x max_num_seqs
    max_batched_tokens: int = 2048
    # Prompt tokens per step, all prompts together; None: the role's default (ROLE_PREFILL_CHUNK)
    prefill_chunk_tokens: int | None = None
    # A step prefilling beside streams lasts at most this many ordinary steps; None: the role's
    # default (ROLE_PREFILL_STALL); 0: fixed chunks of prefill_chunk_tokens
    prefill_stall_factor: float | None = None
    # While another tenant was served less here lately, prompt tokens per step of the tenants served
    # more; None: the default (DEFAULT_FLOW_CHUNK); 0: no cap
    flow_chunk_tokens: int | None = None
    compile: str = "auto"  # auto | on | off: torch.compile the decode step at start-up
    model_backend: ModelBackend = ModelBackend.AUTO  # the forward pass (contracts/model_support.py)
    prefix_caching: bool = True  # keep KV blocks after their request and reuse them for equal prefixes
    kv_backend: KVBackend | None = None  # None: nixl for prefill/decode, none for colocated
    threads: int | None = None
    served_name: str | None = None
    max_model_len: int | None = None
    log_format: str = "text"
    log_level: str = "info"
    kv_timeout_s: float = timing.KV_TRANSFER_TIMEOUT_S
    kv_reserve_wait_s: float = timing.KV_RESERVE_WAIT_S  # a handoff waits this long for free blocks, then 503 + Retry-After
    prefill_queue_s: float = timing.PREFILL_QUEUE_S  # a prefill not started after this is answered 429 + Retry-After
    engine_stall_s: float = 120.0  # an engine thread without progress this long fails /health
    kv_lease_s: float = timing.KV_LEASE_S
    kv_extra: dict[str, Any] = field(default_factory=dict)  # backend options (UCX settings, limits)
    kv_port: int = KV_PORT  # tcp backend: where prefill serves KV (0: any free port)
    kv_verify: bool = True  # digest each KV block handed out, check each pull against them (worker/kv/verify.py)
    kv_compat: str | None = None  # default $TANDEM_KV_COMPAT
    drain_s: float = 30.0
    # On SIGTERM, hand running sequences to other decode workers (their KV leased here for the
    # pull) instead of waiting for them to finish. None: on for decode, off for the other roles.
    migrate_on_drain: bool | None = None
    heartbeat_s: float = timing.HEARTBEAT_S  # keep-alive line on a silent generate stream (contracts/timing.py)
    # Tensor parallelism (engine/parallel/placement.py): N ranks, one process per device. Alone on
    # a node this process is rank 0 and starts the others; spanning nodes (a LeaderWorkerSet) the
    # rank, ranks per node and the leader's address default from $LWS_* (flags win).
    tensor_parallel: int = 1
    rank: int | None = None
    local_ranks: int | None = None
    leader_address: str | None = None  # HOST[:PORT] where rank 0 listens for the others
    tp_timeout_s: float = 60.0  # a collective between the ranks waits this long at most, then fails the group
    internal_secret_file: str | None = None  # a mounted Secret; wins over $TANDEM_INTERNAL_SECRET
    # Loaded in __post_init__ from the file or the environment, never from flags or YAML.
    internal_secret: str | None = field(default=None, repr=False)
    placement: Placement = field(init=False, repr=False)  # from the group settings, in __post_init__

    def __post_init__(self) -> None:
        if self.kv_backend is None:
            self.kv_backend = KVBackend.NONE if self.role is Role.COLOCATED else KVBackend.NIXL
        if self.migrate_on_drain is None:
            self.migrate_on_drain = self.role is Role.DECODE
        if self.migrate_on_drain and (self.role is Role.PREFILL or self.kv_backend is KVBackend.NONE):
            raise ValueError("migrate_on_drain needs a decode or colocated worker with a kv_backend "
                             f"(this one: role {self.role.value}, kv_backend {self.kv_backend.value})")
        if self.kv_compat is None:
            self.kv_compat = os.environ.get("TANDEM_KV_COMPAT", "")
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_port must be a TCP port (0-65535), got {self.kv_port}")
        if self.internal_secret is None:
            self.internal_secret = load_secret(os.environ, self.internal_secret_file)
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be auto, on or off, got {self.compile!r}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.flow_chunk_tokens is not None and self.flow_chunk_tokens < 0:
            raise ValueError(f"flow_chunk_tokens must be >= 0 (0: no cap), got {self.flow_chunk_tokens}")
        if self.prefill_stall_factor is not None and self.prefill_stall_factor != 0 and not self.prefill_stall_factor > 1:
            raise ValueError(f"prefill_stall_factor must be above 1 (or 0: fixed chunks), got {self.prefill_stall_factor}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        self.placement = place(self.tensor_parallel, self.rank, self.local_ranks, self.leader_address, os.environ)
        if not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be a number of seconds > 0, got {self.tp_timeout_s}")
        for key in ("kv_reserve_wait_s", "prefill_queue_s", "engine_stall_s", "drain_s", "heartbeat_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be a number of seconds >= 0, got {getattr(self, key)}")

    @classmethod
    def from_values(cls, values: dict[str, Any], source: str) -> WorkerConfig:
        """Build from loose values (YAML, flags); ValueError names the key and what it must be."""
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = str(raw_key).replace("-", "_")
            if key == "internal_secret":
                raise ValueError(f"{source}: the internal secret is never a setting (flags and ConfigMaps "
                                 f"are readable by others): set ${SECRET_ENV} or internal_secret_file")
            if key not in known:
                raise ValueError(f"{source}: unknown setting {raw_key!r} (known: {', '.join(sorted(known))})")
            out[key] = _coerce(key, value, hints[key], source)
        if not out.get("model"):
            raise ValueError("--model (or `model:` in --config) is required")
        return cls(**out)

    def engine_config(self) -> EngineConfig:
        from tandem.worker.engine.config import EngineConfig

        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device, block_size=self.block_size,
            num_blocks=self.num_blocks, kv_memory_fraction=self.kv_memory_fraction,
            max_num_seqs=self.max_num_seqs, max_waiting=self.max_waiting,
            max_batched_tokens=self.max_batched_tokens,
            max_model_len=self.max_model_len, served_name=self.served_name, threads=self.threads,
            prefill_chunk_tokens=self.effective_prefill_chunk_tokens(), prefix_caching=self.prefix_caching,
            prefill_stall_factor=self.effective_prefill_stall_factor(),
            flow_chunk_tokens=(DEFAULT_FLOW_CHUNK if self.flow_chunk_tokens is None else self.flow_chunk_tokens) or None,
            model_backend=self.model_backend.value,
            # A prefill worker never runs a decode step: nothing to compile there.
            compile="off" if self.role is Role.PREFILL and self.compile == "auto" else self.compile,
        )

    def effective_prefill_stall_factor(self) -> float | None:
        if self.prefill_stall_factor is None:
            return ROLE_PREFILL_STALL[self.role]
        return self.prefill_stall_factor or None

    def effective_prefill_chunk_tokens(self) -> int | None:
        if self.prefill_chunk_tokens is not None:
            return self.prefill_chunk_tokens
        default = ROLE_PREFILL_CHUNK[self.role]
        return None if default is None else min(default, self.max_batched_tokens)

    def kv_transfer_config(self, host: str, extra: dict[str, Any] | None = None) -> KVTransferConfig:
        from tandem.worker.kv.base import KVTransferConfig

        options = dict(self.kv_extra) | (extra or {})
        if self.role is Role.DECODE:
            # A decode worker serves KV only while it migrates out (and then polls fast, as a
            # prefill worker does once it hands a result out): idle, NIXL's notifications wait longer.
            options.setdefault("nixl_idle_poll_s", 0.05)
        return KVTransferConfig(backend=str(self.kv_backend), timeout_s=self.kv_timeout_s,
                                lease_s=self.kv_lease_s, host=host, extra=options,
                                secret=self.internal_secret, port=self.kv_port,
                                # decode serves KV too when it migrates sequences out
                                serve=self.role is not Role.DECODE or bool(self.migrate_on_drain))

    def public(self) -> dict[str, Any]:
        """What the start-up log line shows (backend options may hold addresses; the secret never)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("kv_extra", "internal_secret", "placement")}


def _coerce(key: str, value: Any, hint: Any, source: str) -> Any:
    """`value` as the field's type (an enum from its string, an int as a float), or ValueError."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"{source}: {key} must be set")
    for t in options:
        if t is type(None):
            continue
        if isinstance(t, type) and issubclass(t, _ENUMS):
            try:
                return t(value)
            except ValueError:
                continue
        origin = typing.get_origin(t) or t
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if origin in (str, dict) and isinstance(value, origin):
            return value
    names = " or ".join(_type_name(t) for t in options)
    raise ValueError(f"{source}: {key} must be {names}, got {value!r}")


def _type_name(t: Any) -> str:
    if t is type(None):
        return "null"
    if isinstance(t, type) and issubclass(t, _ENUMS):
        return "one of " + ", ".join(m.value for m in t)
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        typing.get_origin(t) or t, "a mapping")
