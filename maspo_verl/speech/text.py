"""Text normalisation and word error rate for the TTS reward."""

from __future__ import annotations

import re
import unicodedata

from maspo_verl.util import import_extra

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split()
)
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def _number_words(n: int) -> str:
    """Cardinal in words for 0 <= n < 10**6 (digits beyond that are spelt digit by digit)."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + _number_words(n % 100))
    if n < 10**6:
        return _number_words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + _number_words(n % 1000))
    return " ".join(_ONES[int(d)] for d in str(n))


def normalize_text(text: str) -> str:
    """Lower-case, ASCII-fold, numbers -> words, hyphens -> spaces, punctuation dropped.

    Apostrophes inside words are kept ("don't"); "&" -> "and", "%" -> "percent". Applied to both
    the ground truth and the transcript, so formatting differences (Whisper writes "2", the
    prompt says "two"; "Mr." vs "Mr") do not count as errors.
    """
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = text.replace("&", " and ").replace("%", " percent ")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)
    text = re.sub(r"\d+", lambda m: " " + _number_words(int(m.group())) + " ", text)
    text = re.sub(r"[\u2018\u2019`]", "'", text)
    text = re.sub(r"[-\u2013\u2014/]", " ", text)
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    text = re.sub(r"(^|\s)'+|'+(\s|$)", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def word_error_rate(reference: str, hypothesis: str, normalize: bool = True) -> float:
    """jiwer WER of normalised texts. Empty reference: 0 if the hypothesis is empty too, else 1.
    Not capped: insertions can push it above 1."""
    jiwer = import_extra("jiwer", "jiwer", "speech", "maspo_verl.speech")
    ref = normalize_text(reference) if normalize else reference.strip()
    hyp = normalize_text(hypothesis) if normalize else hypothesis.strip()
    if not ref:
        return 0.0 if not hyp else 1.0
    if not hyp:
        return 1.0
    return float(jiwer.wer(ref, hyp))
