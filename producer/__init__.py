"""The SDK: submit jobs to a queue and follow their events. Needs no torch and no GPU."""

from exlq.producer.client import AsyncProducer, JobHandle
from exlq.producer.errors import (
    ExlqError,
    InvalidRequest,
    JobFailed,
    JobLost,
    JobRestarted,
    NotReplicated,
    NoWorkers,
    QueueFull,
)
from exlq.producer.partition import JobStatus
from exlq.producer.sync_client import Producer, SyncJobHandle
from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import (
    ChatMessage,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerationRequest,
    JobResult,
    RequeuedEvent,
    Sampling,
    TokenEvent,
)

__all__ = [
    "AsyncProducer",
    "ChatMessage",
    "DoneEvent",
    "ErrorEvent",
    "Event",
    "ExlqError",
    "GenerationRequest",
    "InvalidRequest",
    "JobFailed",
    "JobHandle",
    "JobLost",
    "JobRestarted",
    "JobResult",
    "JobStatus",
    "NoWorkers",
    "NotReplicated",
    "Producer",
    "QueueFull",
    "QueueKeys",
    "RequeuedEvent",
    "Sampling",
    "SyncJobHandle",
    "TokenEvent",
]
