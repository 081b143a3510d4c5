"""load_model: from a Hub id or a local folder to a patched, LoRA-ready ``(model, tokenizer)`` in one call.

    model, tokenizer = load_model("meta-llama/Llama-3.1-8B", max_seq_length=4096, load_in_4bit=True)

What it does, in order (every option is checked before anything is read or downloaded):

1. Resolve the source. A folder must hold ``config.json`` and weights; a Hub id's ``config.json``
   is fetched first, so a wrong name fails fast with a ``ModelLoadError`` that says which case it
   is (``reason``): path does not exist, not a model folder, Hub id not found (or private), gated,
   access denied, revision not found, offline and not cached, Hub unreachable. No chained
   traceback. Local folders load with ``HF_HUB_OFFLINE=1``.
2. Load with transformers: ``dtype`` None/"auto" → bfloat16 on a GPU that supports it, float16 on
   older GPUs, float32 on CPU. ``load_in_4bit`` → bitsandbytes NF4 with double quantisation and
   ``dtype`` as the compute dtype (CUDA, or CPU with bitsandbytes ≥ 0.46); under ``accelerate launch``
   with FSDP the codes are stored in ``dtype`` too (``bnb_4bit_quant_storage``), so FSDP shards them. The model goes to
   ``cuda:$LOCAL_RANK`` when CUDA is present (pass ``device_map=...`` to override).
3. ``max_seq_length`` → ``tokenizer.model_max_length``, checked against the context the config
   declares (``max_position_embeddings``, or ``original_max_position_embeddings × factor`` when the
   config already carries RoPE scaling). Longer is a ValueError: RoPE scaling is never applied
   silently (it changes the model's numbers); put it in the config yourself if you want it.
   Without ``max_seq_length``, a tokenizer without a real limit gets the config's.
4. A missing pad token becomes an existing pad-like token of the vocabulary, else ``unk``, else
   ``eos`` (logged; a collator that masks pad labels then also masks eos). The embedding matrix is
   never resized. ``model.config.pad_token_id`` and the generation config follow.
5. LoRA (``LoraSpec``; None for full fine-tuning): every base parameter is frozen and the
   embedding output is made to require grad (so reentrant checkpointing still back-propagates),
   then PEFT's ``get_peft_model``. This is ``prepare_model_for_kbit_training`` minus two things,
   on purpose: its cast of every non-quantised weight (embeddings, norms, lm_head) to float32,
   which costs ~2 GiB more on an 8B model, turns the residual stream to float32 without autocast,
   and gains nothing for frozen weights (RMSNorm already normalises in float32; PEFT keeps the
   adapters themselves in float32); and its switch to Hugging Face checkpointing, which is
   fasttune's to choose (``FastConfig.checkpointing`` or the Trainer's flag under FastTrainer).
6. ``patch_model`` with ``fast_config``; the report is logged (a warning when something stayed
   stock, e.g. an architecture outside the families table: it then runs entirely stock) and is
   returned by ``fasttune.patch_report(model)``.

The results are plain ``PeftModel`` / ``*ForCausalLM`` and tokenizer objects: any Trainer, TRL
trainer or ``generate`` call takes them.
"""

from __future__ import annotations

import importlib.util
import logging
import numbers
import os
from typing import Any

import torch

from ..config import FastConfig
from ..model_patches.lora_fp8 import fp8_load_config
from .lora_spec import LoraSpec

logger = logging.getLogger("fasttune")

_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
# Tried in order when the tokenizer has no pad token (Llama 3.1, Llama 3, generic ones).
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>", "<|PAD_TOKEN|>",
                   "<|reserved_special_token_0|>")
_OWNED_KWARGS = ("dtype", "torch_dtype", "quantization_config", "load_in_4bit", "load_in_8bit")
_ROPE_SCALED_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


class ModelLoadError(OSError):
    """``load_model`` could not find or open the model; ``reason`` says which case.

    Attributes:
        reason: "path_not_found", "not_a_model_dir", "invalid_name", "hub_not_found", "gated",
            "access_denied", "revision_not_found", "not_a_model_repo", "offline", "network",
            "unknown_architecture", "no_tokenizer".
        name: the ``name_or_path`` that was given.
    """

    def __init__(self, message: str, reason: str, name: str):
        super().__init__(message)
        self.reason = reason
        self.name = name


