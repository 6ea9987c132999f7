"""Tokenizer fidelity: trtgraph's encode/decode equal `transformers.AutoTokenizer` on the two
families real checkpoints use — byte-level BPE (Llama-3 / Qwen) and byte-fallback BPE with
SentencePiece-style spaces (Llama-2 / Mistral) — built here with the `tokenizers` library."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from trtgraph.models.tokenizer import HFTokenizer, StreamDecoder

TRAIN_TEXT = ["The quick brown fox jumps over the lazy dog.", "def main():\n    return 0\n",
              "Hello, world! How are you today?", "numbers 1234567890 and symbols #$%&*()",
              "naïve café résumé", "über Größe straße"] * 20
CORPUS = [
    "Hello world", " leading space", "two  spaces and\ttab\n\nnewlines", "emoji 🦙🎉 and a flag 🇫🇷",
    "CJK 日本語のテキスト", "combining e\u0301 and a\u0308", "<|eot_id|> inside text", "a<|user|>b</s>c",
    "<s> literal bos", "x" * 50, "", " ", "1234 5678", "ümlaut", "tabs\t\tand  trailing ",
]


def byte_level_tokenizer(path: Path, add_bos_token=None, extra_specials=(), eos="<|eot_id|>") -> Path:
    """Llama-3 / Qwen style: GPT-2 byte-level pre-tokenizer and decoder, BOS by the post-processor."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|user|>", "<|assistant|>",
                *extra_specials]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="$A $B",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
           "eos_token": eos, "clean_up_tokenization_spaces": True}
    if add_bos_token is not None:
        cfg["add_bos_token"] = add_bos_token
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def byte_fallback_tokenizer(path: Path, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True,
                   add_eos_token=False) -> Path:
    """Llama-2 / Mistral style: characters merged by BPE, unknown characters as <0xNN> byte
    tokens, spaces as ▁ (prepended once), BOS/EOS by the post-processor and (as real
    checkpoints write them) the same choice in add_bos_token/add_eos_token."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single=("<s> $A" if add_bos_token else "$A") + (" </s>" if add_eos_token else ""), pair="$A $B",
        special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.add_tokens(["<|user|>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": add_bos_token, "add_eos_token": add_eos_token, "clean_up_tokenization_spaces": False,
        "legacy": False}))
    return path


FAMILIES = {
    "byte-level": lambda p: byte_level_tokenizer(p),
    "byte-level-no-bos": lambda p: byte_level_tokenizer(p, add_bos_token=False),
    "byte-fallback": lambda p: byte_fallback_tokenizer(p),
    "byte-fallback-bos-eos": lambda p: byte_fallback_tokenizer(p, add_eos_token=True),
}


def _pair(kind: str, tmp_path: Path):
    from transformers import AutoTokenizer

    path = FAMILIES[kind](tmp_path / kind)
    return HFTokenizer(path / "tokenizer.json"), AutoTokenizer.from_pretrained(str(path))


def _id_sequences(hf, seed=0):
    """Encodings of the corpus, their every prefix (cuts inside multi-byte characters), and
    random id runs that mix special tokens and stray bytes (invalid UTF-8)."""
    rng = random.Random(seed)
    out = []
    for text in CORPUS:
        ids = hf(text)["input_ids"]
        out += [ids[:k] for k in range(len(ids) + 1)]
    for _ in range(40):
        out.append([rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))])
    return out


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_encode_and_decode_equal_transformers(kind, tmp_path):
    ours, hf = _pair(kind, tmp_path)
    for text in CORPUS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text
    for ids in _id_sequences(hf):
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids


def test_the_families_really_differ_where_it_matters(tmp_path):
    """The cases above are not vacuous: BOS (and EOS) are added, emoji fall back to bytes, and
    tokenizer.json's post-processor decides over tokenizer_config.json's add_bos_token, as in
    transformers 5."""
    byte_level, _ = _pair("byte-level", tmp_path)
    no_flag, _ = _pair("byte-level-no-bos", tmp_path)
    with_eos, _ = _pair("byte-fallback-bos-eos", tmp_path)
    fallback, hf_fallback = _pair("byte-fallback", tmp_path)
    assert byte_level.encode("hi")[0] == 0 and no_flag.encode("hi")[0] == 0
    assert with_eos.encode("hi")[0] == 1 and with_eos.encode("hi")[-1] == 2
    assert fallback.encode("hi")[0] == 1 and fallback.encode("hi", add_special_tokens=False)[0] != 1
    ids = fallback.encode("🦙")
    assert [hf_fallback.convert_ids_to_tokens(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert fallback.decode(ids) == "🦙"


@pytest.mark.parametrize("cls,family", [("LlamaTokenizer", byte_fallback_tokenizer), ("LlamaTokenizerFast", byte_fallback_tokenizer),
                                        ("Qwen2Tokenizer", byte_level_tokenizer)])
def test_named_tokenizer_classes_match_too(cls, family, tmp_path):
    """Real checkpoints name a class (Llama-2 and Mistral `LlamaTokenizer`, Qwen2.5
    `Qwen2Tokenizer`); transformers 5 builds its own pipeline for some of them."""
    from transformers import AutoTokenizer

    path = family(tmp_path / "named")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": cls}))
    ours, hf = HFTokenizer(path / "tokenizer.json"), AutoTokenizer.from_pretrained(str(path))
    for text in CORPUS:
        assert ours.encode(text) == hf(text)["input_ids"], text
    for ids in _id_sequences(hf):
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_streamed_text_never_splits_a_character(kind, tmp_path):
    ours, hf = _pair(kind, tmp_path)
    for text in CORPUS:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        stream = StreamDecoder(ours)
        chunks = [stream.push([i]) for i in ids] + [stream.flush()]
        assert "".join(chunks) == hf.decode(ids, skip_special_tokens=True), text
        assert not any("\ufffd" in c for c in chunks), (text, chunks)
    # a genuinely invalid byte in the middle is emitted once the next character completes
    lone = ours.encode("a", add_special_tokens=False)
    bad = [hf.convert_tokens_to_ids("<0xE2>" if kind == "byte-fallback" else "â")]
    stream = StreamDecoder(ours)
    out = [stream.push([t]) for t in lone + bad + lone] + [stream.flush()]
    assert "".join(out) == hf.decode(lone + bad + lone, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_no_token_covers_more_characters_than_max_token_chars(kind, tmp_path):
    """The bound admission refuses overlong text by (before encoding it): over the corpus and
    random text, a text never has more characters than its tokens times max_token_chars."""
    hf = HFTokenizer(FAMILIES[kind](tmp_path / kind) / "tokenizer.json")
    bound = hf.max_token_chars
    assert bound is not None and bound > 1
    rng = random.Random(1)
    alphabet = "".join(CORPUS) + "".join(map(chr, range(0x370, 0x3ff)))
    texts = CORPUS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(200)]
    for text in texts:
        assert len(text) <= max(1, len(hf.encode(text, add_special_tokens=False))) * bound, text


def test_tokenizers_that_can_fold_a_run_into_one_token_set_no_bound(tmp_path):
    """WordPiece ([UNK] for a whole unknown word) and a BPE without bytes (a fused <unk> run)
    give no max_token_chars, so admission encodes their text whatever its length."""
    for model in (models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"),
                  models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True)):
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp_path / "tokenizer.json"))
        (tmp_path / "tokenizer_config.json").write_text("{}")
        hf = HFTokenizer(tmp_path / "tokenizer.json")
        assert hf.max_token_chars is None
        assert len(hf.encode("zzzz " * 10, add_special_tokens=False)) == 10


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_token_bytes_are_what_the_tokens_stand_for(kind, tmp_path):
    """OpenAI's log-probability `bytes` of a token: its own bytes, also where the token is part
    of a character (decoded alone it is U+FFFD, whose UTF-8 was given). Over the corpus the
    tokens' bytes joined are the text's UTF-8 (the byte-fallback family's normalizer puts ▁, a
    space, before the text); special tokens stand for none, as decode skips them."""
    ours, hf = _pair(kind, tmp_path)
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False)
        if any(ours.decode([i]) == "" for i in ids):
            continue  # a special token's literal in the text: a token of its own that stands for no bytes (below)
        want = text.encode() if kind == "byte-level" or not text else (" " + text).encode()
        assert b"".join(ours.token_bytes(i) for i in ids) == want, text
    parts = [i for i in ours.encode("🦙", add_special_tokens=False) if ours.decode([i]) == "\ufffd"]
    assert parts and all(ours.token_bytes(i) != "\ufffd".encode() for i in parts)
    special = hf.convert_tokens_to_ids("<|eot_id|>" if kind == "byte-level" else "</s>")
    assert ours.token_bytes(special) == b"" and ours.decode([special]) == ""


def test_tokenizers_that_spell_no_bytes_give_none(tmp_path):
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert HFTokenizer(tmp_path / "tokenizer.json").token_bytes(1) is None
