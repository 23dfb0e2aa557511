"""Completions through the request notifier init_ucx installs (node_agent/peer/ucx/
wire._notify): one process, one event loop, a listener and an endpoint to it; N small
messages sent at once and echoed back at once (bursts of completions, several per
wake-up), then ucxx's own stop of the notifier thread. Prints one JSON line:
{"ours": the thread ucxx started runs wire._notify, "state": wire.notifier_state then,
"echoed": every message came back intact and in order, "stopped": the thread ended after
ucxx's stop, "state_after": notifier_state after it}. A subprocess, so
that ucxx stays out of pytest.

Usage: python tests/support/ucx_notify.py N
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from node_agent.peer.ucx import wire

SIZE = 64  # bytes per message: eager sends, each one request to complete


async def main(n: int) -> dict:
    ucx = wire.init_ucx()
    ctx = ucx.core._get_ctx()
    thread = ctx.notifier_thread
    out = {
        "ours": getattr(thread, "_target", None) is wire._notify,
        "state": wire.notifier_state(ucx),
    }
    served = asyncio.get_running_loop().create_future()

    async def echo(ep) -> None:
        bufs = [np.empty(SIZE, np.uint8) for _ in range(n)]
        await asyncio.gather(*(ep.recv(b) for b in bufs))
        await asyncio.gather(*(ep.send(b) for b in bufs))
        served.set_result(True)

    listener = ucx.create_listener(echo, port=0)
    ep = await ucx.create_endpoint("127.0.0.1", listener.port, endpoint_error_handling=True)
    sent = [np.full(SIZE, i % 251, np.uint8) for i in range(n)]
    back = [np.zeros(SIZE, np.uint8) for _ in range(n)]
    recvs = [asyncio.ensure_future(ep.recv(b)) for b in back]
    await asyncio.wait_for(asyncio.gather(*(ep.send(m) for m in sent)), 60)
    await asyncio.wait_for(asyncio.gather(*recvs), 60)
    await asyncio.wait_for(served, 60)
    out["echoed"] = all(np.array_equal(a, b) for a, b in zip(sent, back))
    ep.abort()
    listener.close()
    ucx.stop_notifier_thread()
    thread.join(5)
    out["stopped"] = not thread.is_alive()
    out["state_after"] = wire.notifier_state(ucx)
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(int(sys.argv[1])))), flush=True)