_DEFAULT_LORA = LoraSpec()


def load_model(name_or_path: str | os.PathLike, *, max_seq_length: int | None = None, load_in_4bit: bool = False,
               load_in_fp8: bool = False, dtype: torch.dtype | str | None = None, lora: LoraSpec | None = _DEFAULT_LORA,
               fast_config: FastConfig | None = None, revision: str | None = None, token: str | bool | None = None,
               **model_kwargs: Any):
    """Load a causal LM and its tokenizer, attach LoRA and patch the model (see the module docstring).

    Args:
        name_or_path: Hub id ("org/name") or a folder written by ``save_pretrained``.
        max_seq_length: longest sequence you will train on; sets ``tokenizer.model_max_length``.
        load_in_4bit: quantise the linear layers to NF4 with bitsandbytes (QLoRA).
        load_in_fp8: the LoRA bases in FP8 (an approximation): sets ``base_dtype="fp8"`` on
            ``fast_config``; loaded in ``dtype`` (or NF4) first, converted layer by layer (``lora_fp8.py``).
        dtype: "auto"/None, "bfloat16", "float16", "float32" or a torch dtype (the compute dtype under 4-bit).
        lora: the adapter to attach (``LoraSpec()`` by default); None for full fine-tuning (or
            inference, with 4-bit weights). A ``peft.LoraConfig`` is accepted as is.
        fast_config: fasttune options for ``patch_model``; ``FastConfig()`` when None.
        revision: Hub branch, tag or commit.
        token: Hub token (None: the saved login).
        **model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (``attn_implementation``,
            ``device_map``, ...); ``dtype`` and quantisation are this function's own options.

    Returns:
        ``(model, tokenizer)``: a ``PeftModel`` (or the ``*ForCausalLM`` when ``lora`` is None),
        patched, and its tokenizer with a pad token. A vision-language model of the families table
        (Qwen2-VL, Qwen2.5-VL, Gemma 3) comes as ``(model, processor)``: its ``*ForConditionalGeneration``
        and its processor (``processor.tokenizer`` has the pad token); ``lora``'s tower switches
        choose where the adapters go (``LoraSpec.finetune_vision_layers``).

    Raises:
        ModelLoadError: the name or folder does not lead to a model (``reason`` says why).
        ValueError: an option is invalid (the message names it).
    """
    dtype, device = _check_options(max_seq_length, load_in_4bit, dtype, lora, fast_config, model_kwargs)
    fast_config = fp8_load_config(load_in_fp8, fast_config, lora)
    name = os.fspath(name_or_path) if isinstance(name_or_path, os.PathLike) else name_or_path
    if not isinstance(name, str) or not name:
        raise TypeError(f"name_or_path must be a Hub id or a folder path, got {name_or_path!r}")
    source = _resolve_source(name, revision, token)
    hub = dict(revision=revision, token=token)
    remote = dict(trust_remote_code=bool(model_kwargs.get("trust_remote_code", False)))

    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(source, **hub, **remote)
    except (ValueError, KeyError) as err:
        raise ModelLoadError(f"transformers {_transformers_version()} cannot read the config of {name!r}: "
                             f"{_first_line(err)}", "unknown_architecture", name) from None
    vision = _is_vision_language(config)
    limit = context_limit(config.get_text_config() if hasattr(config, "get_text_config") else config)
    if max_seq_length is not None and limit is not None and max_seq_length > limit:
        raise ValueError(f"max_seq_length={max_seq_length} exceeds the context of {name!r} ({limit} positions, "
                         "from config.max_position_embeddings / its RoPE scaling). fasttune does not apply RoPE "
                         "scaling silently: use a smaller max_seq_length, or set rope scaling in the config "
                         "yourself and save it.")
    try:  # a vision-language model gets its processor (image processor + tokenizer)
        processor = (AutoProcessor if vision else AutoTokenizer).from_pretrained(source, **hub, **remote)
        tokenizer = processor.tokenizer if vision else processor
    except (OSError, ValueError, TypeError, ImportError, AttributeError) as err:
        what = "processor (image processor + tokenizer)" if vision else "tokenizer"
        raise ModelLoadError(f"no usable {what} in {name!r}: {_first_line(err)}", "no_tokenizer", name) from None

    # transformers >= 5.25 kernelizes from Hub kernels by default (downloads on CUDA); the patch turns that off
    # again (model_patches/hub_kernels.py), so the load skips it. A use_kernels in model_kwargs still wins.
    kwargs = dict(dtype=dtype, use_kernels=False, **hub)
    if not _zero3_enabled():  # ZeRO-3 partitions at load time; transformers refuses a device_map there
        kwargs["device_map"] = {"": device}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        from .distributed import fsdp_launch

        # Under FSDP the packed codes are sharded and gathered like any parameter: held in the compute
        # dtype (a float), not uint8, which FSDP2 cannot shard with the rest of its unit.
        storage = dict(bnb_4bit_quant_storage=dtype) if fsdp_launch() else {}
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype, **storage)
    kwargs.update(model_kwargs)
    try:
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(source, config=config, **kwargs)
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        raise ModelLoadError(f"{name!r} ({config.model_type}) is not a causal language model: {_first_line(err)}",
                             "unknown_architecture", name) from None

    tokenizer.model_max_length = max_seq_length if max_seq_length is not None else min(
        tokenizer.model_max_length, limit or tokenizer.model_max_length)
    set_pad_token(tokenizer, model)
    if lora is not None:
        model = attach_lora(model, lora)
    elif load_in_4bit:
        logger.warning("fasttune: %s loaded in 4-bit without LoRA: fine for inference; training needs adapters", name)

    from ..model_patches import patch_model

    patch_model(model, fast_config or FastConfig())  # logs its report (once per model instance)
    return model, processor


