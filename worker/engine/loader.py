"""Loading a Hugging Face causal LM and its tokenizer through transformers.

The model's config.json is judged first (contracts/model_support.py, the same words the operator
uses), before any weights load: an architecture the engine does not reproduce exactly is refused
with a message instead of producing wrong output. The model's own classes then run with the paged
attention of hf/paged_attention.py, registered as its `attn_implementation`; a tensor-parallel
rank loads only its share (hf/rank_loading.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.contracts.model_support import ModelBackend, check_model_config, serving_backend
from tandem.worker.engine.errors import ModelLoadError

log = logging.getLogger("tandem.worker.engine")

DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class LoadedModel:
    model: Any  # the transformers *ForCausalLM module, in eval mode
    tokenizer: Any
    config: Any
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    max_model_len: int
    eos_ids: frozenset[int]
    name: str
    backend: ModelBackend = ModelBackend.TRANSFORMERS  # the forward pass that runs it (model_runner.py)
    group: Any = None  # tensor parallelism (engine/parallel/): the rank's group (model: its share)


def resolve_device(device: str) -> Any:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available here")
    return dev


def cpu_bf16_features() -> list[str]:
    """The CPU features that make bf16 matmuls native here (AVX512-BF16, AMX-BF16), from
    /proc/cpuinfo; empty elsewhere or without them (bf16 would then be emulated, slower than fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [name for name in ("avx512_bf16", "amx_bf16") if name in flags]


def resolve_dtype(dtype: str, config: Any, device: Any) -> tuple[Any, str]:
    """The dtype to serve in, and why (for the start-up log)."""
    import torch

    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)} or auto")
        return getattr(torch, dtype), "asked for"
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(cfg).removeprefix("torch.") if cfg is not None else None
    if device.type != "cpu":
        if name in DTYPES:
            return getattr(torch, name), f"auto: the checkpoint's {name}"
        return torch.bfloat16, "auto: bfloat16 (the checkpoint names no dtype)"
    if name in ("bfloat16", "float16"):
        native = cpu_bf16_features()
        if native:
            return torch.bfloat16, f"auto: {name} checkpoint, and this CPU has {' and '.join(native)}"
        return torch.float32, f"auto: {name} checkpoint, but this CPU has no native bf16 (AVX512-BF16 or AMX)"
    return torch.float32, f"auto: the checkpoint's {name or 'float32'} (served as saved, exact)"


def context_limit(config: Any, max_model_len: int | None) -> int:
    """The context length to serve: the model's, or less when asked for."""
    model_max = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
    limit = model_max
    if max_model_len is not None:
        if max_model_len > model_max:
            raise ModelLoadError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {model_max}"
            )
        limit = max_model_len
    return limit


def read_config_json(src: str, looks_local: bool) -> dict[str, Any]:
    """The model's config.json as saved (a hub id: from HF_HOME's cache), before transformers reads it."""
    try:
        if looks_local:
            path = Path(src) / "config.json"
        else:
            from transformers.utils import cached_file

            path = Path(cached_file(src, "config.json"))
        return json.loads(path.read_text())
    except Exception as e:  # noqa: BLE001 - a missing, unreadable or malformed file all mean "can't load"
        raise ModelLoadError(f"cannot read the model config at {src!r}: {e}") from e


def _eos_ids(generation_config: Any, config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for src in (generation_config, config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def model_source(model: str) -> tuple[str, bool]:
    """(what to pass to from_pretrained, whether it is a local folder); checks a local folder
    without importing torch, so a wrong path fails in a second rather than after the imports."""
    path = Path(model).expanduser()
    looks_local = path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local and not (path / "config.json").is_file():
        raise ModelLoadError(
            f"no Hugging Face model at {model!r}: expected a folder with config.json, "
            "safetensors weights and tokenizer files (or a hub id like org/name)"
        )
    return (str(path) if looks_local else model), looks_local


def check_before_loading(model: str, backend: str = "auto", tensor_parallel: int = 1) -> dict[str, Any]:
    """The model's config.json, once it is judged servable (contracts/model_support.py, the
    operator's words); raises ModelLoadError with the reason otherwise. Imports no torch, so a worker
    refuses a model it cannot serve within a second of starting."""
    src, looks_local = model_source(model)
    raw = read_config_json(src, looks_local)
    if (reason := check_model_config(raw, tensor_parallel, backend)) is not None:
        raise ModelLoadError(reason)
    return raw


def load_model(
    model: str, *, dtype: str = "auto", device: str = "auto", max_model_len: int | None = None,
    trust_remote_code: bool = False, backend: str = "auto", tensor_parallel: int = 1, group: Any = None,
) -> LoadedModel:
    """Load weights and tokenizer from a local folder, or a hub id resolved through HF_HOME's cache,
    into the model's own classes with the paged attention (`backend`: auto or transformers, the
    same). A rank of a tensor-parallel `group` reads only its share of the weights, into the model's
    classes narrowed to it (hf/rank_loading.py)."""
    t0 = time.monotonic()
    raw = check_before_loading(model, backend, tensor_parallel)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, looks_local = model_source(model)
    log.info("loading model config from %s", src)
    chosen, why_path = serving_backend(raw, backend)
    try:
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean "can't load"
        raise ModelLoadError(f"cannot read the model config at {src!r}: {e}") from e
    limit = context_limit(config, max_model_len)
    dev = resolve_device(device)
    torch_dtype, why = resolve_dtype(dtype, config, dev)
    ranks = 1 if group is None else group.size
    log.info("loading %s weights (%s) onto %s as %s (%s); %s path (%s)", config.model_type, src, dev,
             str(torch_dtype).removeprefix("torch."), why, chosen.value, why_path)
    from tandem.worker.engine.hf.paged_attention import register

    attn = register()
    try:
        if ranks > 1:
            from tandem.worker.engine.hf.rank_loading import load_rank_model
            from tandem.worker.engine.parallel.checkpoint import local_checkpoint

            hf_model, _ = load_rank_model(local_checkpoint(src), config, torch_dtype, dev, group, attn,
                                          trust_remote_code)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(
                src, dtype=torch_dtype, trust_remote_code=trust_remote_code, attn_implementation=attn).to(dev).eval()
        tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the model or tokenizer at {src!r}: {e}") from e
    n_params = sum(p.numel() for p in hf_model.parameters())
    log.info(
        "model loaded in %.1fs: %.1fM parameters, %d layers, context %d",
        time.monotonic() - t0, n_params / 1e6, config.num_hidden_layers, limit,
    )
    name = Path(src).name if looks_local else model
    eos = _eos_ids(getattr(hf_model, "generation_config", None), config, tokenizer)
    return LoadedModel(hf_model, tokenizer, config, torch_dtype, dev, limit, eos, name, chosen, group=group)
