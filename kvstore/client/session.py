"""A client's session with one agent (the base of KVClient): its gRPC channel, and on
the same host its shared-memory staging area and local lane, registered at start and
again after the agent restarts; every call by a deadline, over the lane when there is
one, retried once after registering again. The calls themselves: kvstore/client/__init__.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self

import grpc
import numpy as np
import torch

from kvstore import lane
from kvstore.client.device_staging import DeviceStaging, allocate_device_staging, close_quietly
from kvstore.client.errors import DeadlineExceeded, KVClientError, StagingGone, from_rpc
from kvstore.client.local_lane import AnswerGone, LaneBroken, LaneChannel, LaneDeadline
from kvstore.client.staging import Staging, create_staging
from kvstore.config import TLSConfig
from kvstore.errors import KvError
from kvstore.telemetry import traced_channel
from kvstore.tls import channel, client_tls
from kvstore.v1 import agent_pb2, agent_pb2_grpc, peer_pb2_grpc

MiB = 1 << 20
# Smallest staging area worth having: below it (a tiny /dev/shm) payloads go over gRPC.
STAGING_FLOOR = 16 * MiB
DEFAULT_TIMEOUT_S = 10.0
log = logging.getLogger("kvstore.client")


class _Stale(Exception):
    """This agent process does not know our registration: register again, then retry."""

    def __init__(self, error: KVClientError) -> None:
        super().__init__(error.details())
        self.error = error


class AgentSession:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        tenant_secret: str | bytes | None = None,
        use_shm: bool | None = None,
        shm_bytes: int = 256 * MiB,
        max_message_bytes: int = 64 * MiB,
        local_lane: bool = True,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TLSConfig | str | None = None,
    ) -> None:
        """`timeout`: the deadline of each RPC, in seconds (methods that take a
        `timeout` override it per call). `tls`: mTLS to the agent, a TLSConfig (CA,
        client certificate, key) or a directory holding ca.crt, client.crt and
        client.key (what `kvctl cluster up --tls` writes under <state>/tls)."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.address = address
        self.tenant_secret = tenant_secret
        self.timeout = timeout
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = client_tls(tls)
        self.channel = traced_channel(
            channel(
                address,
                self.tls,
                [
                    ("grpc.max_send_message_length", max_message_bytes),
                    ("grpc.max_receive_message_length", max_message_bytes),
                ],
            )
        )
        self.stub = agent_pb2_grpc.NodeAgentStub(self.channel)
        self.peer_stub = peer_pb2_grpc.PeerStub(self.channel)
        self._shm: Staging | None = None
        self._staging: np.ndarray | None = None
        self._region_id = 0
        self._chain_puts = False  # the agent takes PutRequest.chain_ids (RegisterShm says)
        # The lane connection our region was registered over (it lives as long as this
        # connection); data calls use it too unless local_lane=False.
        self._lane: LaneChannel | None = None
        self._lane_ok = local_lane
        self._stale = False  # the lane broke or timed out: register again before a call
        self._staging_gone = ""  # why the agent refused our staging again, once it has
        self._session_lock = threading.Lock()
        self.reregistrations = 0  # times this client registered again (agent restarts)
        self._staging_cache: dict[tuple, torch.Tensor] = {}
        self._device: DeviceStaging | None = None  # attach_device_staging
        self._slot_view_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.local_socket = ""  # the agent's local-lane socket, when it offered one
        if use_shm is not False:
            self._try_shm(shm_bytes, required=bool(use_shm))

    # ---------------------------------------------------------------- plumbing
    def _try_shm(self, size: int, required: bool) -> None:
        shm = create_staging(size, min(size, STAGING_FLOOR))
        if shm is None:
            if required:
                raise KVClientError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"shared memory cannot hold a staging area of {size} bytes",
                )
            return
        arr = shm.array  # populated: no page faults during the first transfer
        self._shm, self._staging = shm, arr
        try:
            self._register(time.monotonic() + self.timeout)
        except KVClientError as exc:
            self._shm, self._staging = None, None
            del arr
            shm.close()
            if required or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.info("no shared memory with agent %s: %s", self.address, exc.details())
            return

    def _register(self, deadline: float) -> None:
        """Register our region with the agent (again, after a restart): connect to its
        local lane and hand over the staging memory's descriptor. FAILED_PRECONDITION
        when there is no lane to reach (another host, no lane, refused)."""
        shm = self._shm
        if shm is None:
            raise RuntimeError("register needs the shared-memory staging area")
        try:
            where = self._grpc(self.stub.LocalLane, agent_pb2.LocalLaneRequest(), deadline)
        except KVClientError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # an agent from before lanes
                raise
            where = agent_pb2.LocalLaneResponse()
        if not where.socket:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "the agent runs no local lane")
        try:
            ch = LaneChannel(
                where.socket, self._md, max(0.01, deadline - time.monotonic()), where.lane_id
            )
        except (OSError, KVClientError) as exc:  # another host, or the lane refused us
            raise KVClientError(
                grpc.StatusCode.FAILED_PRECONDITION, f"local lane {where.socket}: {exc}"
            ) from None
        try:
            resp = ch.call(
                lane.REGISTER,
                agent_pb2.RegisterShmRequest(size=shm.size),
                agent_pb2.RegisterShmResponse,
                deadline - time.monotonic(),
                fds=(shm.fd,),
            )
        except KVClientError as exc:
            ch.close()
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the agent's caps on lane
                # connections and registered bytes: no shared memory, payloads over gRPC
                raise KVClientError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"local lane {where.socket}: {exc.details()}",
                ) from None
            raise
        except LaneBroken as exc:  # the agent went away mid-registration
            ch.close()
            raise KVClientError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        self._region_id, self.local_socket, self._lane = resp.region_id, where.socket, ch
        self._chain_puts = resp.chain_puts
        if self._device is not None:  # after an agent restart: lend it again
            self._device.region_id = self._register_device(self._device, deadline)
        self._stale = False

    def _register_device(self, dev: DeviceStaging, deadline: float) -> int:
        """Lend device staging `dev` to the agent over our lane connection (it lives as
        long as that connection); its region id."""
        if self._lane is None:
            raise KVClientError(grpc.StatusCode.FAILED_PRECONDITION, "no local lane to the agent")
        fd = dev.export_fd()
        try:
            resp = self._lane.call(
                lane.REGISTER,
                agent_pb2.RegisterShmRequest(size=dev.size, device_uuid=dev.uuid),
                agent_pb2.RegisterShmResponse,
                deadline - time.monotonic(),
                fds=(fd,),
            )
        except LaneBroken as exc:
            raise KVClientError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        finally:
            close_quietly(fd)
        return resp.region_id

    def attach_device_staging(
        self, device: torch.device | str, nbytes: int, timeout: float | None = None
    ) -> str:
        """Lend the agent `nbytes` of staging memory on GPU `device`, so that
        `get_device_staged_tensor` serves blocks there, copied from the agent's pool on
        that GPU device to device. Returns '' once attached, else why not (no CUDA, no
        local lane, the agent's pool in host memory or on another GPU): host staging
        still serves, as before."""
        if self._device is not None:
            return ""
        if not self.uses_local_lane:
            return "no local lane to the agent (another host, or local_lane=False)"
        try:
            dev = allocate_device_staging(device, nbytes)
        except KvError as exc:  # no CUDA or driver, not a CUDA device, no size
            return str(exc)
        try:
            dev.region_id = self._register_device(dev, self._deadline(timeout))
        except KVClientError as exc:
            dev.close()
            if exc.code() in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            ):
                return exc.details() or exc.code().name
            raise
        self._device = dev
        return ""

    @property
    def uses_device_staging(self) -> bool:
        return self._device is not None

    def _reregister(self, deadline: float) -> None:
        """The agent lost our registration (it restarted) or the lane broke: close the
        old connection (the agent drops the region with it), then register again. When
        the agent refuses (FAILED_PRECONDITION: one of its caps, or no lane any more),
        give the staging area up and go on over gRPC, as a client refused at start does."""
        with self._session_lock:
            self._drop_lane()
            self._stale = True  # until registered: a failure here is tried again next call
            try:
                self._register(deadline)
            except KVClientError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self._give_up_staging(exc.details())
                return
            self.reregistrations += 1
        log.info(
            "registered again with agent %s (region %d, lane %s)",
            self.address,
            self._region_id,
            "on" if self.uses_local_lane else "off",
        )

    def _give_up_staging(self, why: str) -> None:
        log.warning(
            "agent %s refused our shared memory again (%s): payloads go over gRPC from now on",
            self.address,
            why,
        )
        self._staging_gone = why
        self._stale = False
        self._region_id = 0
        self._close_staging()

    def _need_staging(self, what: str) -> None:
        if self._staging is None:
            if self._staging_gone:
                raise StagingGone(f"{what}: no shared memory any more ({self._staging_gone})")
            raise RuntimeError(f"{what} needs the same-host shared-memory path")

    def _drop_lane(self) -> None:
        if self._lane is not None:
            self._lane.close()
            self._lane = None

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _grpc(self, fn, request, deadline: float):
        """One unary (or client-streaming) stub call by `deadline`, errors as ours."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"{self.address}: the deadline passed before the call")
        try:
            return fn(request, metadata=self._md, timeout=left)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None

    @property
    def uses_shm(self) -> bool:
        return self._shm is not None

    @property
    def uses_local_lane(self) -> bool:
        return self._lane is not None and self._lane_ok

    def _call(self, method: int, build, response_type, grpc_call, timeout: float | None = None):
        """`build(deadline)`'s request over the local lane when there is one, else over
        gRPC; once more after registering again when the agent lost our registration
        (calls are idempotent). `build` runs per attempt: the region id may change.
        `deadline`: the call's, on time.monotonic()'s clock."""
        deadline = self._deadline(timeout)
        if self._stale and self._shm is not None:
            self._reregister(deadline)
        try:
            return self._attempt(method, build(deadline), response_type, grpc_call, deadline)
        except _Stale:
            self._reregister(deadline)
        try:
            return self._attempt(method, build(deadline), response_type, grpc_call, deadline)
        except _Stale as exc:
            raise exc.error from None

    def _attempt(self, method: int, request, response_type, grpc_call, deadline: float):
        lane_ch = self._lane if self._lane_ok else None
        if lane_ch is not None:
            with self._lane_errors():
                return lane_ch.call(method, request, response_type, deadline - time.monotonic())
        try:
            return self._grpc(grpc_call, request, deadline)
        except KVClientError as exc:
            if exc.unknown_region and self._shm is not None:
                raise _Stale(exc) from None
            raise

    @contextmanager
    def _lane_errors(self) -> Iterator[None]:
        """A lane call's failures as the client handles them: _Stale (register again and
        retry) for a broken lane or an agent that lost our region."""
        try:
            yield
        except AnswerGone:
            raise
        except LaneBroken as exc:  # e.g. the agent restarted
            self._drop_lane()
            raise _Stale(KVClientError(grpc.StatusCode.UNAVAILABLE, str(exc))) from None
        except DeadlineExceeded as exc:
            if not isinstance(exc, LaneDeadline):  # no answer came: out of step
                self._drop_lane()  # reconnect on the next call
                self._stale = True
            raise
        except KVClientError as exc:
            if exc.unknown_region:
                raise _Stale(exc) from None
            raise

    def close(self) -> None:
        self._drop_lane()  # the agent drops our regions with the connection
        self._close_staging()
        self.channel.close()

    def _close_staging(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None
        if self._shm is not None:
            self._staging = None
            self._staging_cache.clear()
            self._slot_view_cache.clear()
            self._shm.close()
            self._shm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
