"""The same-host local lane (kvstore/lane.py, node_agent/local_lane.py): a same-host client
calls Lookup, Get and Put over the agent's Unix socket with the same answers, status codes
and tenant isolation as over gRPC; bad frames get precise errors and cost nothing; a
broken lane falls back to gRPC. Real agent processes, real sockets."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import threading

import grpc
import pytest
import torch
from support.common import TEST_SECRET, make_namespace, prompt_tokens
from support.lane_raw import raw_call

from kvstore import lane
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.client.local_lane import LaneBroken, LaneChannel, LaneError
from kvstore.client.results import PutResult
from kvstore.events import Tier
from kvstore.v1 import agent_pb2

SPEC = make_namespace()
BS = SPEC.block_size
TOKENS = {"acme": "acme-token", "beta": "beta-token"}
A_MD = (("authorization", "Bearer " + TOKENS["acme"]),)


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype)) for _ in range(n)
    ]


def tenants() -> dict:
    return {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in TOKENS.items()
    }


def code_of(fn, *args) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as exc:
        fn(*args)
    return exc.value.code(), exc.value.details()


def socket_path(agent_address: str, token: str | None = None) -> str:
    """What the agent tells a client whose region it mapped (RegisterShm)."""
    with KVClient(
        agent_address, token=token, use_shm=True, shm_bytes=1 << 16, local_lane=False
    ) as c:
        assert not c.uses_local_lane
        return c.local_socket


def test_same_host_client_round_trips_over_the_lane_without_grpc(spawn_agent):
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        assert c.uses_shm and c.uses_local_lane
        ns = c.open_namespace(SPEC)
        tokens = prompt_tokens(1, 5 * BS)
        ids = c.block_ids(ns, tokens)
        blocks = blocks_for(1, 5)
        calls = dict(c.stats().counters)["local_lane_calls"]
        assert c.put(ns, ids, blocks).stored == 5
        assert c.put(ns, ids, blocks).already_present == 5
        r = c.lookup(ns, ids + c.block_ids(ns, prompt_tokens(2, BS)))
        assert (r.matched, r.hbm, r.nvme) == (5, 5, 0)
        got = c.get(ns, ids)
        assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(got, blocks))
        hit = c.fetch(ns, tokens + prompt_tokens(3, 7))
        assert hit.cached_blocks == 5 and torch.equal(hit.blocks[4], blocks[4])
        # Every data-plane call went over the lane: 2 puts, a lookup, a get, a fetch (2).
        assert dict(c.stats().counters)["local_lane_calls"] == calls + 6
    assert "local lane on /dev/shm/" in agent.log


@pytest.mark.parametrize("chain_puts", [True, False], ids=["packed-chain", "block-puts"])
def test_staged_puts_in_either_form_store_the_same_chain(spawn_agent, chain_puts):
    """put_staged sends the packed chain form (PutRequest.chain_ids) to an agent whose
    RegisterShm says it takes it, a BlockPut per block otherwise (agents before it):
    both land the same blocks, offset by first_slot and chained to `parent`."""
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        assert c._chain_puts  # this agent says so
        c._chain_puts = chain_puts
        ns = c.open_namespace(SPEC)
        ids = c.block_ids(ns, prompt_tokens(4, 6 * BS))
        blocks = blocks_for(4, 6)
        views = c.staging_views(ns, 6)
        for v, b in zip(views, blocks):
            v.copy_(b.reshape(v.shape))
        assert c.put_staged(ns, []) == PutResult(0, 0)  # nothing to send: nothing sent
        assert c.put_staged(ns, ids[:2]).stored == 2
        # the rest from slot 2 on, chained to the last block stored
        assert c.put_staged(ns, ids[2:], parent=ids[1], first_slot=2).stored == 4
        got = c.get(ns, ids)
        assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(got, blocks))


def test_lane_errors_match_grpc_and_tenants_stay_apart(spawn_agent):
    agent = spawn_agent(allow_unauthenticated=False, tenants=tenants())
    with (
        KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a") as a,
        KVClient(agent.address, token=TOKENS["beta"], tenant_secret="b") as b,
        KVClient(agent.address, token=TOKENS["beta"], tenant_secret="b", use_shm=False) as b_grpc,
    ):
        assert a.uses_local_lane and b.uses_local_lane and not b_grpc.uses_local_lane
        ns = a.open_namespace(SPEC)
        ids = a.block_ids(ns, prompt_tokens(4, 3 * BS))
        blocks = blocks_for(4, 3)
        assert a.put(ns, ids, blocks).stored == 3
        # B over the lane gets what B over gRPC gets: no access to A's private namespace.
        for fn, args in ((b.lookup, (ns, ids)), (b.get, (ns, ids)), (b.put, (ns, ids, blocks))):
            lane_err = code_of(fn, *args)
            grpc_err = code_of(getattr(b_grpc, fn.__name__), *args)
            assert lane_err == grpc_err and lane_err[0] == grpc.StatusCode.PERMISSION_DENIED
        # An older generation and malformed ids: same codes and details on both paths.
        with KVClient(
            agent.address, token=TOKENS["acme"], tenant_secret="a", use_shm=False
        ) as a_grpc:
            for gen in (ns.generation + 1, ns.generation + 7):
                other = dataclasses.replace(ns, generation=gen)
                lane_err = code_of(a.lookup, other, ids)
                assert lane_err == code_of(a_grpc.lookup, other, ids), gen
                assert lane_err[0] != grpc.StatusCode.UNKNOWN
            bad = agent_pb2.LookupRequest(ns=ns.ref, block_ids=b"x" * 17)
            want = code_of(a_grpc.stub.Lookup, bad, None, A_MD)
        lane_ch = LaneChannel(socket_path(agent.address, TOKENS["acme"]), A_MD)
        try:
            got = code_of(lane_ch.call, lane.LOOKUP, bad, agent_pb2.LookupResponse)
        finally:
            lane_ch.close()
        assert got == want and got[0] == grpc.StatusCode.INVALID_ARGUMENT
        # B's packed chain Put naming A's staging region is refused (as any use of a
        # region by another tenant: region ids are random 64-bit numbers), with the
        # answer an unknown one gets (no oracle for live ids); nothing of A's memory is
        # stored for B.
        ns_b = b.open_namespace(dataclasses.replace(SPEC, tenant="beta"))
        ids_b = b.block_ids(ns_b, prompt_tokens(5, 2 * BS))
        for region, code in (
            (a._region_id, grpc.StatusCode.NOT_FOUND),
            (987654321, grpc.StatusCode.NOT_FOUND),
        ):
            steal = agent_pb2.PutRequest(
                ns=ns_b.ref,
                shm_region_id=region,
                root=ns_b.root,
                chain_ids=b"".join(ids_b),
                chain_parent_id=ns_b.root,
                chain_stride=SPEC.block_bytes,
            )
            assert code_of(b._lane.call, lane.PUT, steal, agent_pb2.PutResponse)[0] == code
        assert b.lookup(ns_b, ids_b).matched == 0
        # A's blocks are intact after all of that.
        assert all(torch.equal(x, y) for x, y in zip(a.get(ns, ids), blocks))


def test_lane_needs_a_token_like_grpc(spawn_agent):
    agent = spawn_agent(allow_unauthenticated=False, tenants=tenants())
    path = socket_path(agent.address, TOKENS["acme"])
    assert os.path.dirname(path) == "/dev/shm"
    with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a", use_shm=False) as a:
        ns = a.open_namespace(SPEC)
    req = agent_pb2.LookupRequest(ns=ns.ref, block_ids=bytes(16))
    for meta in ((), (("authorization", "Bearer wrong"),)):
        ch = LaneChannel(path, meta)
        try:
            code, details = code_of(ch.call, lane.LOOKUP, req, agent_pb2.LookupResponse)
        finally:
            ch.close()
        assert code == grpc.StatusCode.UNAUTHENTICATED, details


def test_bad_frames_get_precise_errors_and_lose_nothing(spawn_agent):
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        ns = c.open_namespace(SPEC)
        ids = c.block_ids(ns, prompt_tokens(5, 2 * BS))
        blocks = blocks_for(5, 2)
        c.put(ns, ids, blocks)
        path = socket_path(agent.address)
        code = lambda sc: sc.value[0]  # noqa: E731
        lookup = agent_pb2.LookupRequest(ns=ns.ref, block_ids=b"".join(ids)).SerializeToString()
        cases = [
            (lane.request_frame(99, b"", lookup), grpc.StatusCode.UNIMPLEMENTED, b"method 99"),
            (
                lane.request_frame(lane.LOOKUP, b"no-equals-sign", lookup),
                grpc.StatusCode.INVALID_ARGUMENT,
                b"metadata",
            ),
            (
                lane.request_frame(lane.LOOKUP, b"", b"\xff\xff\xff"),
                grpc.StatusCode.INVALID_ARGUMENT,
                b"does not parse",
            ),
            (
                lane.request_frame(
                    lane.GET,
                    b"",
                    agent_pb2.GetRequest(ns=ns.ref, block_ids=b"".join(ids)).SerializeToString(),
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                b"shared-memory Gets only",
            ),
            (
                lane.REQUEST_HEADER.pack(lane.MAX_FRAME_BYTES + 1, lane.LOOKUP, 0),
                grpc.StatusCode.INVALID_ARGUMENT,
                b"refused",
            ),
        ]
        for frame, want, text in cases:
            status, body = raw_call(path, frame)
            assert status == code(want) and text in body, (want, body)
        # A header with a length that never arrives, then a hang-up: nothing breaks.
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(lane.REQUEST_HEADER.pack(1000, lane.LOOKUP, 0) + b"partial")
        assert c.lookup(ns, ids).matched == 2
        assert all(torch.equal(x, y) for x, y in zip(c.get(ns, ids), blocks))


def test_broken_lane_reconnects_to_the_restarted_agent(spawn_agent):
    agent = spawn_agent(default_policy={"persist": True})
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        ns = c.open_namespace(SPEC)
        ids = c.block_ids(ns, prompt_tokens(6, 3 * BS))
        c.put(ns, ids, blocks_for(6, 3))
        assert c.uses_local_lane
        old_socket = c.local_socket
        agent.restart()  # the lane's connection dies with the old process
        assert c.lookup(ns, ids).matched == 3  # answered by the new process
        # The client registered with the new process and is on its lane again.
        assert c.uses_local_lane and c.local_socket != old_socket
        assert c.reregistrations == 1
        calls = dict(c.stats().counters)["local_lane_calls"]
        assert all(torch.equal(a, b) for a, b in zip(c.get(ns, ids), blocks_for(6, 3)))
        assert dict(c.stats().counters)["local_lane_calls"] == calls + 1


def test_lane_channel_reports_a_connection_cut_mid_answer(tmp_path):
    """A fault-injecting server: reads the request, answers half a frame, hangs up."""
    path = str(tmp_path / "cut.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def cut() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(lane.response_frame(lane.OK, b"lane-id"))  # the greeting
            conn.recv(1 << 16)
            conn.sendall(lane.RESPONSE_HEADER.pack(100, lane.OK) + b"half")

    server = threading.Thread(target=cut)
    server.start()
    ch = LaneChannel(path)
    try:
        req = agent_pb2.LookupRequest(block_ids=bytes(16))
        with pytest.raises(LaneBroken, match="closed the local lane"):
            ch.call(lane.LOOKUP, req, agent_pb2.LookupResponse)
        with pytest.raises(LaneBroken):  # the channel is closed for good, not desynced
            ch.call(lane.LOOKUP, req, agent_pb2.LookupResponse)
    finally:
        ch.close()
        server.join(10)
        srv.close()


def test_lane_error_is_an_rpc_error():
    err = LaneError(grpc.StatusCode.NOT_FOUND, "no such namespace")
    assert isinstance(err, grpc.RpcError)
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no such namespace")


def test_meta_encoding_round_trips_and_refuses_newlines():
    pairs = (("authorization", "Bearer t=1"), ("traceparent", "00-ab-cd-01"))
    assert lane.decode_meta(lane.encode_meta(pairs)) == pairs
    assert lane.decode_meta(b"") == ()
    with pytest.raises(ValueError):
        lane.encode_meta((("authorization", "Bearer a\nb"),))


def test_get_tiered_names_the_tier_of_each_block_on_every_path(spawn_agent):
    agent = spawn_agent(pool_bytes=f"{8 * 64}KiB")  # 8 slots: a second prompt spills the first
    with (
        KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c,
        KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as g,
    ):
        assert c.uses_local_lane
        ns, ns_g = c.open_namespace(SPEC), g.open_namespace(SPEC)
        ids_a, blocks_a = c.block_ids(ns, prompt_tokens(7, 6 * BS)), blocks_for(7, 6)
        c.put(ns, ids_a, blocks_a)
        c.put(ns, c.block_ids(ns, prompt_tokens(8, 6 * BS)), blocks_for(8, 6))
        before = c.lookup(ns, ids_a)
        assert before.matched == 6 and before.nvme > 0  # some of A now lives on NVMe only
        got = c.get_tiered(ns, ids_a)
        assert all(torch.equal(x, y) for x, y in zip(got.blocks, blocks_a))
        assert len(got.tiers) == len(got.blocks) == 6
        assert (got.tiers.count(Tier.HBM), got.tiers.count(Tier.NVME)) == (before.hbm, before.nvme)
        assert got.tiers == sorted(got.tiers)  # the pool holds prefixes: HBM blocks lead
        # The gRPC stream reports tiers too (A was promoted by the Get above).
        now = g.lookup(ns_g, ids_a)
        again = g.get_tiered(ns_g, ids_a)
        assert all(torch.equal(x, y) for x, y in zip(again.blocks, blocks_a))
        assert (again.tiers.count(Tier.HBM), again.tiers.count(Tier.NVME)) == (now.hbm, now.nvme)


def test_stale_sockets_of_killed_agents_are_removed(tmp_path):
    from node_agent.local_lane import remove_stale_sockets

    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "kvstore-agent-1-dead.sock"))
    dead.close()  # bound, never listening: what a SIGKILLed agent leaves behind
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "kvstore-agent-2-live.sock"))
    live.listen(1)
    (tmp_path / "other.sock").write_text("")  # not ours: never touched
    try:
        assert remove_stale_sockets(str(tmp_path)) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "kvstore-agent-2-live.sock",
            "other.sock",
        ]
    finally:
        live.close()
