"""The cancel flag the disaggregated BLS model raises for a request it sent (backend/cancel_flag.py)."""

from __future__ import annotations

import os

import pytest

from backend.cancel_flag import (
    CANCEL_FLAG_DIR,
    CANCEL_FLAG_PREFIX,
    cancel_flag_path,
    lower_cancel_flag,
    new_cancel_flag,
    raise_cancel_flag,
)
from backend.request import RequestError


def test_a_flag_is_raised_and_lowered_as_a_file_of_its_own():
    name = new_cancel_flag()
    assert name != new_cancel_flag()
    path = cancel_flag_path(name)
    assert path == os.path.join(CANCEL_FLAG_DIR, name) and not os.path.exists(path)
    try:
        raise_cancel_flag(name)
        raise_cancel_flag(name)  # twice: still raised
        assert os.path.exists(path)
    finally:
        lower_cancel_flag(name)
    assert not os.path.exists(path)
    lower_cancel_flag(name)  # lowered twice: nothing to do


@pytest.mark.parametrize("name", ["/etc/passwd", "../inflight-cancel-" + "0" * 24, CANCEL_FLAG_PREFIX + "0" * 23,
                                  CANCEL_FLAG_PREFIX + "X" * 24, CANCEL_FLAG_PREFIX + "0" * 24 + "/x", ""])
def test_a_request_names_only_a_flag_never_another_path(name):
    with pytest.raises(RequestError) as info:
        cancel_flag_path(name)
    assert info.value.code == RequestError.INVALID_ARG and str(info.value).startswith("cancel_flag: not a cancel flag")
