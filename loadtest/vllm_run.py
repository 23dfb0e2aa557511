"""Run vLLM (CPU, offline) on a plan of engines and prompts; print one JSON line per event.

Runs in the vLLM venv (`make vllm-env`), never inside pytest: vLLM changes torch's thread
count and binds OpenMP threads. Engines run one after another in this one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor), so several cost one start-up.

    .venv-vllm/bin/python -m loadtest.vllm_run plan.json

plan.json: {"model": DIR, "tiny": {write_tiny_llama arguments} (optional),
"block_size": 32, "engines": [{"kvstore": {extra config} | null, "prefix_caching": false,
"connector": {KVTransferConfig fields} (instead of "kvstore"), "may_fail": false (a start
failure prints {"event": "engine_failed", ...} and the run goes on), "kv_events":
{KVEventsConfig fields} (publish KV events), "num_blocks": n (KV cache blocks, to force
evictions), "namespace": {connector extra config} (prints {"event": "namespace", "spec":
...}, the namespace the connector derives for this engine), "batches": [STEP, ...]}, ...]}.
A STEP is one of:
- a batch, [{"prompt": [ids], "salt": s | null, "max_tokens": n, "params": {...}
  (optional: the request's kv_transfer_params)}, ...], generated greedily
  in one `generate` call; prints {"event": "batch", "engine": i, "outputs": [{"tokens":
  [...], "cached": n}, ...], "wall_ms": t};
- {"drain": true}: wait until the connector's queued saves reached the agent;
- {"wait": NAME}: print {"event": "wait", "name": NAME} and block until a line arrives on
  stdin (the driver kills the agent or flips the kill switch meanwhile).
After an engine's steps its queued saves are drained before the next engine starts.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def make_engine(plan: dict, spec: dict):
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kv = None
    if spec.get("kvstore") is not None:
        kv = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=spec["kvstore"],
        )
    elif spec.get("connector") is not None:  # another connector, e.g. vLLM's offloading one
        kv = KVTransferConfig(kv_role="kv_both", **spec["connector"])
    return LLM(
        model=plan["model"],
        dtype=plan.get("dtype", "float32"),
        block_size=plan.get("block_size", 32),
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=plan.get("max_len", 2048),
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        kv_transfer_config=kv,
        kv_events_config=KVEventsConfig(**spec["kv_events"]) if spec.get("kv_events") else None,
        num_gpu_blocks_override=spec.get("num_blocks"),
        seed=0,
    )


def emit_namespace(llm, extra: dict) -> None:
    """The namespace the kvstore connector derives from this engine's configuration."""
    import vllm

    from kvstore.integrations.vllm_config import ConnectorSettings, engine_namespace

    settings = ConnectorSettings.from_extra(extra)
    spec = engine_namespace(llm.llm_engine.vllm_config, settings, 0, vllm.__version__)
    emit({"event": "namespace", "engine": -1, "spec": spec.to_dict()})


def run_batch(llm, batch: list[dict]) -> list[dict]:
    from vllm import SamplingParams

    prompts, params = [], []
    for r in batch:
        p = {"prompt_token_ids": list(r["prompt"])}
        if r.get("salt"):
            p["cache_salt"] = r["salt"]
        prompts.append(p)
        extra = {"kv_transfer_params": r["params"]} if r.get("params") else None
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=r.get("max_tokens", 8),
                ignore_eos=True,
                extra_args=extra,
            )
        )
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        {"tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0)}
        for o in outs
    ]


def drain_saves() -> None:
    """Wait until the kvstore connector's queued saves reached the agent."""
    from vllm.distributed import kv_transfer

    if kv_transfer.has_kv_transfer_group():
        conn = kv_transfer.get_kv_transfer_group()
        if hasattr(conn, "drain_saves"):
            conn.drain_saves()


def drain_and_close(llm) -> None:
    from vllm.distributed import kv_transfer

    drain_saves()
    # The connector is a process-wide singleton: a next engine must build its own.
    kv_transfer.ensure_kv_transfer_shutdown()
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        try:
            engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort between engines
            pass
    del llm
    release_process_state()


def release_process_state() -> None:
    """What an engine leaves behind in the process (the connector singleton, the
    distributed groups), released so that the next engine can start."""
    from vllm.distributed import kv_transfer
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    gc.collect()
    kv_transfer.ensure_kv_transfer_shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()


def main() -> None:
    # vLLM's file store and IPC sockets in a directory of this run's, removed at its end
    # (kvstore/integrations/engine_tmp.py); tempfile caches the directory it first found
    from kvstore.integrations.engine_tmp import engine_env, engine_tmpdir

    with engine_tmpdir() as tmp:
        os.environ.update(engine_env(tmp))
        tempfile.tempdir = tmp or tempfile.tempdir
        run(json.loads(open(sys.argv[1]).read()))


def run(plan: dict) -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if plan.get("tiny") is not None:  # build the model first (kept when already there)
        from loadtest.vllm_model import write_tiny_llama

        write_tiny_llama(plan["model"], **plan["tiny"])
    for i, spec in enumerate(plan["engines"]):
        t0 = time.monotonic()
        try:
            llm = make_engine(plan, spec)
        except Exception as exc:  # noqa: BLE001 - reported, the next engine still runs
            if not spec.get("may_fail"):
                raise
            emit(
                {
                    "event": "engine_failed",
                    "engine": i,
                    "reason": f"{type(exc).__name__}: {str(exc)[:300]}",
                }
            )
            release_process_state()
            continue
        emit({"event": "engine", "engine": i, "start_s": round(time.monotonic() - t0, 2)})
        if spec.get("namespace") is not None:
            emit_namespace(llm, spec["namespace"])
        for batch in spec["batches"]:
            if isinstance(batch, dict) and batch.get("drain"):
                drain_saves()
                continue
            if isinstance(batch, dict):
                emit({"event": "wait", "name": batch["wait"]})
                sys.stdin.readline()
                continue
            t0 = time.perf_counter()
            outputs = run_batch(llm, batch)
            emit(
                {
                    "event": "batch",
                    "engine": i,
                    "outputs": outputs,
                    "wall_ms": (time.perf_counter() - t0) * 1000,
                }
            )
        drain_and_close(llm)
    emit({"event": "done"})


if __name__ == "__main__":
    main()
