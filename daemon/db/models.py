"""SQLAlchemy 2.x models of the status tables. A change here needs an Alembic migration in
`migrations/versions/` (tests run `alembic check`).

Request phases follow a request through the cluster; statuses say how it ended:

    phase:  queued → prefill → transfer → decode → done     (colocated: queued → prefill → decode → done)
    status: running → finished | rejected | failed | cancelled | interrupted (rejected: refused at the API,
    or turned away by its instance past its TTFT target, `ttft_miss` reject)
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Phase(StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"
    DONE = "done"


class Status(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


TERMINAL = (Status.FINISHED, Status.REJECTED, Status.FAILED, Status.CANCELLED, Status.INTERRUPTED)


class Base(DeclarativeBase):
    pass


class RequestRow(Base):
    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    phase: Mapped[str] = mapped_column(String(16), default=Phase.QUEUED)
    status: Mapped[str] = mapped_column(String(16), default=Status.RUNNING)
    arrival_ts: Mapped[float] = mapped_column(Float)  # unix seconds (wall clock)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    max_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    prefill_instance: Mapped[str | None] = mapped_column(String(64), nullable=True)
    decode_instance: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sla_ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    sla_jct_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    # timeline, unix seconds
    prefill_start_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_token_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    decode_start_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    jct_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the length predictor's range at admission, and the prompt's first tokens (JSON) it learns from
    predicted_lo: Mapped[int | None] = mapped_column(Integer, nullable=True)
    predicted_hi: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kv_loaded_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)  # decode: KV from the hand-over
    # prompt tokens its prefill found in the entry instance's prefix cache (not computed); None: not known
    cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    prompt_sample: Mapped[str | None] = mapped_column(Text, nullable=True)
    # request migration: times it moved off an instance that died mid-request, and those instances
    migrations: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    migrated_from: Mapped[str | None] = mapped_column(String(256), nullable=True)  # comma-separated ids
    # the front process that serves it (its incarnation, e.g. "front-0.4242"); None: a daemon with no fronts
    front: Mapped[str | None] = mapped_column(String(64), nullable=True)

    __table_args__ = (
        Index("ix_requests_status_phase", "status", "phase"),
        Index("ix_requests_arrival", "arrival_ts"),
        Index("ix_requests_status_front", "status", "front"),
    )


class InstanceRow(Base):
    __tablename__ = "instances"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))  # prefill | decode | colocated
    state: Mapped[str] = mapped_column(String(16))  # active | draining | flipping | unhealthy | gone
    address: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(128))
    kv_capacity_tokens: Mapped[int] = mapped_column(Integer, default=0)
    registered_ts: Mapped[float] = mapped_column(Float)
    last_report_ts: Mapped[float | None] = mapped_column(Float, nullable=True)


class LoadSampleRow(Base):
    __tablename__ = "load_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64), ForeignKey("instances.id", ondelete="CASCADE"))
    ts: Mapped[float] = mapped_column(Float)
    queued: Mapped[int] = mapped_column(Integer)
    running: Mapped[int] = mapped_column(Integer)
    kv_used_tokens: Mapped[int] = mapped_column(Integer)
    kv_capacity_tokens: Mapped[int] = mapped_column(Integer)
    tokens_per_s: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index("ix_load_samples_instance_ts", "instance_id", "ts"),)


class FlipRow(Base):
    """One instance flip (filled by the scheduling issue)."""

    __tablename__ = "flips"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[str] = mapped_column(String(64))
    from_role: Mapped[str] = mapped_column(String(16))
    to_role: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    requested_by: Mapped[str] = mapped_column(String(64))
    started_ts: Mapped[float] = mapped_column(Float)
    drained_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    done_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    outcome: Mapped[str | None] = mapped_column(String(32), nullable=True)


class PolicyChangeRow(Base):
    """One runtime policy change, the audit trail (filled by the scheduling issue)."""

    __tablename__ = "policy_changes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float)
    field: Mapped[str] = mapped_column(String(64))
    old_value: Mapped[str | None] = mapped_column(Text, nullable=True)
    new_value: Mapped[str] = mapped_column(Text)
    requested_by: Mapped[str] = mapped_column(String(64))
