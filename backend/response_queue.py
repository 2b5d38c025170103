"""The Triton adapter's response side (backend/model.py): what it keeps of each request
until its final response (`LiveRequest`), and the items its response thread's queue carries
from the engine loop and from `finalize`, handled in queue order.

No Triton import at run time (only the type of a response sender, for readers and checkers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.protocol import ResponseEncoder

if TYPE_CHECKING:
    from triton_python_backend_utils import InferenceResponseSender

    from backend.metrics import Updates
    from backend.output import RequestOutput
    from backend.request import Request


@dataclass(eq=False)
class LiveRequest:
    """Response-side state of one request that has not had its final response yet."""

    request_id: str
    sender: InferenceResponseSender
    encoder: ResponseEncoder
    # The engine's Request (read-only here: its status and output tokens, set by the loop).
    request: Request | None = None
    cancelled: bool = False
    # Its final response has gone: nothing more may be sent on its sender.
    ended: bool = False
    # A response with text has gone: from then on its queued outputs may go as one.
    streaming: bool = False
    last_cancel_poll: float = field(default_factory=time.monotonic)
    # The file whose existence cancels it (backend/cancel_flag.py): a request the
    # disaggregated BLS model sent, which Triton 2.51 cannot cancel.
    cancel_flag: str | None = None
    # Its errors go as the ERROR_TENSOR output of an ordinary response (backend/protocol.py).
    error_as_output: bool = False


# What the response thread's queue carries: the loop thread queues engine outputs and
# metric updates, finalize queues the stop once nothing else will be queued.
@dataclass(frozen=True)
class EngineOutput:
    live: LiveRequest
    output: RequestOutput


@dataclass(frozen=True)
class MetricUpdates:
    updates: Updates


@dataclass(frozen=True)
class StopResponses:
    pass


@dataclass(frozen=True)
class FailLive:
    """End every live request with this error (the engine will not end them)."""

    message: str
    code: str
