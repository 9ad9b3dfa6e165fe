"""`pdserve prefill`: one prefill worker."""

from __future__ import annotations

from pdserve.config.worker import add_worker_arguments
from pdserve.worker.serve import serve


def register(sub) -> None:
    p = sub.add_parser("prefill", help="run one prefill worker",
                       description="Prefill worker: builds each prompt's KV cache and first token, "
                                   "then ships the KV to the decode worker the router names.")
    add_worker_arguments(p, kv_port=0, health_port=8101, transports="tcp,shm")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from pdserve.prefill_node.worker import PrefillWorker  # torch: only when a worker runs

    return serve(PrefillWorker.create, args)
