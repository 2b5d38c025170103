"""A client process for tests/e2e/test_e2e_cancel.py: opens N gRPC streams, one long request on
each, prints "streaming N" once every request has received a response, then waits to be
killed (SIGKILL: the kernel closes its sockets, nothing says goodbye).

    python -m tests.e2e.e2e_stream_client URL MODEL N MAX_TOKENS
"""

from __future__ import annotations

import sys
import time

from tests.e2e.e2e_util import Stream, inputs_for


def main(argv: list[str]) -> int:
    url, model, n, max_tokens = argv[0], argv[1], int(argv[2]), int(argv[3])
    streams = [Stream(url) for _ in range(n)]
    outcomes = [
        stream.send(model, inputs_for(f"Stream {i} goes on and on", {"temperature": 0, "max_tokens": max_tokens,
                                                                   "ignore_eos": True}, stream=True))
        for i, stream in enumerate(streams)
    ]
    deadline = time.monotonic() + 120
    while not all(o.responses for o in outcomes):
        if any(o.error is not None or o.done.is_set() for o in outcomes) or time.monotonic() > deadline:
            print("failed: " + "; ".join(o.message for o in outcomes if o.error is not None), flush=True)
            return 1
        time.sleep(0.01)
    print(f"streaming {n}", flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
