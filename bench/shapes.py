"""Real models' shapes with random weights: Hugging Face directories to benchmark serving on
models larger than the CPU's cache, without downloading one.

    python -m pdserve.bench.shapes list
    python -m pdserve.bench.shapes write qwen2.5-0.5b OUT_DIR

A shape is a model's exact architecture (its config.json: layers, widths, heads, vocabulary,
tied embeddings, rotary parameters) with weights drawn at random (normal, std 0.02; norms 1,
biases 0), saved as bfloat16 safetensors through transformers. What a step costs depends on those
shapes and not on the values, so a server's speed on the directory is its speed on the model.
The tokenizer and chat template are SmolLM2's (49,152 tokens, read from the default model), and
each shape keeps its own model's vocabulary size: the embedding and LM head rows past the
tokenizer's are zeros, so their logits are 0 and greedy decoding, which is what the benchmark
asks for, never picks a token the tokenizer cannot decode; the LM head still multiplies every
row. Prompts must use the tokenizer's ids only (`pdserve bench --tokenizer` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pdserve.text.loader import load_tokenizer
from pdserve.text.tokenizer import Tokenizer

SHAPE_FILE = "shape.json"  # the shape a directory was written with: `write` skips an identical one
INIT_STD = 0.02  # small enough that activations stay in range through every layer
SHARD_SIZE = "512MB"  # several shards, so transformers' bar over them shows the writing progress
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True, slots=True)
class Shape:
    """One model's architecture as its config.json states it; `hidden` shapes are for smoke
    runs and stay out of `list`."""

    name: str
    model_type: str  # transformers' config class: "llama", "qwen2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    hidden: bool = False

    @property
    def architecture(self) -> str:
        return _ARCHITECTURES[self.model_type]

    def config_kwargs(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """transformers config arguments (the pre-5 names, which 5.x converts: either reads them)."""
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            tie_word_embeddings=self.tie_word_embeddings, initializer_range=INIT_STD,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id, architectures=[self.architecture])

    def num_parameters(self) -> int:
        """Every parameter, the embedding once where the LM head shares it."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.model_type == "qwen2":  # q, k and v biases
            attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * layer + self.hidden_size + embed * (1 if self.tie_word_embeddings else 2)

    def describe(self) -> str:
        return (f"{self.architecture}, {self.num_parameters() / 1e9:.2f} B parameters: {self.num_layers} layers, "
                f"hidden {self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV heads of "
                f"{self.head_dim}, MLP {self.intermediate_size}, vocabulary {self.vocab_size:,}"
                + (", tied embeddings" if self.tie_word_embeddings else ""))


_LLAMA3_ROPE = (("rope_type", "llama3"), ("factor", 32.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192))

SHAPES = {s.name: s for s in (
    # Qwen/Qwen2.5-0.5B-Instruct: 494,032,768 parameters.
    Shape("qwen2.5-0.5b", "qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
          intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
          rms_norm_eps=1e-6, max_position_embeddings=32768),
    # meta-llama/Llama-3.2-1B-Instruct: 1,235,814,400 parameters.
    Shape("llama-3.2-1b", "llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
          intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
          rms_norm_eps=1e-5, max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE),
    # Seconds to write and serve: checks the benchmark's scripts end to end. Head size 64, which
    # every server's CPU attention takes; a vocabulary past the tokenizer's, as the real shapes have.
    Shape("tiny", "llama", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
          intermediate_size=256, vocab_size=51200, tie_word_embeddings=True, rope_theta=500000.0,
          rms_norm_eps=1e-5, max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE, hidden=True),
)}


def shape_record(shape: Shape) -> dict[str, Any]:
    """What shape.json holds: the shape's fields and its size, for the results page."""
    record = dataclasses.asdict(shape)
    record["rope_scaling"] = dict(shape.rope_scaling) if shape.rope_scaling else None
    record["num_parameters"] = shape.num_parameters()
    record["description"] = shape.describe()
    return record


