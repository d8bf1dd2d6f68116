"""Typed hyper-parameters of each attention method, with the papers' defaults.

One dataclass per method. `make_method_config(name, **options)` validates and is what the edges go
through once: the CLI's `--set key=value`, a recipe's `distill.options`, `convert(model, method,
**options)` and a checkpoint's config.json. A bad value fails before any weight is touched, and every
layer below takes the typed config (`MethodConfig`), never its options again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args, get_type_hints


class ConfigError(ValueError):
    """A bad method name or hyper-parameter value."""


@dataclass
class LizardConfig:
    """Lizard (arXiv 2507.09025): gated linear attention over all tokens + anchor window with sinks.

    The gate is gamma_i = sigmoid(w . x_i + b) ** (1 / gate_temperature). Its weight starts at zero
    and its bias at `gate_bias_init` (6.0: gamma = 0.9975, a ~280-token half-life), so the state
    starts close to plain linear attention and stage 1 learns how fast to forget. alpha starts at 0:
    both branches are normalised averages of values, so at alpha = 1 their sum is about twice the
    teacher's output (stage-1 MSE at init 13.1 vs 3.2 on SmolLM2, experiments/scripts/stage1_init_error.py), and
    at lr 1e-3 alpha barely moves in a 2M-token stage. The window enters as stage 1 raises alpha.
    """

    window: int = 128
    num_sinks: int = 4
    feature_dim: int | None = None  # Hedgehog f; None = head_dim // 2, so phi has head_dim features
    gate: Literal["scalar", "vector", "none"] = "scalar"
    gate_bias_init: float = 6.0
    gate_temperature: float = 1.0
    rope_in_window: bool = False
    combine: Literal["alpha", "shared"] = "alpha"  # y_gla + alpha * y_win, or one shared normalizer
    alpha_init: float = 0.0
    chunk_size: int = 64  # of the chunked training/prefill form
    eps: float = 1e-6
    # "delta" adds a gated delta-rule retrieval memory beside the linear state and the window
    # (docs/methods.md): y = y_gla + alpha * y_win + mu_h * o_delta, mu starting at `memory_weight_init`.
    memory: Literal["gla", "delta"] = "gla"
    memory_weight_init: float = 0.0
    # None: the memory decays by the scalar gate (log gamma, none without a gate). A number in (0, 1): the
    # memory decays by a learned per-head a_h = sigmoid(w_h) of its own, starting there, so it can keep a
    # fact longer than the gate lets the linear state; gate_temperature divides the gate's log gamma only.
    memory_decay_init: float | None = None
    # > 0 keeps beside the window a cache of this many tokens per KV head that left it, those the linear
    # state recalls worst, attended exactly under the window's softmax (LoLA's sparse cache,
    # `linearize.ops.sparse_cache`, docs/methods.md); 0: off.
    sparse_slots: int = 0


@dataclass
class StillConfig:
    """STILL (arXiv 2602.02180): fixed softmax budget filled by Self-Saliency, rest in a linear state.

    Per head, `window` slots hold the most recent tokens and `budget - window` slots hold salient
    far tokens. When chunk c (of `chunk_size` tokens) completes, its top-lambda tokens by score are
    marked salient, lambda = (budget - window) // max_chunks. A token is routed when it leaves the
    window: salient ones enter the salient slots; if that overflows, the salient token with the
    lowest score (the oldest on ties) is folded into the linear state S, z instead. Unselected
    tokens are folded as they leave the window. Prefill, training and decode share this rule.
    """

    window: int = 128
    budget: int = 896
    chunk_size: int = 64
    max_chunks: int = 16  # T_max: training length 1024 / chunk 64
    feature_dim: int | None = None
    feature_map: Literal["npmap", "hedgehog"] = "npmap"
    # The score tokens are ranked by (`linearize.ops.still.routing.ROUTINGS`, docs/methods.md): Self-Saliency,
    # or an ablation's: the paper's other metrics (diagonal, dot, key_norm, uniform), random, recency.
    routing: Literal["saliency", "diagonal", "dot", "key_norm", "uniform", "random", "recency"] = "saliency"
    gate: bool = True
    eps: float = 1e-6
    # "delta" adds a gated delta-rule retrieval memory beside the softmax budget and the linear state
    # (docs/methods.md): y = y_still + mu_h * o_delta, mu starting at `memory_weight_init`. STILL's gate
    # is a per-channel output gate, not a decay, so the memory decays by a learned per-head
    # a_h = sigmoid(w_h), starting at `memory_decay_init`.
    memory: Literal["np_map", "delta"] = "np_map"
    memory_weight_init: float = 0.0
    memory_decay_init: float = 0.9975

    @property
    def slots(self) -> int:
        """Salient slots: the budget beyond the window."""
        return self.budget - self.window

    @property
    def per_chunk(self) -> int:
        return self.slots // self.max_chunks

    def op_options(self, scale: float) -> dict:
        """The keyword options of `ops.still`'s forms and routing (`scale`: the attention's)."""
        return {"window": self.window, "chunk": self.chunk_size, "per_chunk": self.per_chunk, "routing": self.routing,
                "scale": scale, "eps": self.eps}

    def folds_within(self, length: int) -> bool:
        """Whether any of `length` tokens can reach the linear state (False: none does): one its chunk did
        not pick, once it leaves the window, or one pushed out of full salient slots."""
        return (self.per_chunk < self.chunk_size and length > self.window) or length > self.budget


@dataclass
class LolcatsConfig:
    """LoLCATs: Hedgehog linear attention on tokens before a softmax sliding window, shared normalizer.

    The window factor is sigmoid(w_h) per head, w_h initialised to `window_factor_init`.
    """

    window: int = 64
    feature_dim: int | None = None
    window_factor_init: float = 0.1
    eps: float = 1e-6


@dataclass
class LigerConfig:
    """Liger-GLA: softmax feature map, pooled-key gate, unnormalised GLA mixed 50/50 with a SWA."""

    window: int = 64
    gate_normalizer: float = 16.0
    mix: float = 0.5  # y = mix * y_swa + (1 - mix) * y_gla
    chunk_size: int = 64


MethodConfig = LizardConfig | StillConfig | LolcatsConfig | LigerConfig

METHOD_CONFIGS: dict[str, type] = {
    "lizard": LizardConfig,
    "still": StillConfig,
    "lolcats": LolcatsConfig,
    "liger": LigerConfig,
}


@dataclass(frozen=True)
class Preset:
    """A method with the options our results recommend, one flag away: `--preset NAME` on convert and
    distill means `--method METHOD --set KEY=VALUE ...`, plus `distill_defaults` (DistillConfig fields)
    for distill. Flags given beside it win: `--set` after the preset's options, an explicit flag over
    its defaults. Checkpoints record the method and options, not the preset's name."""

    method: str
    options: dict[str, str]
    distill_defaults: dict
    summary: str


