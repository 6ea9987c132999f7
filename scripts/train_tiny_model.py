"""Train the shipped tiny model: a small Llama that writes Python, from the standard library.

Every machine with Python has the corpus: the `.py` files of its standard library. The
script trains a byte-level BPE tokenizer on it (the `tokenizers` library), then a small
LlamaForCausalLM (transformers) for a fixed wall-clock budget, and writes a Hugging Face
checkpoint directory: config.json, generation_config.json, model.safetensors (bf16),
tokenizer.json and tokenizer_config.json with a chat template.

Chat turns built from the corpus itself are mixed in, one per documented public function
(user: "Write a Python function `name`: <docstring's first line>", assistant: the
function's source, ended by <|end|>), so the model also answers in the chat format its
template renders.

    python scripts/train_tiny_model.py --out trtgraph/assets/stdlib-llama --seconds 70

On an H200 that is the shipped model; on a CPU pass a smaller --hidden/--layers.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import textwrap
import time
from pathlib import Path

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS, PAD, END = 0, 1, 2, 6
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def corpus_files(max_bytes: int = 200_000) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py"))
             if not {"site-packages", "dist-packages"} & set(p.parts) and p.stat().st_size <= max_bytes]
    return files


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for p in files:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def chat_examples(texts: list[str], limit: int) -> list[tuple[str, str]]:
    """(user, assistant) pairs: a function's name and docstring -> its source."""
    pairs = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                src = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip()
                if doc and src and len(src) < 1500 and not node.name.startswith("_"):
                    pairs.append((f"Write a Python function `{node.name}`: {doc.splitlines()[0]}", src))
    random.Random(0).shuffle(pairs)
    return pairs[:limit]


def render_chat(user: str, assistant: str) -> str:
    return f"<|user|>\n{user}<|end|>\n<|assistant|>\n{assistant}<|end|>\n"


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", BOS)])
    return tok


def token_stream(tok, texts: list[str], chats: list[tuple[str, str]]):
    import torch

    docs = [t for t in texts] + [render_chat(u, a) for u, a in chats]
    random.Random(1).shuffle(docs)
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(BOS)
        ids.extend(enc.ids)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.int64)


def write_checkpoint(out: Path, model, tok, vocab_size: int, max_len: int) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "model_max_length": max_len, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": BOS, "eos_token_id": [EOS, END], "pad_token_id": PAD,
        "do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 40}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seconds", type=float, default=70.0, help="wall-clock training budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-files", type=int, default=None, help="only the first N corpus files (quick checks)")
    args = ap.parse_args()

    import torch
    import transformers

    t0 = time.time()
    texts = read_texts(corpus_files()[:args.max_files])
    chats = chat_examples(texts, limit=len(texts) * 4)
    sample = random.Random(args.seed).sample(texts, min(len(texts), 400))  # ~7 MB is plenty for the merges
    tok = train_tokenizer(sample + [render_chat(u, a) for u, a in chats[:2000]], args.vocab)
    data = token_stream(tok, texts, chats)
    print(f"corpus: {len(texts)} files, {len(chats)} chat pairs, {data.numel() / 1e6:.2f}M tokens "
          f"({time.time() - t0:.1f}s)", flush=True)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.max_len, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {device}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = data.to(device)
    n_windows = data.numel() - args.max_len - 1
    gen = torch.Generator(device=device).manual_seed(args.seed)
    start, step, loss_avg = time.time(), 0, None
    model.train()
    while (elapsed := time.time() - start) < args.seconds:
        frac = elapsed / args.seconds
        warm = min(1.0, step / 100)
        for g in opt.param_groups:  # linear warm-up, cosine-ish decay to 10% over the time budget
            g["lr"] = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(frac * 3.14159)).item()))
        starts = torch.randint(0, n_windows, (args.batch,), device=device, generator=gen)
        idx = starts[:, None] + torch.arange(args.max_len + 1, device=device)[None]
        batch = data[idx]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        if step % 200 == 0:
            print(f"step {step} loss {loss_avg:.3f} ({time.time() - start:.0f}s)", flush=True)
    print(f"trained {step} steps, {step * args.batch * args.max_len / 1e6:.1f}M tokens, final loss "
          f"{loss_avg:.3f}", flush=True)
    model.eval()
    write_checkpoint(args.out, model.cpu(), tok, tok.get_vocab_size(), args.max_len)
    with torch.no_grad():
        prompt = torch.tensor([tok.encode("def parse_args(").ids])
        out = model.float().generate(prompt, max_new_tokens=40, do_sample=False)
    print("sample:", tok.decode(out[0].tolist(), skip_special_tokens=True))


if __name__ == "__main__":
    main()
