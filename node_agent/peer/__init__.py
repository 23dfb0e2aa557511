"""Peer-to-peer block transfer between node agents: UCX (ucxx) first, gRPC as fallback.

Agent A is asked (Peer.Prefetch) to pull the blocks of a prompt it lacks from agent B:

- UCX: A connects to B's listener (`AgentServer.peer_address`, host:port) and sends a
  FetchRequest. B answers per batch with a FetchChunk header (first index, count, XXH64 of
  each payload) followed by the payloads: for large blocks one tag message per run of
  blocks that lie back to back in B's pool (the header's `runs`; slots filled one after
  another usually do), ONE message holding the whole batch back to back for small ones
  (node_agent/peer/ucx/wire.packed: per-message costs would dominate, and copying a few hundred KiB
  costs tens of µs). Each message costs a round of thread hand-offs on both sides (UCX
  progress thread, ucxx notifier, event loop), which on a small host cost more than the
  copy of a 2 MiB block.
  Nobody closes before A's acknowledgement of the end of the answer (closing first could
  drop the other side's last messages); after it A keeps the connection for its next
  request to B. UCX keeps same-tag messages between two endpoints in order, so headers
  and payloads pair up by position. On one host UCX moves the payloads with one CMA read
  from B's memory into A's (node_agent/peer/ucx/wire.init_ucx), elsewhere over TCP.
- Direct reads (agents of one host, same PID namespace: node_agent/peer/ucx/direct.py):
  A's FetchRequest offers its host identity; when B's matches, B's chunk headers of large
  blocks name where each borrowed block lies in B's memory and no payload message
  follows. A reads them itself into its reserved slots (process_vm_readv, several threads,
  each block hashed as it lands), sends a release message for it once read (B ends
  the borrow), and stores it; the acknowledgement follows the last release. When the
  blocks all lie in B's host pool (a sealed memfd), the header names it too and A copies
  them out of a read-only mapping of it instead, one fused copy+hash pass
  (node_agent/peer/ucx/mapped.py).
- gRPC: Peer.FetchBlocks (node_agent/peer/grpc_transport.py) streams the same chunks with the
  payloads inline. A uses it when UCX is off or failed to import, when the peer has no UCX
  address, and when a UCX transfer fails midway (it resumes after the blocks stored).

Large blocks, no copies on either side over UCX (host-memory pools; GPU pools too when
the device hash and a UCX built with CUDA are there, UcxTransport.in_place): B sends from
borrowed read-only views of its pool slots (BlockStore.borrow: the blocks cannot be
evicted nor their slots reused until the sends are done; not re-verified, since A checks
every payload end to end), copying into staging buffers only blocks that sit on NVMe. A
receives into pool slots it reserved (BlockStore.reserve), one run per message when the
slots it reserved for that run lie back to back too (else the batch lands in a staging
buffer and is copied into the slots in the verifying pass, as for small blocks), hashes
each message's payloads as soon as it lands, and only makes blocks whose hash matches
B's checksum visible (BlockStore.commit); a mismatching block is not stored, and it and
the rest of the chain are a miss. Small blocks: B copies the borrowed blocks into a
staging buffer (and ends the borrow at once), A receives the batch into a staging buffer
and fills the reserved slots with one fused copy + checksum pass before committing.
Batches are sized in bytes (kvstore.config.PeerConfig.batch_bytes), so small blocks
also travel in few batches. Both sides pipeline: B borrows batch k+1 while batch k is on the wire; A
reserves the first batch's slots while its request travels to B, and the slots and
receives of batch k+1 before it commits batch k (a batch hashed as it landed is committed
on the event loop: bookkeeping only, cheaper than two thread hand-offs).

Every await on the network has a timeout, and a Prefetch has an overall deadline, so a
dead or frozen peer turns the missing blocks into a miss in bounded time. Concurrent
Prefetches of the same blocks are de-duplicated: the first claims a block, later ones wait
for its outcome instead of transferring it again.

The package (collaborators are passed explicitly: store, staging, config, counters):

- transport.py: the Transport interface; ucx/ (UcxTransport: listener, UcxServer,
  UcxFetcher, wire framing) and grpc_transport.py (GrpcTransport, PeerServicer) implement it.
- serve.py: BlockSource, the serving side every transport reads from (validated request,
  borrowed or staged batches, read ahead).
- sink.py: BatchSink, the fetching side every transport writes into (chain order, one
  store step in flight, verified before anything is visible).
- prefetch.py + claims.py: Prefetch (claims, waits on concurrent fetches, transports in
  order of preference); requests.py: namespace, ids and access checks of both sides.
- service.py: PeerTransfer, the composition root the agent holds.
"""
