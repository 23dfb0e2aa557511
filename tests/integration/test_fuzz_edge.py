"""Bounded fuzzing of the gRPC edge and the local lane: every agent and router method gets
random and mutated protobuf bytes, the local lane gets malformed frames. Nothing answers
UNKNOWN, nothing leaves a traceback in a log, and afterwards the agent still serves the
blocks it held, verified, with its Stats readable and its memory in bounds.

A seeded mutator (no new dependency): the same seed sends the same bytes, so a failure
reproduces. Real agent, router and etcd processes."""

from __future__ import annotations

import random
import re
import socket

import grpc
import torch
from support.common import TEST_SECRET, make_namespace, prompt_tokens, wait_for

from kvstore import lane
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.hashing import pack_ids
from kvstore.v1 import agent_pb2, common_pb2, peer_pb2, router_pb2
from grpc_health.v1 import health_pb2

SPEC = make_namespace()
BS = SPEC.block_size
ROUNDS = 24  # requests per method and seed message kind: ~1,000 requests in all
RSS_BOUND = 256 << 20  # generous: the agent may cache, it must not grow per request


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One (mostly) to four random edits of a serialized message (or fresh random bytes)."""
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        op = rng.randrange(7)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # flip a bit
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert random bytes
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and buf:  # delete a run
            del buf[pos : pos + rng.randint(1, 8)]
        elif op == 3:  # truncate
            del buf[pos:]
        elif op == 4 and buf:  # overwrite with a varint-ish byte
            buf[rng.randrange(len(buf))] = rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12])
        elif op == 5:  # splice a copy of itself
            buf[pos:pos] = buf[: rng.randint(0, len(buf))]
        else:  # random bytes
            buf = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(buf)


_INTS = [0, 1, 2, 7, 15, 16, 17, 64, 1 << 20, (1 << 31) - 1, (1 << 32) - 1, (1 << 63) - 1]
_TEXT = ["", "acme", "a/b", "..", "_cluster", "\u00e9\u4e2d", "x" * 300, "127.0.0.1:1"]
_FLOATS = [0.0, -1.0, 1e-300, 1e308, float("inf"), float("nan"), 10000.0]


def _value(rng: random.Random, field, depth: int):
    fd = field.__class__
    if field.type == fd.TYPE_MESSAGE:
        return random_message(rng, field.message_type._concrete_class, depth + 1)
    if field.type == fd.TYPE_STRING:
        return rng.choice(_TEXT)
    if field.type == fd.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 15, 16, 17, 32, 48, rng.randint(0, 200)]))
    if field.type in (fd.TYPE_DOUBLE, fd.TYPE_FLOAT):
        return rng.choice(_FLOATS) if field.type == fd.TYPE_DOUBLE else 1.5
    if field.type == fd.TYPE_BOOL:
        return rng.random() < 0.5
    if field.type == fd.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values])
    top = (
        (1 << 31) - 1
        if field.type
        in (fd.TYPE_INT32, fd.TYPE_UINT32, fd.TYPE_SINT32, fd.TYPE_FIXED32, fd.TYPE_SFIXED32)
        else None
    )
    v = rng.choice(_INTS)
    if top is not None:
        v = min(v, top)
    if (
        field.type in (fd.TYPE_INT32, fd.TYPE_INT64, fd.TYPE_SINT32, fd.TYPE_SINT64)
        and rng.random() < 0.3
    ):
        v = -v
    return v


def random_message(rng: random.Random, cls, depth: int = 0):
    """A well-formed message of `cls` with random field values: it decodes, so it
    reaches the servicer's own checks."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if rng.random() < 0.4 or (depth > 2 and field.type == field.TYPE_MESSAGE):
            continue
        if field.is_repeated:
            values = [_value(rng, field, depth) for _ in range(rng.randint(0, 3))]
            getattr(msg, field.name).extend(values)
        elif field.type == field.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(_value(rng, field, depth))
        else:
            setattr(msg, field.name, _value(rng, field, depth))
    return msg


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype)) for _ in range(n)
    ]


