"""Write a random-weight fp16 Llama checkpoint that exllamav2 0.3.2 and transformers both load."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["SHAPES", "Shape", "main", "make_checkpoint", "model_for"]

BOS_ID = 1
EOS_ID = 2
UNK_ID = 0
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
MAX_POSITION_EMBEDDINGS = 8192
ROPE_THETA = 500000.0
RMS_NORM_EPS = 1e-5
INIT_STD = 0.02
MAX_SHARD_BYTES = 4 * 1024**3  # one model.safetensors up to this size, else shards


@dataclass(frozen=True)
class Shape:
    """Dimensions of one Llama preset."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes of every tensor, in file order (HF Llama names)."""
        h, hd, i = self.hidden, self.head_dim, self.mlp
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (self.heads * hd, h)),
                (p + "self_attn.k_proj.weight", (self.kv_heads * hd, h)),
                (p + "self_attn.v_proj.weight", (self.kv_heads * hd, h)),
                (p + "self_attn.o_proj.weight", (h, self.heads * hd)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    def num_params(self) -> int:
        total = 0
        for _, shape in self.tensor_shapes():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


SHAPES: dict[str, Shape] = {
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, mlp=512),
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336),
}


# --------------------------------------------------------------------------- tokenizer


def _calibration_files() -> list[Path]:
    """exllamav2's shipped calibration text, found without importing exllamav2 (no CUDA build)."""
    spec = importlib.util.find_spec("exllamav2")
    if spec is None or not spec.submodule_search_locations:
        return []
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "conversion" / "standard_cal_data"
        files = sorted(d.glob("*.utf8"))
        if files:
            return files
    return []


def _generated_corpus(seed: int, n_chars: int = 3_000_000) -> list[str]:
    """Fallback corpus: pseudo-words from syllables, punctuation, digits, all printable ASCII."""
    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "st",
        "tr",
        "pl",
        "ch",
        "sh",
        "th",
        "gr",
        "br",
    ]
    vowels = ["a", "e", "i", "o", "u", "ae", "ou", "io", "ea"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]
    lexicon = [
        "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.randint(1, 4))
        )
        for _ in range(40000)
    ]
    weights = [1.0 / (r + 1) for r in range(len(lexicon))]  # Zipf-like
    lines: list[str] = ["".join(chr(c) for c in range(32, 127))]
    size = 0
    while size < n_chars:
        words = rng.choices(lexicon, weights=weights, k=rng.randint(5, 30))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        if rng.random() < 0.1:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words) + rng.choice([".", ",", "?", "!", ":", ";", ""])
        lines.append(line)
        size += len(line) + 1
    return lines


def _train_tokenizer(vocab_size: int, seed: int) -> Any:
    """Byte-level BPE (GPT-2 style); <unk>, <s>, </s> at ids 0, 1, 2; post-processor adds BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = _calibration_files()
    if files:
        tok.train([str(f) for f in files], trainer)
    else:
        tok.train_from_iterator(_generated_corpus(seed), trainer)
    got = tok.get_vocab_size()
    if got < vocab_size:  # a small corpus can run out of merges: fill with plain tokens
        tok.add_tokens([f"<fill_{i}>" for i in range(vocab_size - got)])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", BOS_ID)],
    )
    return tok


# --------------------------------------------------------------------------- json files


def _config_json(shape: Shape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.mlp,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "vocab_size": shape.vocab,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "torch_dtype": "float16",
    }


def _tokenizer_config_json() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, s in enumerate(SPECIAL_TOKENS)
        },
    }


# A plain role-tagged layout; the weights are random, so only its shape matters.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _generation_config_json() -> dict[str, Any]:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- weights


def _make_tensor(
    name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float16)
    t = torch.empty(shape, dtype=torch.float16, device=device)
    t.normal_(0.0, INIT_STD, generator=gen)
    return t.cpu()


def _write_weights(out_dir: Path, shape: Shape, seed: int) -> list[Path]:
    """Stream tensors into shards of at most MAX_SHARD_BYTES; hold at most one shard in RAM."""
    import torch
    from safetensors.torch import save_file

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    specs = shape.tensor_shapes()
    total_bytes = 2 * shape.num_params()

    # Plan the shards first so that every file name knows the shard count.
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    group_bytes = 0
    for name, shp in specs:
        n = 2
        for d in shp:
            n *= d
        if groups[-1] and group_bytes + n > MAX_SHARD_BYTES:
            groups.append([])
            group_bytes = 0
        groups[-1].append((name, shp))
        group_bytes += n

    for stale in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    single = len(groups) == 1
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        fname = (
            "model.safetensors" if single else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        tensors = {name: _make_tensor(name, shp, gen, device) for name, shp in group}
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        del tensors
        (out_dir / fname).chmod(0o644)
        files.append(out_dir / fname)
        for name, _ in group:
            weight_map[name] = fname

    if not single:
        _write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
        )
    return files


# --------------------------------------------------------------------------- entry points


def make_checkpoint(out_dir: Path, shape: str, seed: int = 0) -> Path:
    """Write config, tokenizer and random fp16 weights of preset `shape` to `out_dir`; return it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    sh = SHAPES[shape]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(sh.vocab, seed)
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config_json())
    _write_json(
        out_dir / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    )
    _write_json(out_dir / "config.json", _config_json(sh))
    _write_json(out_dir / "generation_config.json", _generation_config_json())
    # Where transformers 5 saves a template, so that chat requests run as on a current model.
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_weights(out_dir, sh, seed)
    return out_dir


def model_for(shape: str, models: Path) -> tuple[Path, str]:
    """The model a benchmark runs and the name its results give it: `shape` is a preset shape
    (its random-weight checkpoint written under `models`) or a model directory that exists
    already (an EXL2 conversion, say), named by its folder."""
    given = Path(shape)
    if given.is_dir():
        return given, given.name
    return make_checkpoint(Path(models) / f"llama-{shape}-random", shape), shape


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--out", type=Path, required=True, help="directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    out = make_checkpoint(args.out, args.shape, args.seed)
    dt = time.perf_counter() - t0
    sh = SHAPES[args.shape]
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(
        f"wrote {args.shape} checkpoint ({sh.num_params() / 1e9:.2f} B params, "
        f"{size / 1e9:.2f} GB of safetensors) to {out} in {dt:.1f} s"
    )


if __name__ == "__main__":
    main()
