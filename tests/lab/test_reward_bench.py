"""The reward benchmark's packing of clips into Whisper windows (the throughput numbers are the bench's)."""

from maspo_verl.lab.studies.reward import GAP_S, WINDOW_S, pack


def test_pack_fills_windows_first_fit_longest_first():
    durations = [2.0, 29.0, 31.0, 10.0, 3.5, 14.0, 12.0, 2.2]
    windows = pack(durations)
    assert sorted(i for w in windows for i in w) == list(range(len(durations)))  # every clip exactly once
    for w in windows:  # clips plus the silences between them fit, except a lone clip longer than a window
        assert len(w) == 1 or sum(durations[i] for i in w) + GAP_S * (len(w) - 1) <= WINDOW_S
    # by hand: 31 | 29 | 14 + 12 + 2.0 (29.0 with gaps) | 10 + 3.5 + 2.2 (17.7)
    assert windows == [[2], [1], [5, 6, 0], [3, 4, 7]]