def seeds(ns, ids: list[bytes]) -> dict[str, list[bytes]]:
    """Valid requests per method, the mutator's starting points."""
    ref, packed = ns.ref, pack_ids(ids)
    spec = common_pb2.Namespace(**SPEC.to_dict())
    put = agent_pb2.PutRequest(
        ns=ref,
        root=ns.root,
        blocks=[
            agent_pb2.BlockPut(block_id=ids[0], parent_id=ns.root, data=bytes(SPEC.block_bytes))
        ],
    )
    msgs = {
        "/kvstore.v1.NodeAgent/OpenNamespace": agent_pb2.OpenNamespaceRequest(spec=spec),
        "/kvstore.v1.NodeAgent/Lookup": agent_pb2.LookupRequest(ns=ref, block_ids=packed),
        "/kvstore.v1.NodeAgent/Get": agent_pb2.GetRequest(
            ns=ref, block_ids=packed, parent_id=ns.root
        ),
        "/kvstore.v1.NodeAgent/Put": put,
        "/kvstore.v1.NodeAgent/Pin": agent_pb2.PinRequest(ns=ref, block_ids=packed),
        "/kvstore.v1.NodeAgent/Unpin": agent_pb2.PinRequest(ns=ref, block_ids=packed),
        "/kvstore.v1.NodeAgent/Stats": agent_pb2.StatsRequest(tenant="acme"),
        "/kvstore.v1.NodeAgent/LocalLane": agent_pb2.LocalLaneRequest(),
        "/kvstore.v1.NodeAgent/RegisterShm": agent_pb2.RegisterShmRequest(
            name="kvstore-fuzz-missing", size=4096
        ),
        "/kvstore.v1.NodeAgent/UnregisterShm": agent_pb2.UnregisterShmRequest(region_id=7),
        "/kvstore.v1.NodeAgent/Subscribe": agent_pb2.SubscribeRequest(subscriber="fuzz"),
        "/kvstore.v1.Peer/FetchBlocks": peer_pb2.FetchRequest(
            ns=ref, block_ids=packed, parent_id=ns.root
        ),
        "/kvstore.v1.Peer/Prefetch": peer_pb2.PrefetchRequest(
            ns=ref,
            spec=spec,
            block_ids=packed,
            parent_id=ns.root,
            peer_address="127.0.0.1:1",
            timeout_ms=500,
        ),
        "/grpc.health.v1.Health/Check": health_pb2.HealthCheckRequest(),
        "/grpc.health.v1.Health/List": health_pb2.HealthListRequest(),
    }
    return {m: [r.SerializeToString()] for m, r in msgs.items()}


ROUTER_SEEDS = {
    "/kvstore.v1.Router/Route": [
        router_pb2.RouteRequest(
            namespace_id=SPEC.namespace_id,
            block_ids=bytes(32),
            request_id="r",
            weights=router_pb2.RouteWeights(load=1.0),
        ).SerializeToString()
    ],
    "/kvstore.v1.Router/Release": [
        router_pb2.ReleaseRequest(request_id="r", prefill_done=True).SerializeToString()
    ],
    "/kvstore.v1.Router/ListNodes": [router_pb2.ListNodesRequest().SerializeToString()],
    "/grpc.health.v1.Health/Check": [
        health_pb2.HealthCheckRequest(service="kvstore.v1.Router").SerializeToString()
    ],
    "/grpc.health.v1.Health/List": [health_pb2.HealthListRequest().SerializeToString()],
}


def methods(*services) -> dict[str, object]:
    """Full method name -> request message class, for every method of `services`."""
    return {
        f"/{svc.full_name}/{m.name}": m.input_type._concrete_class
        for svc in services
        for m in svc.methods
    }


