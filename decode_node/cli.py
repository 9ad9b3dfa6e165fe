"""`pdserve decode`: one decode worker (disaggregated) or one colocated worker."""

from __future__ import annotations

from decode_node.worker import ColocatedWorker, DecodeWorker
from engine.engine import Engine
from engine.envs import env_default
from engine.policies import COLOCATED_POLICIES
from engine.worker_cli import add_worker_arguments, serve


def _factory(mode: str):
    def make(opts, cfg):
        if mode == "disaggregated":
            return DecodeWorker(opts, Engine(cfg, "decode"))
        return ColocatedWorker(opts, Engine(cfg, "colocated"))

    return make


def register(sub) -> None:
    p = sub.add_parser("decode", help="run one decode worker (or a colocated one)",
                       description="Decode worker: continuous batching over requests whose KV arrives from "
                                   "prefill workers. With --mode colocated it takes raw prompts and prefills "
                                   "them itself under --policy (the baseline).")
    p.add_argument("--mode", default=env_default("mode", "disaggregated"), choices=["disaggregated", "colocated"])
    p.add_argument("--policy", default=env_default("policy", "chunked"), choices=list(COLOCATED_POLICIES),
                   help="batching policy in colocated mode")
    p.add_argument("--waiting-served-ratio", type=float, default=env_default("waiting-served-ratio", 0.0),
                   help="TGI's ratio: prompts interrupt decoding only when waiting >= ratio * running")
    add_worker_arguments(p, kv_port=5601, health_port=8102, transports="tcp")
    p.set_defaults(func=lambda a: serve(_factory(a.mode), a, a.policy))