def _is_vision_language(config) -> bool:
    """A vision-language model of the families table (loaded as ``*ForConditionalGeneration`` with its processor)."""
    from ..model_patches.families import family_for

    spec = family_for(getattr(config, "model_type", None))
    return spec is not None and spec.vision is not None


# --- options -------------------------------------------------------------------------------------

def _check_options(max_seq_length, load_in_4bit, dtype, lora, fast_config, model_kwargs):
    """Validate every option before any file is read; returns (dtype, device)."""
    if max_seq_length is not None and (isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int)
                                       or max_seq_length <= 0):
        raise ValueError(f"max_seq_length must be a positive integer or None, got {max_seq_length!r}")
    if not isinstance(load_in_4bit, bool):
        raise ValueError(f"load_in_4bit must be True or False, got {load_in_4bit!r}")
    if lora is not None and not isinstance(lora, LoraSpec) and type(lora).__name__ != "LoraConfig":
        raise TypeError(f"lora must be a LoraSpec, a peft.LoraConfig or None, got {type(lora).__name__}")
    if fast_config is not None and not isinstance(fast_config, FastConfig):
        raise TypeError(f"fast_config must be a FastConfig or None, got {type(fast_config).__name__}")
    owned = sorted(set(model_kwargs) & set(_OWNED_KWARGS))
    if owned:
        raise ValueError(f"pass {owned} through load_model's own options (dtype=..., load_in_4bit=...), "
                         "not as from_pretrained keyword arguments")
    device = default_device()
    dtype = resolve_dtype(dtype, device)
    if load_in_4bit:
        check_4bit_support(model_kwargs.get("device_map", device))
    return dtype, device


def default_device() -> str:
    """``cuda:$LOCAL_RANK`` when CUDA is present (one GPU per process under torchrun/accelerate), else "cpu"."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def resolve_dtype(dtype, device: str) -> torch.dtype:
    """``dtype`` as a torch dtype; None/"auto": bfloat16 on GPUs with bf16, float16 on older GPUs, float32 on CPU."""
    if dtype is None or dtype == "auto":
        if not str(device).startswith("cuda"):
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    resolved = _DTYPE_NAMES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be 'auto', 'bfloat16', 'float16', 'float32' or one of those torch dtypes, "
                         f"got {dtype!r}")
    if resolved is torch.bfloat16 and str(device).startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise ValueError("dtype=bfloat16: this GPU has no bfloat16 support; use dtype='float16' (or 'auto')")
    return resolved


def _zero3_enabled() -> bool:
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - very old transformers
        return False
    return bool(is_deepspeed_zero3_enabled())


def check_4bit_support(device_map) -> None:
    """ValueError naming ``load_in_4bit`` unless bitsandbytes is installed and quantises on the target device."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("load_in_4bit=True needs bitsandbytes: pip install 'fasttune[qlora]'")
    devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
    for dev in devices:
        kind = _device_kind(dev)
        if kind == "cuda":
            continue
        if kind != "cpu":
            raise ValueError(f"load_in_4bit=True: bitsandbytes NF4 runs on CUDA (or CPU), not on {dev!r}")
        reason = _bnb_cpu_probe()
        if reason is not None:
            raise ValueError(f"load_in_4bit=True on CPU: this bitsandbytes cannot quantise on CPU ({reason}); "
                             "use a CUDA GPU or bitsandbytes >= 0.46")