AGENT_METHODS = methods(
    agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"],
    peer_pb2.DESCRIPTOR.services_by_name["Peer"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
)
ROUTER_METHODS = methods(
    router_pb2.DESCRIPTOR.services_by_name["Router"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
)
WATCH = "/grpc.health.v1.Health/Watch"  # streams forever; Check covers the health edge
STREAMING_REQUESTS = {"/kvstore.v1.NodeAgent/Put"}
STREAMING_RESPONSES = {
    "/kvstore.v1.NodeAgent/Get",
    "/kvstore.v1.NodeAgent/Subscribe",
    "/kvstore.v1.Peer/FetchBlocks",
    WATCH,
}


def call_raw(channel: grpc.Channel, method: str, payloads: list[bytes]):
    """One call with raw request bytes; the status code it ended with."""
    try:
        if method in STREAMING_REQUESTS:
            channel.stream_unary(method)(iter(payloads), timeout=10)
        elif method in STREAMING_RESPONSES:
            call = channel.unary_stream(method)(payloads[0], timeout=10)
            next(call, None)  # a first answer is enough (Subscribe never ends)
            call.cancel()
        else:
            channel.unary_unary(method)(payloads[0], timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def fuzz(
    channel: grpc.Channel, table: dict[str, list[bytes]], types: dict, rng: random.Random
) -> dict:
    """Every method: random bytes, random well-formed messages of its request type
    (`types`) and mutations of its seeds; codes seen, and the
    requests that got UNKNOWN or INTERNAL (a bug: bad input has a precise status)."""
    codes: dict[str, int] = {}
    unknown = []
    for method, base in table.items():
        for i in range(ROUNDS):
            if i % 4 == 0:
                payloads = [rng.randbytes(rng.randint(0, 48))]
            elif i % 4 == 1:
                payloads = [random_message(rng, types[method]).SerializeToString()]
            else:
                payloads = [mutate(rng, rng.choice(base))]
            if method in STREAMING_REQUESTS and rng.random() < 0.5:
                payloads = [base[0], *payloads]  # a good first message, then a bad one
            code, details = call_raw(channel, method, payloads)
            codes[code.name] = codes.get(code.name, 0) + 1
            if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                unknown.append((method, payloads, details))
    return {"codes": codes, "unknown": unknown[:5]}


_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ([A-Z]+) ", re.M)


def records(log: str) -> list[str]:
    """The log's records at INFO and above, each with its continuation lines (a
    traceback). DEBUG is left out: the routing terms the router under test logs there."""
    starts = list(_RECORD.finditer(log))
    out = []
    for m, nxt in zip(starts, starts[1:] + [None]):
        if m.group(1) != "DEBUG":
            out.append(log[m.start() : nxt.start() if nxt else len(log)])
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def lane_frames(rng: random.Random, good: bytes) -> list[bytes]:
    frames = []
    for i in range(60):
        method = rng.choice([lane.LOOKUP, lane.GET, lane.PUT, 0, 4, 255])
        meta = rng.choice(
            [b"", b"authorization=Bearer x", rng.randbytes(rng.randint(0, 12)), b"\xff\xfe=\x00"]
        )
        body = mutate(rng, good) if i % 3 else rng.randbytes(rng.randint(0, 32))
        frame = lane.request_frame(method, meta, body)
        if i % 7 == 0:  # a header that lies about the lengths
            frame = (
                lane.REQUEST_HEADER.pack(
                    rng.choice([0, 3, len(frame), 1 << 31]), method, rng.randrange(1 << 16)
                )
                + frame[7:]
            )
        frames.append(frame)
    return frames


def lane_call(path: str, frame: bytes) -> int | None:
    """Status of the agent's answer to one frame; None when it hung up without one."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        greeting = s.recv(lane.RESPONSE_HEADER.size, socket.MSG_WAITALL)
        s.recv(lane.RESPONSE_HEADER.unpack(greeting)[0], socket.MSG_WAITALL)  # the lane id
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        head = s.recv(lane.RESPONSE_HEADER.size, socket.MSG_WAITALL)
        if len(head) < lane.RESPONSE_HEADER.size:
            return None
        return lane.RESPONSE_HEADER.unpack(head)[1]


def test_garbage_requests_never_get_unknown_and_break_nothing(etcd, spawn_agent, start_router):
    agent = spawn_agent(etcd_endpoints=etcd.endpoint, lease_ttl_s=2)
    router = start_router()
    wait_for(lambda: router.nodes(), 30, what="the router to list the agent")
    rng = random.Random(20261201)
    with (
        KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as c,
        KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as lane_c,
    ):
        ns = c.open_namespace(SPEC)
        ids = c.block_ids(ns, prompt_tokens(1, 4 * BS))
        blocks = blocks_for(1, 4)
        assert c.put(ns, ids, blocks).stored == 4
        rss0 = rss_bytes(agent.proc.pid)
        before = (len(records(agent.log)), len(records(router.log)))
        table = seeds(ns, ids)
        # Every method of every service the two processes serve is fuzzed.
        assert set(table) | {WATCH} == set(AGENT_METHODS)
        assert set(ROUTER_SEEDS) | {WATCH} == set(ROUTER_METHODS)
        with grpc.insecure_channel(agent.address) as ch:
            agent_run = fuzz(ch, table, AGENT_METHODS, rng)
        with grpc.insecure_channel(router.address) as ch:
            router_run = fuzz(ch, ROUTER_SEEDS, ROUTER_METHODS, rng)
        assert not agent_run["unknown"] and not router_run["unknown"], (
            agent_run["unknown"],
            router_run["unknown"],
        )
        # Refusing bad input costs no log records (it once cost one with a traceback
        # each): a few from the requests that were served are fine.
        sent = sum(agent_run["codes"].values()) + sum(router_run["codes"].values())
        grown = (len(records(agent.log)) - before[0], len(records(router.log)) - before[1])
        assert max(grown) < sent // 20, grown
        # Most requests are refused precisely; some mutations still parse and are served.
        assert agent_run["codes"].get("INVALID_ARGUMENT", 0) > ROUNDS
        assert router_run["codes"].get("INVALID_ARGUMENT", 0) > ROUNDS // 2

        good = agent_pb2.LookupRequest(ns=ns.ref, block_ids=pack_ids(ids)).SerializeToString()
        statuses = [lane_call(lane_c.local_socket, f) for f in lane_frames(rng, good)]
        assert grpc.StatusCode.UNKNOWN.value[0] not in statuses, statuses
        assert any(s == grpc.StatusCode.INVALID_ARGUMENT.value[0] for s in statuses)

        # Still serving: the chain it held comes back verified, on both transports, and a
        # new round trip works.
        assert c.lookup(ns, ids).matched == 4
        assert all(torch.equal(a, b) for a, b in zip(c.get(ns, ids), blocks))
        lane_ns = lane_c.open_namespace(SPEC)
        assert all(torch.equal(a, b) for a, b in zip(lane_c.get(lane_ns, ids), blocks))
        more = c.block_ids(ns, prompt_tokens(2, 3 * BS))
        assert c.put(ns, more, blocks_for(2, 3)).stored == 3
        assert all(torch.equal(a, b) for a, b in zip(c.get(ns, more), blocks_for(2, 3)))
        st = c.stats()
        hbm = st.tiers[0]
        assert hbm.slots_total - hbm.slots_free == hbm.blocks >= 7
        assert rss_bytes(agent.proc.pid) - rss0 < RSS_BOUND
    assert router.nodes()  # the router still answers
    for name, log in (("agent", agent.log), ("router", router.log)):
        for rec in records(log):
            assert "Traceback" not in rec and "Unexpected" not in rec, f"{name}: {rec}"
