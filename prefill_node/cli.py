"""`pdserve prefill`: one prefill worker."""

from __future__ import annotations

from engine.engine import Engine
from engine.worker_cli import add_worker_arguments, serve
from prefill_node.worker import PrefillWorker


def register(sub) -> None:
    p = sub.add_parser("prefill", help="run one prefill worker",
                       description="Prefill worker: builds each prompt's KV cache and first token, "
                                   "then ships the KV to the decode worker the router names.")
    add_worker_arguments(p, kv_port=0, health_port=8101, transports="tcp,shm")
    p.set_defaults(func=lambda a: serve(lambda opts, cfg: PrefillWorker(opts, Engine(cfg, "prefill")), a))
