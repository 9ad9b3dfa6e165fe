"""`pdserve decode`: one decode worker (disaggregated) or one colocated worker."""

from __future__ import annotations

from pdserve.config.engine import add_policy_arguments
from pdserve.config.envs import flag_default
from pdserve.config.names import COLOCATED_POLICIES
from pdserve.config.worker import add_worker_arguments
from pdserve.worker.serve import serve


def register(sub) -> None:
    p = sub.add_parser("decode", help="run one decode worker (or a colocated one)",
                       description="Decode worker: continuous batching over requests whose KV arrives from "
                                   "prefill workers. With --mode colocated it takes raw prompts and prefills "
                                   "them itself under --policy (the baseline).")
    p.add_argument("--mode", default=flag_default("mode", "disaggregated"), choices=["disaggregated", "colocated"])
    add_policy_arguments(p, COLOCATED_POLICIES)
    add_worker_arguments(p, kv_port=5601, health_port=8102, transports="tcp")
    p.set_defaults(func=_run)


def _run(args) -> int:
    # torch and the model runtime load only when a worker runs, not for --help
    if args.mode == "disaggregated":
        from pdserve.decode_node.worker import DecodeWorker

        return serve(DecodeWorker.create, args)
    from pdserve.worker.colocated import ColocatedWorker

    return serve(ColocatedWorker.create, args)
