"""Load a causal LM and its tokenizer from one spec.

A spec is an alias, `smollm2` (the default teacher) or `gemma3` (Gemma-3-270M, fetched on first use): a
dense copy of a GGUF that `linearize.assets` fetches; a `.gguf` file (dequantised on load), a local HF model
folder (holding config.json, teacher or linearized checkpoint alike), or a Hugging Face hub id, passed on as is.
"""

import json
import pickle
import re
import struct
from pathlib import Path

import huggingface_hub
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import assets, modeling  # modeling registers the linearized model types with the Auto classes
from .cli_args import first_line
from .config import ConfigError
from .gguf_files import from_gguf, no_bpe_cleanup
from .hub import hub_reachable

ALIASES = {"smollm2": assets.smollm2_hf, "gemma3": assets.gemma3_hf}
# "name" or "org/name"; anything else that does not exist on disk is a missing path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class ModelSpecError(ValueError):
    """A spec that names nothing loadable; the message is one line, fit for a CLI."""


class ModelNotFoundError(ModelSpecError, FileNotFoundError):
    """A spec that is a path, but nothing is there."""


def load_model(spec: str | Path, *, dtype: torch.dtype | str | None = None, device=None,
               inference_options: dict | None = None) -> PreTrainedModel:
    """A causal LM in eval mode. `dtype` None means float32; "auto" keeps the checkpoint's dtype.
    `inference_options` change a linearized model's forward-only options (`convert.set_inference_options`)."""
    kind, where = resolve_spec(spec)
    model = _from_pretrained(AutoModelForCausalLM, kind, where, dtype=_dtype(dtype))
    if inference_options:
        from .convert import set_inference_options

        set_inference_options(model, **inference_options)  # checks the options against the model's positions
    elif getattr(model.config, "linearize", None):
        # Lengths past the model's positions would load, then fail in the first forward; `--set` can fix them.
        from .config import check_fits_positions

        try:
            check_fits_positions(modeling.method_config_of(model), model.config)
        except ConfigError as e:
            raise ModelSpecError(f"cannot load {where}: its config.json's linearize settings are invalid ({e})") from e
    if device is not None:
        model.to(device)
    return model.eval()


def load_config(spec: str | Path):
    """The model's transformers config alone (no weights): what checks of layer indices need."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, *resolve_spec(spec))


# Any one of these makes a folder's tokenizer loadable (fast, sentencepiece, BPE or WordPiece files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(spec: str | Path) -> PreTrainedTokenizerBase:
    kind, where = resolve_spec(spec)
    if kind == "dir" and not any((where / name).is_file() for name in TOKENIZER_FILES):
        raise ModelSpecError(f"{where} holds a model but no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                             "save the tokenizer into that folder too")
    return no_bpe_cleanup(_from_pretrained(AutoTokenizer, kind, where))


def resolve_spec(spec: str | Path) -> tuple[str, Path | str]:
    """("gguf", file), ("dir", folder) or ("hub", id); raises ModelSpecError for anything else."""
    if isinstance(spec, str) and spec in ALIASES:
        spec = ALIASES[spec]()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"{path} holds no config.json, so it is not a Hugging Face model folder")
        _check_config_file(path / "config.json")
        return "dir", path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSpecError(f"{path} is neither a .gguf file nor a model folder")
        return "gguf", path
    if isinstance(spec, str) and path.suffix != ".gguf" and _HUB_ID.fullmatch(spec):
        return "hub", spec
    raise ModelNotFoundError(f"no such model file or folder: {path}")


def _check_config_file(path: Path) -> None:
    """A model folder's config.json must hold one JSON object: transformers indexes whatever it finds."""
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ModelSpecError(f"{path} is not valid JSON ({str(e).strip() or type(e).__name__})") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"{path} must hold a JSON object, not {type(config).__name__}")


