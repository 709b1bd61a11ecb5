"""What makes an export launchable beyond its parallel layout: the model's shape (from the profile's ModelShape, read
from the real model), the torchrun line for the plan's nodes and GPUs, and placeholders for what no file of mmplan's
knows (data, tokenizer, training length) -- values the target's own parser or loader refuses until they are filled."""
from __future__ import annotations

from dataclasses import dataclass

from plans.errors import MmplanError
from plans.graph import ModelShape, Profile
from plans.plan import Plan

FILL = "FILL_ME"  # every placeholder; Megatron-LM's parser refuses it as an int or a choice, torchtitan as a dataset


@dataclass(frozen=True)
class Model:
    """The shapes an exporter writes: the LLM's (None: not known) and the encoders' (for notes)."""

    llm: ModelShape | None
    encoders: tuple[ModelShape, ...] = ()
    why: str = ""  # why the LLM's shape is not known


def model_of(plan: Plan, profile: Profile | None) -> Model:
    """The LLM's shape from the profile: the group of the plan's last transformer layer (the LLM's, see common.Roles)."""
    if profile is None:
        return Model(None, why="no --profile given")
    if profile.fingerprint != plan.profile.fingerprint:
        raise MmplanError(f"--profile is for another model (fingerprint {profile.fingerprint} of {profile.model!r}; the plan's is "
                          f"{plan.profile.fingerprint} of {plan.profile.model!r})")
    if not profile.shapes:
        return Model(None, why="the profile records no model shape (made before mmplan recorded it: re-run `mmplan profile`)")
    names = {b.name: b.group for b in profile.blocks}
    blocks = [b for g in plan.groups for b in g.blocks]
    group = next((names[b] for b in reversed(blocks) if b in names and profile.shape(names[b])), None)
    llm = profile.shape(group) if group else None
    if llm is None:
        return Model(None, why="the profile records no transformer shape for the LLM's group")
    return Model(llm, tuple(s for s in profile.shapes if s.group != group))


def describe(shape: ModelShape) -> str:
    """One line: `vision: 24 layers, hidden 1024, 16 heads, ffn 4096, sequence 577, layernorm, gelu`."""
    parts = [f"{shape.layers} layers", f"hidden {shape.hidden}", f"{shape.heads} heads"]
    if shape.kv_heads and shape.kv_heads != shape.heads:
        parts.append(f"{shape.kv_heads} kv heads")
    parts += [f"ffn {shape.ffn}", f"sequence {shape.sequence}"]
    if shape.vocab:
        parts.append(f"vocab {shape.vocab}" + (" (tied)" if shape.tied else ""))
    parts += [x for x in (shape.norm, shape.mlp, shape.position and f"{shape.position} positions"
                          + (f" (base {shape.rope_base:g})" if shape.rope_base else ""),
                          shape.bias and ("biases" if shape.bias == "yes" else "no biases")) if x]
    return f"{shape.group}: " + ", ".join(str(p) for p in parts if p)


def torchrun(plan: Plan, world: int, script: str) -> str:
    """The launch line on every node: --nnodes and --nproc-per-node from the plan's cluster and the ranks it uses."""
    gpn = plan.cluster.gpus_per_node
    nodes, per = (world + gpn - 1) // gpn, min(gpn, world)
    rendezvous = ' --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port 29500' if nodes > 1 else ""
    return f"torchrun --nnodes {nodes} --nproc-per-node {per}{rendezvous} {script}"


def rope_base(shape: ModelShape) -> str | None:
    """RoPE's base as Megatron's --rotary-base / Bridge's rotary_base take it (an integer); None when the profile does
    not know it, or it is not an integer (no such model is known to us)."""
    b = shape.rope_base
    return str(int(b)) if b and b == int(b) else None


