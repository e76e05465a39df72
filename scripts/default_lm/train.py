"""Train the shipped default LM: a byte-level BPE tokenizer and a tiny GPT-2, on CPU.

Deterministic for a given seed (one torch thread, deterministic algorithms, fixed step count).
Writes a directory that ``transformers.AutoModelForCausalLM/AutoTokenizer.from_pretrained``
load like any user model: fp16 safetensors, config.json, generation_config.json, the tokenizer
files and ``training_report.json``.

    python scripts/default_lm/train.py --out src/shim_adapters/assets/default_lm
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus as corpus_mod  # noqa: E402

EOS = "<|endoftext|>"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "src/shim_adapters/assets/default_lm"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text is encodable); digits are split one per token so that
    digit strings (binary5, constants, numbers) are generated one choice at a time."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, unk_token=EOS, model_max_length=256,
                                   clean_up_tokenization_spaces=False)


def padded_vocab(n_tokens: int, multiple: int = 64) -> int:
    """Logit width strictly above the tokenizer length, rounded to a multiple (as real LMs
    pad their embeddings): code downstream must mask ids the tokenizer never produces."""
    return (n_tokens // multiple + 1) * multiple


def batches(seqs: list[list[int]], batch_size: int, pad_id: int, generator: torch.Generator):
    """Length-bucketed batches in a seeded random order; labels are -100 on padding."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for g in torch.randperm(len(groups), generator=generator).tolist():
        rows = [seqs[i] for i in groups[g]]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row)
            mask[r, :len(row)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        yield ids, mask, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=corpus_mod.SEED)
    parser.add_argument("--bpe-vocab", type=int, default=1024)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    # 2 heads of size 32: vLLM's CPU attention supports head sizes of 32 and up (the parameter
    # count does not depend on the head count)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=4.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-validation", action="store_true",
                        help="do not label the corpus with the reference acceptors (faster)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    docs = corpus_mod.build_corpus(args.seed)
    texts = [d.text for d in docs]
    rates = None if args.skip_validation else corpus_mod.invalid_rates(docs)
    tokenizer = train_tokenizer(texts, args.bpe_vocab)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    seqs = [ids[:255] + [eos_id] for ids in tokenizer(texts)["input_ids"]]
    n_tokens = sum(map(len, seqs))

    config = GPT2Config(vocab_size=padded_vocab(len(tokenizer)), n_positions=256,
                        n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = math.ceil(len(seqs) / args.batch_size)
    total_steps = int(args.epochs * steps_per_epoch)
    warmup = max(1, total_steps // 20)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                            betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / total_steps)))))
    gen = torch.Generator().manual_seed(args.seed)

    model.train()
    losses: list[float] = []
    step, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while step < total_steps:
        for ids, mask, labels in batches(seqs, args.batch_size, eos_id, gen):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            step += 1
            if step % 100 == 0:
                print(f"step {step}/{total_steps} loss {sum(losses[-100:]) / 100:.4f} "
                      f"{time.perf_counter() - start:.0f}s", flush=True)
            if step >= total_steps:
                break
    train_time = time.perf_counter() - start
    train_cpu = time.process_time() - cpu_start
    final_loss = sum(losses[-50:]) / len(losses[-50:])

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.half().save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                     do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                     max_new_tokens=128).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    report = {
        "seed": args.seed,
        "corpus": {"documents": len(docs), "tokens": n_tokens,
                   "per_domain_invalid_rate": rates,
                   "control_prompt": corpus_mod.CONTROL_PROMPT,
                   "text_prompts": list(corpus_mod.TEXT_PROMPTS)},
        "tokenizer_length": len(tokenizer),
        "model": {"vocab_size": config.vocab_size, "n_embd": args.n_embd,
                  "n_layer": args.n_layer, "n_head": args.n_head, "n_positions": 256,
                  "parameters": n_params, "dtype_on_disk": "float16"},
        "training": {"epochs": args.epochs, "steps": total_steps, "batch_size": args.batch_size,
                     "lr": args.lr, "threads": args.threads, "train_seconds": round(train_time, 1),
                     "train_cpu_seconds": round(train_cpu, 1),
                     "final_loss": round(final_loss, 4)},
        "versions": {"python": platform.python_version(),
                     **{p: metadata.version(p) for p in ("torch", "transformers", "tokenizers")}},
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
