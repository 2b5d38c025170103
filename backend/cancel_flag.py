"""A request's cancel flag: how the disaggregated `llm` model (a BLS model) passes its
client's cancel on to the engine model that holds the request.

tritonserver 2.51's Python backend cannot cancel a request a BLS model sent: its
`InferenceRequest` and the response iterator of `exec(decoupled=True)` have no `cancel`,
and a cancel of the BLS model's own request does not reach the requests it sent. So the BLS
model names a flag, a file under /dev/shm, in the `cancel_flag` input of each request it
sends to llm_prefill or llm_decode, and raises it (creates the file) when its client
cancels; the engine model asks whether it is raised when it asks Triton whether the request
was cancelled (backend/model.py), and a raised flag cancels the request as a client's
cancel does: the engine aborts it, frees its blocks and answers one CANCELLED error. The
BLS model owns the file: it creates it and removes it once the request has ended.
"""

from __future__ import annotations

import os
import re
import secrets

from backend.request import RequestError

CANCEL_FLAG_TENSOR = "cancel_flag"
CANCEL_FLAG_PREFIX = "inflight-cancel-"
CANCEL_FLAG_DIR = "/dev/shm"
_NAME = re.compile(re.escape(CANCEL_FLAG_PREFIX) + r"[0-9a-f]{24}")


def new_cancel_flag() -> str:
    """A fresh flag's name, not yet raised."""
    return CANCEL_FLAG_PREFIX + secrets.token_hex(12)


def cancel_flag_path(name: str) -> str:
    """The file of the flag `name`; INVALID_ARG (naming `cancel_flag`) for a name that is
    not one: a request names only a flag, never any other path."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise RequestError.invalid(CANCEL_FLAG_TENSOR, f"not a cancel flag: {str(name)[:80]!r} (expected "
                                   f"{CANCEL_FLAG_PREFIX} and 24 hex digits)")
    return os.path.join(CANCEL_FLAG_DIR, name)


def raise_cancel_flag(name: str) -> None:
    with open(cancel_flag_path(name), "a"):
        pass


def lower_cancel_flag(name: str) -> None:
    try:
        os.unlink(cancel_flag_path(name))
    except FileNotFoundError:
        pass