def _device_kind(dev) -> str:
    """"cuda", "cpu" or another device type for one device_map value (accelerate's strategies included)."""
    if dev is None or dev in ("auto", "balanced", "balanced_low_0", "sequential"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(dev, int):
        return "cuda"
    try:
        return torch.device(dev).type
    except (RuntimeError, TypeError):
        return str(dev)  # "disk" and the like


def _bnb_cpu_probe() -> str | None:
    """None when bitsandbytes quantises and dequantises NF4 on CPU, else the error."""
    try:
        import bitsandbytes.functional as bnbf

        w = torch.randn(64, 64)
        packed, state = bnbf.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        bnbf.dequantize_4bit(packed, state)
    except Exception as err:  # noqa: BLE001 - any failure means "not supported here"
        return f"{type(err).__name__}: {_first_line(err)}"
    return None


def context_limit(config) -> int | None:
    """Positions the config supports: ``max_position_embeddings``, or the RoPE-scaled original
    length when the config already declares RoPE scaling (whichever is larger)."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _ROPE_SCALED_TYPES:
        original = rope.get("original_max_position_embeddings") or limit
        factor = rope.get("factor")
        if original and isinstance(factor, numbers.Real) and factor > 1:
            limit = max(limit or 0, int(original * factor))
    return int(limit) if limit else None


# --- source resolution ---------------------------------------------------------------------------

def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _looks_like_path(name: str) -> bool:
    """A Hub id is "name" or "namespace/name"; anything else that names no folder is a missing path."""
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")
            or os.path.isabs(name))


def _resolve_source(name: str, revision, token) -> str:
    """The folder to load from (checked), or the Hub id (its config.json fetched)."""
    path = os.path.expanduser(name)
    if os.path.exists(path):
        _check_model_dir(name, path)
        return path
    if _looks_like_path(name):
        raise ModelLoadError(f"model folder {name!r} does not exist", "path_not_found", name)
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError as err:  # HFValidationError
        raise ModelLoadError(f"{name!r} is neither an existing folder nor a valid Hub id ({_first_line(err)})",
                             "invalid_name", name) from None
    _check_hub(name, revision, token)
    return name


def _check_model_dir(name: str, path: str) -> None:
    if not os.path.isdir(path):
        raise ModelLoadError(f"{name!r} is a file; load_model wants a model folder (config.json + weights, as "
                             "written by save_pretrained)", "not_a_model_dir", name)
    files = sorted(os.listdir(path))
    if "config.json" not in files:
        hint = (" It holds a PEFT adapter (adapter_config.json): load its base model, then the adapter with "
                "PeftModel.from_pretrained." if "adapter_config.json" in files else "")
        shown = ", ".join(files[:6]) + (" ..." if len(files) > 6 else "") if files else "nothing"
        raise ModelLoadError(f"{name!r} is not a model folder: no config.json (it holds {shown}).{hint}",
                             "not_a_model_dir", name)
    if not any(f.endswith(_WEIGHT_SUFFIXES) for f in files):
        raise ModelLoadError(f"{name!r} has a config.json but no weights (*.safetensors or *.bin)",
                             "not_a_model_dir", name)


def _check_hub(repo_id: str, revision, token) -> None:
    """Fetch the repo's config.json (cached for transformers) and turn each failure into a ModelLoadError."""
    from huggingface_hub import constants, errors, hf_hub_download

    def fail(message: str, reason: str):
        return ModelLoadError(message, reason, repo_id)

    try:
        hf_hub_download(repo_id, "config.json", revision=revision, token=token)
    except errors.GatedRepoError:
        raise fail(f"{repo_id!r} is gated on the Hub: accept its terms at https://huggingface.co/{repo_id} with "
                   "your account, then log in (`hf auth login`) or pass token=...", "gated") from None
    except errors.RevisionNotFoundError:
        raise fail(f"revision {revision!r} of {repo_id!r} does not exist on the Hub", "revision_not_found") from None
    except errors.RepositoryNotFoundError:
        raise fail(f"{repo_id!r} is not on the Hub (or it is private and your token cannot see it), and no local "
                   "folder of that name exists", "hub_not_found") from None
    except errors.LocalEntryNotFoundError as err:
        if constants.HF_HUB_OFFLINE:
            raise fail(f"offline (HF_HUB_OFFLINE=1) and {repo_id!r} is not in the Hub cache ({constants.HF_HUB_CACHE}):"
                       " download it once online, or pass a local folder", "offline") from None
        # huggingface_hub hides HTTP answers other than "not found"/"gated" behind this error.
        raise _http_failure(repo_id, err.__cause__) from None
    except errors.EntryNotFoundError:
        raise fail(f"{repo_id!r} has no config.json: not a transformers model repo (GGUF-only and adapter-only "
                   "repos cannot be loaded by load_model)", "not_a_model_repo") from None
    except errors.HfHubHTTPError as err:
        raise _http_failure(repo_id, err) from None
    except (ConnectionError, TimeoutError) as err:
        raise fail(f"could not reach the Hub to fetch {repo_id!r}: {_first_line(err)}", "network") from None


def _http_failure(repo_id: str, cause: BaseException | None) -> ModelLoadError:
    """The error for a Hub answer that is not "not found"/"gated": access denied, or the Hub/network failing."""
    from huggingface_hub import errors

    status = getattr(getattr(cause, "response", None), "status_code", None)
    if isinstance(cause, errors.HfHubHTTPError) and status in (401, 403):
        return ModelLoadError(f"the Hub refused access to {repo_id!r} (HTTP {status}): check that your token "
                              "(`hf auth login` or token=...) may read it", "access_denied", repo_id)
    detail = f"HTTP {status}" if status is not None else (_first_line(cause) if cause is not None else "no answer")
    return ModelLoadError(f"could not fetch {repo_id!r} from the Hub ({detail}) and it is not in the cache: check "
                          "the network (or set HF_HUB_OFFLINE=1 to use cached models only)", "network", repo_id)


# --- tokenizer and adapters ----------------------------------------------------------------------

def set_pad_token(tokenizer, model) -> None:
    """Give ``tokenizer`` a pad token when it has none (see the module docstring), and tell the model."""
    if tokenizer.pad_token is None:
        vocab = tokenizer.get_vocab()
        choice = next((t for t in _PAD_CANDIDATES if t in vocab), None) or tokenizer.unk_token
        if choice is None:
            choice = tokenizer.eos_token
            logger.info("fasttune: the tokenizer has no pad token; padding with eos %r", choice)
        if choice is None:
            raise ValueError("the tokenizer has no pad, unk or eos token to pad with; set tokenizer.pad_token")
        tokenizer.pad_token = choice
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = tokenizer.pad_token_id


def attach_lora(model, lora):
    """Freeze the base, make the embedding output require grad, and wrap with PEFT (see module docstring)."""
    from peft import get_peft_model

    model.requires_grad_(False)
    model.enable_input_require_grads()
    spec = lora if isinstance(lora, LoraSpec) else None
    peft_config = spec.to_peft_config(model) if spec is not None else lora
    if spec is not None and spec.unfused_reason():
        logger.info("fasttune: LoRA with %s keeps PEFT's path (the fused kernels need dropout 0, bias 'none', "
                    "no DoRA)", spec.unfused_reason())
    if spec is not None and spec.seed is not None:
        devices = [torch.device(d).index or 0 for d in {str(p.device) for p in model.parameters()}
                   if d.startswith("cuda")]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(spec.seed))
            return get_peft_model(model, peft_config)
    return get_peft_model(model, peft_config)


__all__ = ["LoraSpec", "ModelLoadError", "attach_lora", "check_4bit_support", "context_limit", "default_device",
           "load_model", "resolve_dtype", "set_pad_token"]