# What reading a truncated or corrupt file raises, in transformers' GGUF parser, gguf's reader, safetensors
# and torch.load: caught around the read so the user hears which file is broken, not a traceback.
_CORRUPT_GGUF = (struct.error, ValueError, IndexError, KeyError, EOFError, OverflowError, MemoryError)
_CORRUPT_WEIGHTS = (SafetensorError, EOFError, pickle.UnpicklingError)


def _from_pretrained(auto_class, kind: str, where: Path | str, **kwargs):
    if kind == "gguf":
        try:
            return from_gguf(auto_class, where, **kwargs)
        except _CORRUPT_GGUF as e:
            if isinstance(e, ModelSpecError):
                raise
            if where.stat().st_size == 0:
                reason = "the file is empty"
            elif isinstance(e, struct.error | IndexError | EOFError):
                reason = "truncated or corrupt"
            else:
                reason = first_line(e)
            raise ModelSpecError(f"cannot load {where}: not a readable GGUF file ({reason})") from e
    if kind == "dir":
        try:
            return auto_class.from_pretrained(where, **kwargs)
        except ConfigError as e:  # the checkpoint's `linearize` settings (method options) are off
            raise ModelSpecError(f"cannot load {where}: its config.json's linearize settings are invalid ({e})") from e
        except _CORRUPT_WEIGHTS as e:
            files = sorted(p.name for p in where.iterdir() if p.suffix in (".safetensors", ".bin"))
            named = where / files[0] if len(files) == 1 else f"{where} ({', '.join(files)})"
            raise ModelSpecError(f"cannot load {named}: its weights are truncated or corrupt "
                                 f"({str(e).strip() or type(e).__name__})") from e
        except RuntimeError as e:
            # transformers' "ignore_mismatched_sizes" report: the weights' shapes are not the config's.
            if "mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
                raise
            raise ModelSpecError(f"cannot load {where}: its weights' shapes do not match its config.json") from e
        except Exception as e:
            # The tokenizers library raises bare Exceptions for a broken tokenizer.json.
            if auto_class is not AutoTokenizer or isinstance(e, ModelSpecError | OSError):
                raise
            reason = first_line(e)
            if "Couldn't instantiate the backend tokenizer" in reason:  # its list of what is missing follows
                present = [name for name in TOKENIZER_FILES if (where / name).is_file()]
                reason = (f"it holds {', '.join(present) or 'no tokenizer file'} but no vocabulary "
                          f"(tokenizer.json, or tokenizer.model, vocab.json + merges.txt or vocab.txt with a "
                          f"tokenizer library that reads it): save the whole tokenizer into that folder")
            raise ModelSpecError(f"cannot load the tokenizer in {where}: {reason}") from e
    if not hub_reachable():
        # Only the local HF cache can help now; asking transformers would retry each file for a minute.
        try:
            where = huggingface_hub.snapshot_download(where, local_files_only=True)
        except OSError as e:
            raise ModelSpecError(
                f"{where!r} is not a local path, nor in the Hugging Face cache, and the hub "
                f"({huggingface_hub.constants.ENDPOINT}) cannot be reached{alias_hint(where)}"
            ) from e
    try:
        return auto_class.from_pretrained(where, **kwargs)
    except OSError as e:
        reason = str(e).strip().splitlines()[0]
        raise ModelSpecError(f"could not load {where!r} from the Hugging Face hub: {reason}{alias_hint(where)}") from e


def alias_hint(spec: str) -> str:
    """"; did you mean ALIAS?" for a bare name close to an alias (a typo reaches the hub as a model id),
    "; aliases: ..." for another bare name, nothing for an "org/name" id."""
    import difflib

    if "/" in spec or "\\" in spec:
        return ""
    close = difflib.get_close_matches(spec.lower(), ALIASES, n=1)
    return f"; did you mean {close[0]}?" if close else f"; aliases: {', '.join(ALIASES)}"


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(getattr(torch, str(dtype), None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name such as float32 or bfloat16, or 'auto'")
