"""Train the bundled byte-level BPE tokenizer on the Python standard library's sources.

Run once; the result ships as engram_serve/data/tiny/tokenizer.json.
    python scripts/make_tokenizer.py --vocab-size 4096 --out engram_serve/data/tiny/tokenizer.json
"""
import argparse
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|image|>"]


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", default="engram_serve/data/tiny/tokenizer.json")
    args = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    files = [str(p) for p in stdlib_files() if "test" not in p.parts]
    tok.train(files, trainer)
    tok.save(args.out)
    print(f"saved {args.out}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
