"""`pdserve`: one console script for every part.

    pdserve generate "..."     raw completion, offline          pdserve chat "..."   through the chat template
    pdserve up                 router + prefill + decode on localhost (or --colocated --policy X)
    pdserve router|prefill|decode   one part each, for separate hosts
    pdserve bench ...          the TTFT/TBT SLO benchmark
    pdserve env                every environment variable pdserve reads

Every option `--foo-bar` defaults to the environment variable PDSERVE_FOO_BAR when it is set.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.bench import cli as bench_cli
from pdserve.config import envs
from pdserve.config.engine import (
    ConfigError,
    add_engine_arguments,
    add_policy_arguments,
    engine_config,
)
from pdserve.config.envs import flag_default
from pdserve.config.names import COLOCATED_POLICIES
from pdserve.decode_node import cli as decode_cli
from pdserve.prefill_node import cli as prefill_cli
from pdserve.router import cli as router_cli
from pdserve.up import register as register_up


def _apply_threads(args) -> None:
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)


def _cmd_generate(args, chat: bool) -> int:
    from pdserve.engine.llm import LLM
    from pdserve.model.weights import ModelLoadError
    from pdserve.protocol.sampling import SamplingParams

    _apply_threads(args)
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                  seed=args.seed).validate()
        llm = LLM(config=engine_config(args))
    except (ConfigError, ModelLoadError, ValueError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    prompt = [{"role": "user", "content": args.prompt}] if chat else args.prompt
    out = llm.generate(prompt, sampling, use_tqdm=False)[0]
    print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default=flag_default("log-level", "WARNING"), help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, chat in (("generate", False), ("chat", True)):
        p = sub.add_parser(name, help="chat through the model's template, offline" if chat else "raw completion, offline",
                           description=f"Print the model's {'reply' if chat else 'continuation'} to PROMPT (nothing else on stdout).")
        p.add_argument("prompt", help="the user message" if chat else "the text to continue")
        p.add_argument("--max-tokens", type=int, default=flag_default("max-tokens", 256 if chat else 64))
        p.add_argument("--temperature", type=float, default=flag_default("temperature", 0.0), help="0: greedy")
        p.add_argument("--top-p", type=float, default=flag_default("top-p", 1.0))
        p.add_argument("--seed", type=int, default=flag_default("seed", 0) or None)
        add_policy_arguments(p, COLOCATED_POLICIES)
        add_engine_arguments(p)
        p.set_defaults(func=lambda a, chat=chat: _cmd_generate(a, chat))
    _register_service_commands(sub)
    p = sub.add_parser("env", help="every environment variable pdserve reads, and what it sets",
                       description="Every flag's PDSERVE_* twin, and the variables that are not flags (config/envs.py).")
    p.set_defaults(func=_cmd_env)
    return parser


def _cmd_env(args) -> int:
    for name, meaning in envs.registered().items():
        print(f"{name:34s} {meaning}")
    return 0


def _register_service_commands(sub) -> None:
    for register in (router_cli.register, prefill_cli.register, decode_cli.register, register_up, bench_cli.register):
        register(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
