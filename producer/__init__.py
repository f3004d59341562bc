"""exlq's producer side: the wire contract and the SDK. Needs no torch and no GPU."""

from producer.client import AsyncProducer, JobHandle, JobStatus
from producer.errors import ExlqError, InvalidRequest, JobFailed, JobRestarted, QueueFull
from producer.keys import QueueKeys
from producer.protocol import (
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
from producer.sync_client import Producer, SyncJobHandle

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
    "JobRestarted",
    "JobResult",
    "JobStatus",
    "Producer",
    "QueueFull",
    "QueueKeys",
    "RequeuedEvent",
    "Sampling",
    "SyncJobHandle",
    "TokenEvent",
]
