"""Speech reward throughput, and the reward's share of a training step.

1. **Scorer throughput** on real speech: espeak-ng clips of 2-30 s (sentences of the local speech data,
   cycled), encoded with the stand-in codec (``FrameTableCodec``: decoding gives the speech back exactly)
   and scored by ``SpeechScorer`` with the bundled Whisper tiny.en, the way the reward runs it (all
   windows of a batch through one encoder and one ``generate`` call per ``asr_batch`` windows), at a few
   ``asr_batch`` sizes; against one ``WhisperModel.transcribe`` call per clip (what one writes by hand:
   greedy, ``language="en"``, faster-whisper's defaults otherwise), with the same WER and score. All
   variants share one model and the same CPU threads. Reported: clips/s and audio-seconds/s, and the
   ratio to the per-clip baseline measured in the same run.
2. **Packing** several short clips into one 30 s Whisper window (1 s of silence between clips; the words
   split back to their clips by the midpoints of their times): throughput, and whether every clip's
   normalised transcript and score equal the unpacked reward's. It would go into the reward only if they
   did, on every clip.
3. **Step-time split** (``--steps N``; 0 skips it): a local speech run of verl's real trainer
   (``maspo_verl.speech.local_assets``: tiny random Llasa-shaped model, stand-in codec, tiny.en on CPU),
   verl's ``timing_s/gen`` and ``timing_s/step`` next to the reward's time per step,
   ``reward/score_s/mean`` x samples per step (``score_s``: each scorer batch's seconds over its size;
   the ``reward/<key>/mean`` metrics are maspo_verl's plugin hook). With no reward model verl computes the
   reward inside the agent loop while the rest of the batch generates, so ``timing_s/gen`` contains it.

Writes ``README.md`` (tables and findings), ``throughput.csv``, ``packing.csv``, ``steptime_split.csv``
and ``COMMAND.txt``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from maspo_verl.lab.engine import journal
from maspo_verl.lab.engine.common import default_out, log, markdown_table, write_csv
from maspo_verl.lab.engine.study import Study

STUDY = Study("reward", "speech reward throughput (batched vs per clip, packing) and its share of a step")

WINDOW_S = 30.0
GAP_S = 1.0
THROUGHPUT_KEYS = (
    "variant",
    "asr_batch",
    "seconds",
    "cpu_s",
    "clips_per_s",
    "audio_s_per_s",
    "x_per_clip",
    "x_per_clip_cpu",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clips", type=int, default=10, help="espeak-ng clips, 2..30 s")
    p.add_argument("--batches", default="1,4,10", help="asr_batch sizes of the batched scorer")
    p.add_argument("--threads", type=int, default=2, help="CTranslate2 CPU threads (every variant)")
    p.add_argument("--steps", type=int, default=2, help="training steps of the step split (0: none; its data has 2)")
    p.add_argument("--response-tokens", type=int, default=150, help="response length there (tokens)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the training run")


# ---- clips -------------------------------------------------------------------------------------------
def make_clips(n: int) -> tuple[list[str], list]:
    """``n`` texts whose espeak-ng speech spans 2..30 s, and their 16 kHz waves."""
    from maspo_verl.speech.local_assets import TEXTS
    from maspo_verl.speech.testing import espeak

    words = " ".join(TEXTS).split()
    texts, waves = [], []
    for k in range(n):
        count = round(5 + (76 - 5) * k / max(1, n - 1))  # espeak speaks ~2.6 words/s
        while True:
            text = " ".join(words[(j + 7 * k) % len(words)] for j in range(count))
            wave = espeak(text)
            if len(wave) <= 29.5 * 16000 or count <= 1:
                break
            count = int(count * 0.9)
        texts.append(text)
        waves.append(wave)
    return texts, waves


# ---- variants ------------------------------------------------------------------------------------------
class Clock:
    """Wall and process CPU seconds (CTranslate2's threads included) since it was made."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class Recording:
    """The ASR, remembering its transcripts (in the order the scorer asked for them)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def transcribe_batch(self, waves, word_timestamps=False):
        out = self.inner.transcribe_batch(waves, word_timestamps=word_timestamps)
        self.seen += out
        return out


def batched(asr, codes, texts, batch: int):
    """The reward's scorer with ``asr_batch=batch``: (seconds, results, transcripts)."""
    from maspo_verl.speech.codec import FrameTableCodec
    from maspo_verl.speech.scorer import SpeechScorer
    from maspo_verl.speech.settings import SpeechRewardConfig

    codec, seqs = codes
    asr.batch_size = batch
    rec = Recording(asr)
    scorer = SpeechScorer(SpeechRewardConfig(codec="frame_table", asr_batch=batch), decoder=codec, asr=rec)
    assert isinstance(codec, FrameTableCodec)
    clock = Clock()
    res = scorer.score_codes(seqs, texts)
    return clock.stop(), res, [t.text for t in rec.seen]


def per_clip(asr, codes, texts):
    """One ``WhisperModel.transcribe`` call per decoded clip, then the same WER and score."""
    from maspo_verl.speech.scorer import wer_reward
    from maspo_verl.speech.text import word_error_rate

    codec, seqs = codes
    clock = Clock()
    scores, transcripts = [], []
    for seq, text in zip(seqs, texts, strict=True):
        wave = codec.decode_batch([seq])[0]
        segments, _ = asr.model.transcribe(wave, beam_size=1, language="en")
        transcripts.append("".join(s.text for s in segments).strip())
        scores.append(wer_reward(word_error_rate(text, transcripts[-1])))
    return clock.stop(), scores, transcripts


def pack(durations: list[float], window: float = WINDOW_S, gap: float = GAP_S) -> list[list[int]]:
    """Clips (indices) per window: first fit, longest first; a clip longer than the window stays alone."""
    windows: list[list[int]] = []
    used: list[float] = []
    for i in sorted(range(len(durations)), key=lambda i: -durations[i]):
        for w, total in enumerate(used):
            if total + gap + durations[i] <= window:
                windows[w].append(i)
                used[w] = total + gap + durations[i]
                break
        else:
            windows.append([i])
            used.append(durations[i])
    return windows


def packed(asr, codes, texts):
    """Short clips share a window; each clip's words are those whose midpoint falls in its span (or the
    nearest span, for a word in a gap)."""
    import numpy as np

    from maspo_verl.speech.scorer import wer_reward
    from maspo_verl.speech.text import word_error_rate

    codec, seqs = codes
    clock = Clock()
    waves = codec.decode_batch(seqs)
    groups = pack([len(w) / 16000 for w in waves])
    gap = np.zeros(int(GAP_S * 16000), dtype=np.float32)
    joined, spans = [], []
    for g in groups:
        parts, span, t = [], [], 0.0
        for k, i in enumerate(g):
            if k:
                parts.append(gap)
                t += GAP_S
            parts.append(waves[i])
            span.append((i, t, t + len(waves[i]) / 16000))
            t += len(waves[i]) / 16000
        joined.append(np.concatenate(parts))
        spans.append(span)
    words = [[] for _ in seqs]
    for tr, span in zip(asr._transcribe_windows(joined, word_timestamps=True), spans, strict=True):
        for w in tr.words or []:
            mid = (w.start + w.end) / 2
            i = min(span, key=lambda s: 0.0 if s[1] <= mid <= s[2] else min(abs(mid - s[1]), abs(mid - s[2])))[0]
            words[i].append(w.word)
    transcripts = ["".join(ws).strip() for ws in words]
    scores = [wer_reward(word_error_rate(text, tr)) for text, tr in zip(texts, transcripts, strict=True)]
    return clock.stop(), scores, transcripts, groups


# ---- step-time split -------------------------------------------------------------------------------------
def step_split(args, workdir: Path) -> tuple[list[dict], int | None]:
    from maspo_verl.lab.engine.runs import run_local
    from maspo_verl.speech.local_assets import build

    assets = build(str(workdir / "assets"))
    overrides = [f"{k}={v}" for k, v in assets.items()] + [
        "loss=grpo",
        f"trainer.total_training_steps={args.steps}",
        f"data.max_response_length={args.response_tokens}",
        "actor_rollout_ref.rollout.ignore_eos=true",
    ]
    result = run_local(overrides, workdir / "trainer", timeout_s=args.timeout)
    code = result.returncode
    log(f"reward bench: training run exit {code}, {result.wall_s:.0f}s (run folder {result.run_dir})")
    from omegaconf import OmegaConf

    from maspo_verl.util import config_dir

    local = OmegaConf.load(Path(config_dir()) / "local" / "cpu.yaml")
    samples = int(local.data.train_batch_size) * int(local.actor_rollout_ref.rollout.n)
    rows = []
    for step, m in sorted(result.steps.items()):
        reward_s = m.get("reward/score_s/mean", float("nan")) * samples
        rows.append(
            {
                "step": step,
                "samples": samples,
                "audio_s_per_sample": m.get("reward/duration_s/mean", float("nan")),
                "step_s": m.get("timing_s/step", float("nan")),
                "gen_s": m.get("timing_s/gen", float("nan")),
                "reward_s": reward_s,
                "reward_of_gen": reward_s / m.get("timing_s/gen", float("nan")),
                "update_actor_s": m.get("timing_s/update_actor", float("nan")),
                "old_log_prob_s": m.get("timing_s/old_log_prob", float("nan")),
                "reward_failed_frac": m.get("reward/failed/mean", float("nan")),
                "reward_nonspeech_frac": m.get("reward/invalid_nonspeech/mean", float("nan")),
            }
        )
    return rows, code


# ---- run ---------------------------------------------------------------------------------------------------
def run(args, argv) -> None:
    from maspo_verl.speech.asr import WhisperASR
    from maspo_verl.speech.codec import FrameTableCodec
    from maspo_verl.speech.text import normalize_text

    out = journal.start(args.out or default_out("reward"), argv)
    total = time.monotonic()
    texts, waves = make_clips(args.clips)
    durations = [len(w) / 16000 for w in waves]
    audio_s = sum(durations)
    log(f"reward bench: {len(waves)} clips, {min(durations):.1f}..{max(durations):.1f} s, {audio_s:.0f} s of speech")
    codec = FrameTableCodec(seed=0)
    codes = (codec, [codec.encode(w) for w in waves])
    asr = WhisperASR("bundled:tiny.en", device="cpu", compute_type="int8", cpu_threads=args.threads)
    asr.transcribe_batch([waves[0]])  # warm-up

    rows, results = [], {}
    (wall, cpu), base_scores, base_text = per_clip(asr, codes, texts)
    rows.append({"variant": "per clip: WhisperModel.transcribe", "asr_batch": 1, "seconds": wall, "cpu_s": cpu})
    for b in [int(x) for x in args.batches.split(",")]:
        (wall, cpu), res, transcripts = batched(asr, codes, texts, b)
        results[b] = (res, transcripts)
        rows.append({"variant": "reward scorer (batched)", "asr_batch": b, "seconds": wall, "cpu_s": cpu})
    (wall, cpu), pack_scores, pack_text, groups = packed(asr, codes, texts)
    rows.append(
        {"variant": f"packed ({len(groups)} windows)", "asr_batch": max(results), "seconds": wall, "cpu_s": cpu}
    )
    for r in rows:
        r |= {"clips_per_s": len(waves) / r["seconds"], "audio_s_per_s": audio_s / r["seconds"]}
        r["x_per_clip"] = rows[0]["seconds"] / r["seconds"]
        r["x_per_clip_cpu"] = rows[0]["cpu_s"] / r["cpu_s"]
    write_csv(out / "throughput.csv", rows)

    ref_res, ref_text = results[max(results)]
    clip_rows = []
    for i in range(len(waves)):
        clip_rows.append(
            {
                "clip": i,
                "duration_s": durations[i],
                "window": next(w for w, g in enumerate(groups) if i in g),
                "score_reward": ref_res[i]["score"],
                "score_packed": pack_scores[i],
                "score_per_clip": base_scores[i],
                "same_text_packed": normalize_text(pack_text[i]) == normalize_text(ref_text[i]),
                "same_text_per_clip": normalize_text(base_text[i]) == normalize_text(ref_text[i]),
                "transcript_reward": ref_text[i],
                "transcript_packed": pack_text[i],
            }
        )
    write_csv(out / "packing.csv", clip_rows)
    same_scores = all(
        r["score_reward"] == res[i]["score"] for res, _ in results.values() for i, r in enumerate(clip_rows)
    )

    split, code = step_split(args, Path(tempfile.mkdtemp(prefix="maspo_reward_bench_"))) if args.steps else ([], None)
    write_csv(out / "steptime_split.csv", split)
    (out / "README.md").write_text(
        readme(args, rows, clip_rows, split, code, durations, same_scores, time.monotonic() - total)
    )
    log(f"reward bench: wrote {out} in {time.monotonic() - total:.0f}s")


def readme(args, rows, clip_rows, split, code, durations, same_scores, total_s) -> str:
    moved = [r for r in clip_rows if sum(1 for s in clip_rows if s["window"] == r["window"]) > 1]
    differ = [r for r in moved if not r["same_text_packed"] or r["score_packed"] != r["score_reward"]]
    delta = [abs(r["score_packed"] - r["score_reward"]) for r in moved]
    lines = [
        "# Speech reward: throughput and share of a training step",
        "",
        f"Made by the command in `COMMAND.txt` ({total_s:.0f} s; a CPU machine shared with other jobs: ratios "
        "within one run are what to compare). What each part measures: the docstring of "
        "`maspo_verl/lab/studies/reward.py`.",
        "",
        f"## Scorer throughput: {len(durations)} espeak-ng clips, {min(durations):.1f}..{max(durations):.1f} s "
        f"({sum(durations):.0f} s of speech), Whisper tiny.en int8, {args.threads} CPU threads",
        "",
        markdown_table(rows, [*THROUGHPUT_KEYS]),
        "`seconds`: wall time; `cpu_s`: the process's CPU time (all threads), steadier on a shared machine; "
        "`x_per_clip`, `x_per_clip_cpu`: the per-clip baseline's time over the variant's (> 1: faster).",
        "",
        f"Scores of the batched scorer equal across asr_batch sizes: {'yes' if same_scores else 'NO'}. "
        f"Per-clip `transcribe` gives the reward's normalised transcript on "
        f"{sum(r['same_text_per_clip'] for r in clip_rows)} of {len(clip_rows)} clips.",
        "",
        f"## Packing short clips into one {WINDOW_S:.0f} s window ({GAP_S:.0f} s of silence between clips)",
        "",
        f"{len(moved)} of {len(clip_rows)} clips shared a window. Transcript or score different from the "
        f"unpacked reward's: {len(differ)} of those {len(moved)}"
        + (f" (|score change| max {max(delta):.3f}, mean {statistics.mean(delta):.3f})" if delta else "")
        + ". Per clip: `packing.csv`.",
        "",
        "Verdict: "
        + (
            "every packed clip kept its transcript and score on this set."
            if moved and not differ
            else "not exactly safe, so the reward does not pack. Whisper decodes a window as one text: a clip's "
            "words depend on its neighbours (the decoder conditions on the words before; punctuation and "
            "capitalisation change where clips meet), and words near a boundary can land in the wrong clip by "
            "their times. The scores would change with the batch's composition."
        ),
        "",
        f"## Step-time split: local speech run (`local=cpu`, loss=grpo, {args.response_tokens}-token responses, "
        "Whisper tiny.en on CPU)",
        "",
    ]
    if split:
        lines += [
            markdown_table(split),
            "`reward_s` = `reward/score_s/mean` x samples: the scorer's busy time in the reward worker (decode, "
            "ASR, WER). verl computes the reward in the agent loop while the batch generates, so `gen_s` "
            "contains it; step 1 includes loading Whisper. `audio_s_per_sample` (`reward/duration_s/mean`): a "
            "random model spreads its tokens over the whole vocabulary, about a third of them codec tokens "
            "(50 per second of audio). The stand-in codec decodes its codes to noise, which Whisper marks as "
            "non-speech (`reward_nonspeech_frac`), after transcribing every window as a real response would be.",
        ]
        later = [r for r in split if r["step"] >= 2]
        if later:
            share = statistics.median(r["reward_of_gen"] for r in later)
            lines += [
                "",
                f"Median of steps >= 2: the reward's time is {share:.2f}x `timing_s/gen`"
                f" ({statistics.median(r['reward_s'] for r in later):.1f} s of "
                f"{statistics.median(r['gen_s'] for r in later):.1f} s).",
            ]
    else:
        lines.append(f"(no training run: --steps {args.steps}, exit code {code})")
    return "\n".join(lines) + "\n"