def _fill(model: Any, tokenizer_vocab: int, seed: int) -> None:  # a transformers PreTrainedModel
    """Random weights in place: normal(0, INIT_STD), norms 1, biases 0; vocabulary rows past the
    tokenizer's zero. One bar over the bytes drawn."""
    params = list(model.named_parameters())  # a tied LM head is listed once, as the embedding
    total = sum(p.numel() * p.element_size() for _, p in params)
    generator = torch.Generator().manual_seed(seed)
    vocab_rows = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, desc="Drawing random weights") as bar:
        for name, p in params:
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=generator)
            if id(p) in vocab_rows:
                p[tokenizer_vocab:] = 0
            bar.update(p.numel() * p.element_size())


def write_tokenizer(tokenizer: Tokenizer, path: Path, model_max_length: int) -> None:
    """tokenizer.json and a tokenizer_config.json with the chat template, as transformers and
    vLLM read them."""
    tokenizer.save(path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
              "eos_token": tokenizer.eos_token, "unk_token": tokenizer.unk_token, "pad_token": tokenizer.pad_token,
              "add_bos_token": False, "model_max_length": model_max_length,
              "chat_template": tokenizer.chat_template}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_shape(shape: Shape, path: Path, seed: int = 0, force: bool = False) -> bool:
    """Write `shape` to `path` as a Hugging Face directory; False (nothing written) where `path`
    already holds this shape and not `force`."""
    path = Path(path)
    record = {**shape_record(shape), "seed": seed}
    marker = path / SHAPE_FILE
    if not force and marker.is_file() and json.loads(marker.read_text()) == record:
        return False
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise SystemExit("writing a shape needs transformers: pip install 'transformers>=4.45'") from None
    tokenizer = load_tokenizer("default").tokenizer
    if shape.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"{shape.name}: vocabulary {shape.vocab_size} below the tokenizer's {tokenizer.vocab_size}")
    config = AutoConfig.for_model(shape.model_type, **shape.config_kwargs(tokenizer))
    with torch.device("meta"):  # no memory and no default init: _fill draws every weight once
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()
    _fill(model, tokenizer.vocab_size, seed)
    marker.unlink(missing_ok=True)  # a directory half rewritten is no longer the shape it was
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size=SHARD_SIZE)
    write_tokenizer(tokenizer, path, shape.max_position_embeddings)
    marker.write_text(json.dumps(record, indent=2) + "\n")
    return True


def main(argv: Sequence[str] | None = None) -> None:
    listed = [s for s in SHAPES.values() if not s.hidden]
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.shapes", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="shapes:\n" + "\n".join(f"  {s.name:<14}{s.describe()}" for s in listed))
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,write}")
    sub.add_parser("list", help="the shapes and their sizes")
    w = sub.add_parser("write", help="write a shape's directory (skipped where it is already there)",
                       description="Write SHAPE's config, random bfloat16 weights and SmolLM2's tokenizer to OUT_DIR.")
    w.add_argument("shape", metavar="SHAPE", help=", ".join(s.name for s in listed))
    w.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="the directory to write (created)")
    w.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    w.add_argument("--force", action="store_true", help="write even where OUT_DIR already holds the shape")
    args = p.parse_args(argv)
    if args.command == "list":
        for s in listed:
            print(f"{s.name:<14}{s.describe()}; {2 * s.num_parameters() / 1e9:.2f} GB in bfloat16")
        return
    shape = SHAPES.get(args.shape)
    if shape is None:
        p.error(f"unknown shape {args.shape!r}: expected one of {', '.join(s.name for s in listed)}")
    start = time.perf_counter()
    if write_shape(shape, args.out_dir, seed=args.seed, force=args.force):
        print(f"{args.out_dir}: {shape.name} ({shape.describe()}) in {time.perf_counter() - start:.0f} s")
    else:
        print(f"{args.out_dir}: already holds {shape.name} (--force writes it again)", file=sys.stderr)


if __name__ == "__main__":
    main()