def vocab_divisor(vocab: int, tp: int) -> int | None:
    """Megatron pads the tokenizer's vocabulary to a multiple of --make-vocab-size-divisible-by x tp: the largest
    divisor <= 128 (its default) that keeps `vocab` as it is; None when tp does not divide it."""
    if vocab % tp:
        return None
    return max(d for d in range(1, 129) if (vocab // tp) % d == 0)


# --- Megatron-LM's model flags -----------------------------------------------------------------------------------------


def megatron_model_flags(model: Model, tp: int, vlm: bool, notes: list[str]) -> list[list[str]]:
    """The LLM's shape as Megatron-LM core_v0.16.1 flags (each checked by its parse_args / validate_args), preceded by
    comment lines ("#" + text, kept in the argument list as one-element entries) where a value is a placeholder."""
    s = model.llm
    if s is None:
        return [[f"# {FILL}: the model's shape is not known ({model.why}): fill every {FILL} below "
                 "(Megatron-LM refuses the file until you do)"]] + _unknown_shape(vlm)
    out: list[list[str]] = []

    def value(flag: str, v, what: str) -> None:
        if not v:
            out.append([f"# {FILL}: {what} is not in the profile"])
        out.append([flag, str(v) if v else FILL])

    value("--hidden-size", s.hidden, "the hidden size")
    value("--ffn-hidden-size", s.ffn, "the MLP width")
    value("--num-attention-heads", s.heads, "the attention heads")
    if s.kv_heads and s.kv_heads != s.heads:
        out += [["--group-query-attention"], ["--num-query-groups", str(s.kv_heads)]]
    out += _sequence_flags(model, vlm)
    out.append(["--normalization", {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}.get(s.norm, FILL)])
    if s.mlp == "swiglu":
        out.append(["--swiglu"])
    elif not s.mlp:
        out.append([f"# {FILL}: the MLP's activation is not in the profile: add --swiglu for a gated SiLU MLP"])
    out.append(["--position-embedding-type", {"rope": "rope", "learned": "learned_absolute"}.get(s.position, FILL)])
    if s.position == "rope":
        base = rope_base(s)
        if base is None:
            out.append([f"# {FILL}: RoPE's base is not in the profile (Megatron-LM's default 10000 is Llama 2's; Llama 3: 500000)"])
        out.append(["--rotary-base", base or FILL])
    if s.bias == "no":
        out.append(["--disable-bias-linear"])
    if not s.tied:
        out.append(["--untie-embeddings-and-output-weights"])
    if s.vocab:
        d = vocab_divisor(s.vocab, tp)
        if d is not None:
            out.append([f"# vocabulary: the model's has {s.vocab} rows; Megatron pads your tokenizer's to a multiple of "
                        f"{d} x tp {tp}, which keeps {s.vocab}"])
            out.append(["--make-vocab-size-divisible-by", str(d)])
        else:
            notes.append(f"vocabulary {s.vocab} is not a multiple of tp {tp}: Megatron pads it")
    notes += [f"encoder shape (set in your model provider): {describe(e)}" for e in model.encoders] if vlm else []
    return out


def _sequence_flags(model: Model, vlm: bool) -> list[list[str]]:
    """Text-only: --seq-length; a VLM (Megatron's multimodal scripts): --seq-length is the encoder's tokens per sample,
    --decoder-seq-length the language model's (image tokens included)."""
    s = model.llm
    if not s.sequence:
        return [[f"# {FILL}: the sequence length is not in the profile"], ["--seq-length", FILL], ["--max-position-embeddings", FILL]]
    if not vlm:
        return [["--seq-length", str(s.sequence)], ["--max-position-embeddings", str(s.sequence)]]
    enc = max((e.sequence for e in model.encoders), default=0)
    flags = [["--decoder-seq-length", str(s.sequence)]]
    flags += [["--seq-length", str(enc)]] if enc else [[f"# {FILL}: the encoder's tokens per sample"], ["--seq-length", FILL]]
    return flags + [["--max-position-embeddings", str(max(s.sequence, enc))]]


def _unknown_shape(vlm: bool) -> list[list[str]]:
    flags = [["--hidden-size", FILL], ["--ffn-hidden-size", FILL], ["--num-attention-heads", FILL], ["--seq-length", FILL],
             ["--max-position-embeddings", FILL], ["--normalization", FILL], ["--position-embedding-type", FILL],
             ["# add as your model needs: --group-query-attention --num-query-groups N, --swiglu, --disable-bias-linear, "
              "--untie-embeddings-and-output-weights, --rotary-base N (with rope)"]]
    return flags + ([["--decoder-seq-length", FILL]] if vlm else [])


def megatron_data_flags() -> list[list[str]]:
    """Data, tokenizer and training length: no file of mmplan's knows them; FILL_ME fails Megatron-LM's parser
    (--tokenizer-type's choices, --train-iters' and --lr's types) or its dataset builder (--data-path)."""
    return [[f"# {FILL}: your tokenizer (e.g. Llama2Tokenizer, HuggingFaceTokenizer) and its model file"],
            ["--tokenizer-type", FILL], ["--tokenizer-model", FILL],
            [f"# {FILL}: your data's path prefix (the .bin / .idx pair), or --mock-data instead of this line"],
            ["--data-path", FILL], ["--split", "99,1,0"],
            [f"# {FILL}: how long to train, and the learning rate"], ["--train-iters", FILL], ["--lr", FILL]]


# --- torchtitan 0.3.0's Llama3Model ------------------------------------------------------------------------------------

TITAN_MODEL = '''
# The LLM as torchtitan 0.3.0's Llama3Model (models/llama3), built as torchtitan's own flavours build theirs; the values
# are the profile's shape of group {group!r}. Data and tokenizer are not mmplan's to know: {fill} fails (torchtitan
# refuses the dataset name, finds no tokenizer at the path; an unknown RoPE base cannot raise a number to a string's power).
MODEL = dict(dim={hidden}, n_layers={layers}, n_heads={heads}, n_kv_heads={kv_heads}, hidden_dim={ffn}, vocab_size={vocab},
             enable_weight_tying={tied})
SEQ_LEN = {sequence}
ROPE_THETA = {rope}
HF_ASSETS_PATH = {fill!r}  # {fill}: the directory of your tokenizer (torchtitan's hf_assets_path)
DATASET = {fill!r}  # {fill}: a dataset torchtitan knows (hf_datasets/text_datasets.py DATASETS) or you registered


def model_spec():
    """torchtitan's llama3 ModelSpec with MODEL as its model config (flex attention, as the registry's default)."""
    import dataclasses

    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    m = MODEL
    config = llama3.Llama3Model.Config(
        dim=m["dim"], vocab_size=m["vocab_size"], enable_weight_tying=m["enable_weight_tying"],
        tok_embeddings=Embedding.Config(num_embeddings=m["vocab_size"], embedding_dim=m["dim"],
                                        param_init=llama3._EMBEDDING_SKIP_INIT if m["enable_weight_tying"] else llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=m["dim"], param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=m["dim"], out_features=m["vocab_size"], param_init=llama3._output_linear_init(m["dim"])),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=m["n_layers"], dim=m["dim"], n_heads=m["n_heads"], n_kv_heads=m["n_kv_heads"],
            hidden_dim=m["hidden_dim"], attn_backend="flex",
            rope=ComplexRoPE.Config(dim=m["dim"] // m["n_heads"], max_seq_len=SEQ_LEN, theta=ROPE_THETA)),
    )
    return dataclasses.replace(llama3.model_registry("debugmodel"), flavor="mmplan", model=config)
'''

TITAN_APPLY_MODEL = '''    config.model_spec = model_spec()
    config.training.seq_len = SEQ_LEN
    config.hf_assets_path = HF_ASSETS_PATH
    if hasattr(config.dataloader, "dataset"):
        config.dataloader.dataset = DATASET
    loss_fn = getattr(config.loss, "loss_fn", config.loss)
    if hasattr(loss_fn, "global_vocab_size"):
        loss_fn.global_vocab_size = MODEL["vocab_size"]
'''


def titan_model(model: Model, notes: list[str]) -> tuple[str, str]:
    """(the model section, apply()'s lines setting it) when the LLM is llama-like (RMSNorm, SwiGLU, RoPE, no biases);
    otherwise nothing, and a note naming what the user's own model_spec must hold."""
    s = model.llm
    llama = s is not None and (s.norm, s.mlp, s.position, s.bias) == ("rmsnorm", "swiglu", "rope", "no") and all(
        (s.hidden, s.layers, s.heads, s.ffn, s.vocab, s.sequence))
    if llama:
        return (TITAN_MODEL.format(group=s.group, hidden=s.hidden, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads or s.heads,
                                   ffn=s.ffn, vocab=s.vocab, tied=s.tied, sequence=s.sequence, fill=FILL,
                                   rope=(f"{s.rope_base!r}  # the profile's RoPE base" if s.rope_base else
                                         f"{FILL!r}  # {FILL}: your model's RoPE base (Llama 2: 10000.0, Llama 3: 500000.0)")), TITAN_APPLY_MODEL)
    if s is None:
        notes.append(f"model: not known ({model.why}); fill config.model_spec (dim, n_layers, n_heads, n_kv_heads, hidden_dim, "
                     "vocab_size), training.seq_len, hf_assets_path and the dataset yourself")
    else:
        notes.append(f"model: {describe(s)} is not torchtitan's Llama3Model (RMSNorm, SwiGLU, RoPE, no biases): set "
                     "config.model_spec to your model's with these values, training.seq_len, hf_assets_path and the dataset")
    return "", ""


# --- Megatron-Bridge's GPT model provider -------------------------------------------------------------------------------


class Code(str):
    """A value written into a Python export as code, not as a string literal."""

    def __repr__(self) -> str:
        return str(self)


ACTIVATION = {"swiglu": (True, Code("torch.nn.functional.silu")), "gelu": (False, Code("torch.nn.functional.gelu"))}


def bridge_model_fields(model: Model, num_layers: int, tp: int, notes: list[str]) -> tuple[dict, dict]:
    """The LLM's shape as Megatron-Bridge's GPTModelProvider takes it: (its megatron.core TransformerConfig fields, its
    GPT fields: vocabulary, sequence, tied head, positions -- GPTModel's own arguments but for the padding divisor).
    Every field is written, so that apply() replaces a recipe's model; what the profile does not know is FILL_ME, which
    TransformerConfig's checks and GPTModel's embedding refuse until it is filled. `num_layers` is the plan's."""
    s = model.llm
    if s is None:
        notes.append(f"model: not known ({model.why}): every {FILL} in model_overrides is the model's shape to fill")
        s = ModelShape(group="")

    def known(v):
        return v if v else FILL

    gated, activation = ACTIVATION.get(s.mlp, (FILL, FILL))
    core = {"num_layers": num_layers, "hidden_size": known(s.hidden), "ffn_hidden_size": known(s.ffn),
            "num_attention_heads": known(s.heads), "num_query_groups": known(s.kv_heads or s.heads),
            "normalization": {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}.get(s.norm, FILL),
            "gated_linear_unit": gated, "activation_func": activation,
            "add_bias_linear": {"yes": True, "no": False}.get(s.bias, FILL)}
    gpt = {"vocab_size": known(s.vocab), "seq_length": known(s.sequence),
           "share_embeddings_and_output_weights": s.tied if model.llm is not None else FILL,
           "position_embedding_type": {"rope": "rope", "learned": "learned_absolute"}.get(s.position, FILL)}
    if s.position == "rope" or not s.position:
        gpt["rotary_base"] = int(rope_base(s)) if rope_base(s) else FILL
    d = vocab_divisor(s.vocab, tp) if s.vocab else None
    gpt["make_vocab_size_divisible_by"] = d or 128  # d keeps the model's vocabulary as it is (Bridge pads to a multiple of d x tp)
    missing = [k for k, v in {**core, **gpt}.items() if v == FILL]
    if missing and model.llm is not None:
        notes.append(f"model: {', '.join(missing)} not in the profile: {FILL} in model_overrides")
    notes += [f"encoder shape (set in your provider): {describe(e)}" for e in model.encoders]
    return core, gpt
