"""Dial an agent's UCX listener at HOST:PORT as a raw peer would and send one
FetchRequest (for a namespace the agent does not know); print one JSON line: {"answer":
error text} when the agent answered, {"closed": why} when it dropped the connection
first. For tests/integration/test_ucx_bind.py (a subprocess: ucxx stays out of pytest).

With LINGER (seconds), it then acknowledges the answer as a fetcher ends a request
it means to follow with another (wire.ACK), keeps its end open that long, and adds
{"closed_after_s": t} when the agent closed the connection meanwhile, else
{"open_after_s": LINGER}.

Usage: python tests/support/ucx_dial.py HOST PORT [LINGER]

Or `ucx_dial.py HOST PORT header REQUEST_HEX`: send the FetchRequest REQUEST_HEX, offering
direct reads (same_host: this host's identity, as a fetching agent of the host would), and print
what its first chunk header discloses: {"error": ..., "direct_pid": ..., "addresses": n,
"direct_fd": ...} (direct reads name the server's process and where its blocks lie).

Or `ucx_dial.py HOST PORT hold N REQUEST_HEX`: N connections each send the FetchRequest
REQUEST_HEX (its serialized bytes in hex) and read its first chunk header, then never
receive a payload (a stalled receiver); prints {"held": K}, the number of them served a
header within 5 s, and waits to be killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

from node_agent.peer.ucx import direct
from node_agent.peer.ucx.wire import ACK, control_buffer, init_ucx, post_control, recv_control
from kvstore.v1 import agent_pb2, peer_pb2


async def _first_header(ep, raw: bytes) -> peer_pb2.FetchChunk:
    """Send the FetchRequest `raw` as a fetcher does and read the answer's first header."""
    await asyncio.wait_for(post_control(ep, raw), 10)
    got = await asyncio.wait_for(recv_control(ep, control_buffer()), 10)
    return peer_pb2.FetchChunk.FromString(got)


async def dial(host: str, port: int, linger: float = 0.0) -> dict:
    # The agents' own UCX settings: two processes of one host only connect when they
    # agree on which transports may carry peer endpoints.
    ucx = init_ucx()
    try:
        ep = await ucx.create_endpoint(host, port, endpoint_error_handling=True)
        req = peer_pb2.FetchRequest(
            ns=agent_pb2.NamespaceRef(namespace_id=b"\x01" * 16), block_ids=b"\x02" * 16
        )
        chunk = await _first_header(ep, req.SerializeToString())
        out: dict = {"answer": chunk.error or "ok"}
        if linger:
            await asyncio.wait_for(ep.send(np.frombuffer(ACK, dtype=np.uint8)), 10)
            t0 = time.monotonic()
            try:  # nothing more is sent to us: this ends when the agent closes
                await asyncio.wait_for(ep.recv(np.empty(8, dtype=np.uint8)), linger)
            except asyncio.TimeoutError:
                out["open_after_s"] = linger
            except Exception:  # noqa: BLE001 - closed by the agent
                out["closed_after_s"] = round(time.monotonic() - t0, 2)
        return out
    except Exception as exc:  # noqa: BLE001 - the refusal is what is looked for
        return {"closed": f"{type(exc).__name__}: {exc}"}
    finally:
        ucx.stop_notifier_thread()


async def hold(host: str, port: int, n: int, raw: bytes) -> None:
    ucx = init_ucx()
    eps, headers = [], []
    frame = np.frombuffer(len(raw).to_bytes(4, "little") + raw, dtype=np.uint8)
    for _ in range(n):
        ep = await ucx.create_endpoint(host, port, endpoint_error_handling=True)
        await asyncio.wait_for(ep.send(frame), 10)
        eps.append(ep)
        headers.append(asyncio.ensure_future(ep.recv(np.zeros(1 << 16, dtype=np.uint8))))
    await asyncio.wait(headers, timeout=5)  # a first header: that transfer is served
    print(json.dumps({"held": sum(h.done() and not h.exception() for h in headers)}), flush=True)
    await asyncio.sleep(3600)


async def header(host: str, port: int, raw: bytes) -> dict:
    req = peer_pb2.FetchRequest.FromString(raw)
    req.same_host = direct.host_identity()
    raw = req.SerializeToString()
    ucx = init_ucx()
    ep = await ucx.create_endpoint(host, port, endpoint_error_handling=True)
    chunk = await _first_header(ep, req.SerializeToString())
    return {
        "error": chunk.error,
        "count": chunk.count,
        "direct_pid": chunk.direct_pid,
        "addresses": len(chunk.addresses),
        "direct_fd": chunk.direct_fd,
    }


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "header":
        print(json.dumps(asyncio.run(header(host, port, bytes.fromhex(sys.argv[4])))), flush=True)
        os._exit(0)
    if len(sys.argv) > 3 and sys.argv[3] == "hold":
        asyncio.run(hold(host, port, int(sys.argv[4]), bytes.fromhex(sys.argv[5])))
        return
    linger = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    print(json.dumps(asyncio.run(dial(host, port, linger))), flush=True)
    os._exit(0)  # ucxx's threads may linger after a refused endpoint


if __name__ == "__main__":
    main()