PRESETS: dict[str, Preset] = {
    "lizard-shared": Preset(
        method="lizard", options={"rope_in_window": "true", "combine": "shared"},
        distill_defaults={"head_lr_scale": 30.0},
        summary="Lizard with RoPE in the window and one shared normaliser (--method lizard --set "
                "rope_in_window=true --set combine=shared; distill also --head-lr-scale 30): the variant "
                "our results recommend (docs/methods.md)",
    ),
}


def _coerce(name: str, raw, hint):
    """Turn a CLI string (or a JSON value) into the field's type, or raise ConfigError."""
    if raw is None:
        if type(None) in get_args(hint):
            return None
        raise ConfigError(f"{name} may not be None")
    choices = get_args(hint)
    if getattr(hint, "__origin__", None) is Literal:
        if raw not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}, got {raw!r}")
        return raw
    types = [t for t in (choices or (hint,)) if t is not type(None)]
    target = types[0]
    if isinstance(raw, str) and raw.lower() in ("none", "null") and type(None) in choices:
        return None
    if target is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} must be true or false, got {raw!r}")
    try:
        value = target(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {target.__name__}, got {raw!r}") from None
    if target is int and isinstance(raw, float) and raw != value:
        raise ConfigError(f"{name} must be an integer, got {raw!r}")
    return value


def _validate(cfg: MethodConfig) -> None:
    for f in dataclasses.fields(cfg):  # NaN passes every comparison below, inf most: refuse both
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be a finite number, got {value}")
        # Sizes become tensor shapes and kernel arguments: beyond int32 they overflow there, unnamed.
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**31:
            raise ConfigError(f"{f.name} must be below 2**31, got {value}")

    def positive(field):
        value = getattr(cfg, field)
        if value is not None and value <= 0:
            raise ConfigError(f"{field} must be > 0, got {value}")

    for field in ("window", "feature_dim", "eps", "gate_temperature", "chunk_size", "budget", "max_chunks",
                  "gate_normalizer"):
        if hasattr(cfg, field):
            positive(field)
    if isinstance(cfg, LizardConfig) and cfg.num_sinks < 0:
        raise ConfigError(f"num_sinks must be >= 0, got {cfg.num_sinks}")
    if isinstance(cfg, LizardConfig) and cfg.sparse_slots < 0:
        raise ConfigError(f"sparse_slots must be >= 0, got {cfg.sparse_slots}")
    if isinstance(cfg, LizardConfig) and cfg.memory_decay_init is not None:
        if cfg.memory != "delta":
            raise ConfigError("memory_decay_init is the delta memory's decay: set memory=delta, or leave it unset")
        if not 0.0 < cfg.memory_decay_init < 1.0:
            raise ConfigError(f"memory_decay_init must be in (0, 1), got {cfg.memory_decay_init}")
    if (isinstance(cfg, LizardConfig) and cfg.memory == "delta" and cfg.memory_decay_init is None
            and cfg.gate == "vector"):
        raise ConfigError("memory=delta decays by the scalar gate: use gate=scalar or gate=none, "
                          "or give the memory its own decay (memory_decay_init)")
    if isinstance(cfg, StillConfig):
        if cfg.window < cfg.chunk_size:
            raise ConfigError(f"window ({cfg.window}) must be >= chunk_size ({cfg.chunk_size})")
        if cfg.budget < cfg.window:
            raise ConfigError(f"budget ({cfg.budget}) must be >= window ({cfg.window})")
        if cfg.memory == "delta" and not 0.0 < cfg.memory_decay_init < 1.0:
            raise ConfigError(f"memory=delta decays by memory_decay_init: it must be in (0, 1), "
                              f"got {cfg.memory_decay_init}")
    if isinstance(cfg, LigerConfig) and not 0.0 <= cfg.mix <= 1.0:
        raise ConfigError(f"mix must be in [0, 1], got {cfg.mix}")


# `convert(layers=...)`, `--layers`: which of the teacher's layers to linearize
# (`linearize.architectures.layers_kept_softmax`).
LAYER_CHOICES = ("all", "full")
LAYERS_HELP = ("which layers to linearize: all, or full (only the full-attention layers; the teacher's "
               "sliding-window layers, Gemma's five in six, stay as they are, also constant in memory)")


# Options that shape a trained model's forward pass but none of its weights, so `set_inference_options`
# may change them after training: what STILL keeps softmax-visible (its budget, T_max and routing),
# Lizard's window and how fast its state forgets (the gate's temperature).
INFERENCE_OPTIONS: dict[str, tuple[str, ...]] = {"still": ("budget", "max_chunks", "routing"),
                                                 "lizard": ("window", "gate_temperature")}


def _listed_inference_options() -> str:
    return "; ".join(f"{method}: {', '.join(names)}" for method, names in INFERENCE_OPTIONS.items())


def inference_options_help() -> str:
    """`--set`'s help for a trained model: the options each method can change."""
    return f"an inference option of a linearized model ({_listed_inference_options()}); repeatable"


def parse_inference_options(pairs: list[str]) -> dict[str, str]:
    """`parse_set_options` for a trained model's `--set`. Its method is known only once the model loads
    (`with_inference_options` checks the rest then); a key no method can change fails before that."""
    options = parse_set_options(pairs)
    known = {name for names in INFERENCE_OPTIONS.values() for name in names}
    for key in options:
        if key not in known:
            raise ConfigError(f"--set {key}: no method can change {key} after training; options they can: "
                              f"{_listed_inference_options()}")
    return options


def with_inference_options(cfg: MethodConfig, changes: dict) -> MethodConfig:
    """A trained model's validated `cfg` with `changes`, which may name only its method's INFERENCE_OPTIONS
    (values may be strings, as from the command line)."""
    method = method_name(cfg)
    allowed = INFERENCE_OPTIONS.get(method, ())
    fixed = sorted(set(changes) - set(allowed))
    if fixed:
        raise ConfigError(f"{method} cannot change {', '.join(fixed)} after training; options it can: "
                          f"{', '.join(allowed) or 'none'}")
    hints = get_type_hints(type(cfg))
    changed = dataclasses.replace(cfg, **{key: _coerce(key, raw, hints[key]) for key, raw in changes.items()})
    _validate(changed)
    return changed


def method_name(cfg: MethodConfig) -> str:
    """The method a typed config is for ("lizard" for a `LizardConfig`)."""
    for name, cls in METHOD_CONFIGS.items():
        if type(cfg) is cls:
            return name
    raise ConfigError(f"{type(cfg).__name__} is not a method config; choose one of "
                      f"{', '.join(cls.__name__ for cls in METHOD_CONFIGS.values())}")


def checked_method_config(cfg: MethodConfig) -> MethodConfig:
    """`cfg` itself once its values pass the checks `make_method_config` makes (ConfigError otherwise): for a
    config built in Python, as `LizardConfig(window=64)`."""
    method_name(cfg)
    _validate(cfg)
    return cfg


def method_options(cfg: MethodConfig) -> dict:
    """Every option of `cfg`, as a checkpoint's config.json records them (`linearize.options`)."""
    return dataclasses.asdict(cfg)


def make_method_config(method: str, **options) -> MethodConfig:
    """Build and validate a method's config from keyword overrides (strings allowed, as from the CLI)."""
    if method not in METHOD_CONFIGS:
        raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(METHOD_CONFIGS)}")
    cls = METHOD_CONFIGS[method]
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, raw in options.items():
        if key not in fields:
            raise ConfigError(f"{method} has no option {key!r}; options: {', '.join(sorted(fields))}")
        values[key] = _coerce(key, raw, hints[key])
    cfg = cls(**values)
    _validate(cfg)
    return cfg


# Options counted in tokens, which the op pads or allocates to in full whatever the sequence's length:
# one past the model's positions buys no context and can ask for more memory than there is.
LENGTH_OPTIONS = ("window", "chunk_size", "budget")


def check_fits_positions(cfg: MethodConfig, model_config) -> None:
    """Refuse (ConfigError) a `LENGTH_OPTIONS` value of `cfg` larger than the model's positions
    (`max_position_embeddings`; a config without one is not checked)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return
    for name in LENGTH_OPTIONS:
        value = getattr(cfg, name, None)
        if value is not None and value > limit:
            raise ConfigError(f"{name}={value} is larger than the model's max_position_embeddings, {limit}: "
                              f"pick {name} <= {limit}")


def parse_set_options(pairs: list[str], methods: tuple[str, ...] | list[str] = (), *,
                      flag: str = "--set") -> dict[str, str]:
    """`["window=64", "gate=vector"]` -> {"window": "64", "gate": "vector"}, checked against each of
    `methods` (a bad option fails before anything is loaded); `flag` names the options in errors."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects key=value, got {pair!r}")
        options[key.strip()] = value.strip()
    for method in methods:
        make_method_config(method, **options)
    return options
