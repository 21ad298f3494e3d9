"""Text prompts -> verl parquet for the TTS recipe; and the chat-template override.

    # from a public corpus (Hugging Face `datasets`, text column only is used)
    python -m maspo_verl.speech.prepare data --hf-dataset mythicinfinity/libritts_r --hf-config clean \\
        --hf-split train.clean.100 --text-column text_normalized --out-dir ~/data/maspo_speech
    # from local files: .txt (one text per line), .jsonl/.json, .csv/.tsv, .parquet
    python -m maspo_verl.speech.prepare data --files my_texts.txt more.jsonl --out-dir ~/data/maspo_speech
    # the Hydra override that makes verl's prompt end with <|SPEECH_GENERATION_START|>
    python -m maspo_verl.speech.prepare chat-template --tokenizer HKUSTAudio/Llasa-1B --hydra
    # make vLLM stop at <|SPEECH_GENERATION_END|> (checks / patches generation_config.json)
    python -m maspo_verl.speech.prepare stop-token --model /models/Llasa-1B --write

Rows (verl's RLHFDataset format): ``data_source`` ("tts/<corpus>"), ``prompt`` (the Llasa user
turn, see ``tokens.prompt_for_verl``), ``ability`` "tts", ``reward_model`` {"style": "rule",
"ground_truth": text}, ``extra_info`` {"split", "index", "text", "ref_audio" if given}.
Filters: whitespace collapsed, ``min_chars..max_chars`` characters, ``min_words..max_words`` words,
only texts whose normalised form is non-empty, duplicates dropped. The default ``max_chars`` 300 is
~21 s of speech at 14 chars/s, well inside a 2000-token (40 s) response budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from collections.abc import Iterable, Iterator

from maspo_verl.speech.text import normalize_text
from maspo_verl.speech.tokens import prompt_for_verl
from maspo_verl.util import write_parquet


def _read_local(path: str, text_column: str) -> Iterator[str]:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".txt", ".text", ""):
        with open(path, encoding="utf-8") as f:
            yield from (line.rstrip("\n") for line in f)
    elif ext in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            if ext == ".json":
                rows = json.load(f)
                rows = rows if isinstance(rows, list) else [rows]
            else:
                rows = (json.loads(line) for line in f if line.strip())
            for row in rows:
                yield row[text_column] if isinstance(row, dict) else str(row)
    elif ext in (".csv", ".tsv"):
        import csv

        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f, delimiter="\t" if ext == ".tsv" else ","):
                yield row[text_column]
    elif ext == ".parquet":
        import pyarrow.parquet as pq

        yield from (str(t) for t in pq.read_table(path, columns=[text_column]).column(text_column).to_pylist())
    else:
        raise ValueError(f"{path}: unsupported file type {ext!r} (txt, jsonl, json, csv, tsv, parquet)")


def _read_hf(name: str, config: str | None, split: str, text_column: str, limit: int | None) -> Iterator[str]:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError("--hf-dataset needs the datasets package (pip install datasets)") from exc
    ds = datasets.load_dataset(name, config, split=split, streaming=True)
    try:  # keep only the text column so audio is not decoded
        ds = ds.select_columns([text_column])
    except Exception:
        pass
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        yield row[text_column]


def filter_texts(texts: Iterable[str], min_chars: int, max_chars: int, min_words: int, max_words: int) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for t in texts:
        t = re.sub(r"\s+", " ", str(t or "")).strip()
        n_words = len(t.split())
        if not (min_chars <= len(t) <= max_chars and min_words <= n_words <= max_words):
            continue
        key = normalize_text(t)
        if not key or key in seen:
            continue
        seen.add(key)
        out.append(t)
    return out


def make_rows(texts: list[str], split: str, data_source: str, ref_audio: str | None = None) -> list[dict]:
    rows = []
    for i, t in enumerate(texts):
        extra = {"split": split, "index": i, "text": t}
        if ref_audio:
            extra["ref_audio"] = ref_audio
        rows.append(
            {
                "data_source": data_source,
                "prompt": prompt_for_verl(t),
                "ability": "tts",
                "reward_model": {"style": "rule", "ground_truth": t},
                "extra_info": extra,
            }
        )
    return rows


def cmd_data(args: argparse.Namespace) -> int:
    texts: list[str] = []
    if args.hf_dataset:
        texts += list(_read_hf(args.hf_dataset, args.hf_config, args.hf_split, args.text_column, args.hf_limit))
    for path in args.files or []:
        texts += list(_read_local(path, args.text_column))
    if not texts:
        print("no input: give --hf-dataset and/or --files", file=sys.stderr)
        return 2
    kept = filter_texts(texts, args.min_chars, args.max_chars, args.min_words, args.max_words)
    random.Random(args.seed).shuffle(kept)
    if args.max_samples:
        kept = kept[: args.max_samples]
    n_val = min(args.val_size, max(0, len(kept) - 1))
    val, train = kept[:n_val], kept[n_val:]
    source = "tts/" + (args.data_source or (args.hf_dataset or "local").split("/")[-1])
    write_parquet(make_rows(train, "train", source, args.ref_audio), os.path.join(args.out_dir, "train.parquet"))
    write_parquet(make_rows(val, "test", source, args.ref_audio), os.path.join(args.out_dir, "test.parquet"))
    print(f"read {len(texts)} texts, kept {len(kept)}: {len(train)} train, {len(val)} test -> {args.out_dir}")
    return 0


def cmd_chat_template(args: argparse.Namespace) -> int:
    from maspo_verl.speech.tokens import hydra_quote, speech_chat_template

    if args.template_file:
        with open(args.template_file) as f:
            template = f.read()
    else:
        from transformers import AutoTokenizer

        # Llasa's tokenizer is plain; a tokenizer's own code runs only when asked (--trust-remote-code)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
        template = speech_chat_template(tokenizer)
    print(f"+actor_rollout_ref.model.custom_chat_template={hydra_quote(template)}" if args.hydra else template)
    return 0


def cmd_stop_token(args: argparse.Namespace) -> int:
    """vLLM stops at the ids in the model's generation_config.json ``eos_token_id``; Llasa must stop
    at <|SPEECH_GENERATION_END|>. Report, and with --write add it (a one-line change to a local copy)."""
    from transformers import AutoTokenizer

    from maspo_verl.speech.tokens import LlasaTokenMap

    end = LlasaTokenMap.from_tokenizer(AutoTokenizer.from_pretrained(args.model)).speech_end_id
    path = os.path.join(args.model, "generation_config.json")
    cfg = json.load(open(path)) if os.path.isfile(path) else {}
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    if end in eos:
        print(f"ok: {path} stops at <|SPEECH_GENERATION_END|> ({end}); eos_token_id={eos}")
        return 0
    if not args.write:
        print(f"MISSING: {path} eos_token_id={eos} lacks <|SPEECH_GENERATION_END|> ({end}); rerun with --write")
        return 1
    cfg["eos_token_id"] = eos + [end]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"wrote {path}: eos_token_id={cfg['eos_token_id']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m maspo_verl.speech.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="write train.parquet / test.parquet")
    d.add_argument("--hf-dataset")
    d.add_argument("--hf-config")
    d.add_argument("--hf-split", default="train")
    d.add_argument("--hf-limit", type=int, default=None, help="read at most this many rows from the corpus")
    d.add_argument("--files", nargs="*")
    d.add_argument("--text-column", default="text")
    d.add_argument("--out-dir", required=True)
    d.add_argument("--data-source")
    d.add_argument("--min-chars", type=int, default=10)
    d.add_argument("--max-chars", type=int, default=300)
    d.add_argument("--min-words", type=int, default=3)
    d.add_argument("--max-words", type=int, default=60)
    d.add_argument("--max-samples", type=int, default=0)
    d.add_argument("--val-size", type=int, default=256)
    d.add_argument("--ref-audio", help="reference clip for the speaker-similarity term (stored in extra_info)")
    d.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("chat-template", help="print the chat template (or its Hydra override) for verl")
    source = c.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", help="derive the template from this tokenizer")
    source.add_argument("--template-file", help="use the template in this file as it is")
    c.add_argument("--hydra", action="store_true")
    c.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python code a tokenizer on the hub ships (off: Llasa's tokenizer needs none)",
    )
    st = sub.add_parser("stop-token", help="check/add <|SPEECH_GENERATION_END|> in generation_config.json")
    st.add_argument("--model", required=True, help="local model folder")
    st.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    return {"data": cmd_data, "chat-template": cmd_chat_template, "stop-token": cmd_stop_token}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
