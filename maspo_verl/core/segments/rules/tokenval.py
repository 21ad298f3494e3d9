"""tokenval: a new segment where neighbouring speech-codec codes are far apart."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from maspo_verl import fsq
from maspo_verl.core.segments.rule import (
    FORCED,
    RESPONSE_IDS,
    Candidates,
    Example,
    Packed,
    SegmentRule,
    Sweep,
    previous,
    quantile_grid,
)
from maspo_verl.validation import Choice, Float, Int, Ints, Setting, fail

TOKENVAL_DISTANCES = ("id", "fsq_l1", "fsq_hamming")


def tokenval_scores(
    token_ids: torch.Tensor,
    packed: Packed,
    *,
    codec_offset: int,
    codec_size: int,
    distance: str,
    fsq_levels: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distance between neighbouring codec codes (packed, an integer type); returns (distance,
    outside_codec_boundary).

    A token outside [codec_offset, codec_offset + codec_size) (text, special tokens), and the
    token after it, start segments of their own: the second tensor marks them.
    """
    # int32 when the ids fit: several times faster than int64 on CPU
    dtype = torch.int32 if codec_offset + codec_size < 2**31 else torch.long
    ids = packed.pack(token_ids.to(dtype))
    in_codec = (ids >= codec_offset).logical_and_(ids < codec_offset + codec_size)
    # code + 1 inside the codec, 0 outside: the previous column brings the previous code and membership
    code1 = ids.sub_(codec_offset - 1).mul_(in_codec)
    prev_code1 = previous(code1)
    has_prev = packed.has_previous
    both = (prev_code1 > 0).logical_and_(in_codec).logical_and_(has_prev)
    if distance == "id":
        dist = (code1 - prev_code1).abs_()
    else:
        dist = fsq.distance(code1.sub_(1).clamp_(min=0), prev_code1.sub_(1).clamp_(min=0), fsq_levels, distance)
    return dist.mul_(both), has_prev & ~both


class TokenvalRule(SegmentRule):
    """A new segment where neighbouring codec codes (id − `codec_offset`) differ by more than `tokenval_threshold`
    under `tokenval_distance`; text and special tokens are segments of their own."""

    name = "tokenval"
    needs = frozenset({RESPONSE_IDS})
    settings = (
        Setting("tokenval_threshold", 8.0, Float(0.0), "code distance above which a new segment starts"),
        Setting(
            "tokenval_distance",
            "fsq_l1",
            Choice(TOKENVAL_DISTANCES),
            "id: abs(code difference); fsq_l1 / fsq_hamming: over the FSQ digits of `fsq_levels`",
        ),
        Setting("codec_offset", 128264, Int(0), "vocabulary id of code 0 (Llasa-1B: 128264)"),
        Setting("codec_size", 65536, Int(1), "number of codec codes"),
        Setting("fsq_levels", [4] * 8, Ints(2), "FSQ levels of the codebook (XCodec2: [4]*8); product = `codec_size`"),
    )
    # every code distance is at most the codec's size (id) or its digit count x the largest level (fsq):
    # below 2**31; a threshold of 0 with the id distance ends a segment at every change of code
    limits = {"sequence": {"tokenval_threshold": float(2**31)}}
    reads_codec = True
    examples = (
        Example(
            "code distances 1 2 17 1 19 with threshold 5: new segments at the 17 and the 19",
            ((1,) * 6,),
            ((3, 2, 1),),
            {"tokenval_distance": "id", "tokenval_threshold": 5.0, "codec_offset": 100, "codec_size": 50},
            {RESPONSE_IDS: ((100, 101, 103, 120, 121, 140),)},
        ),
        Example(
            "a text token (id 5, outside the codec) is a segment of its own",
            ((1,) * 5,),
            ((2, 1, 2),),
            {"tokenval_distance": "id", "tokenval_threshold": 5.0, "codec_offset": 100, "codec_size": 50},
            {RESPONSE_IDS: ((100, 101, 5, 102, 103),)},
        ),
        Example(
            "fsq_l1 over levels [4, 4]: codes 0 5 6 10 are digits 00 11 12 22 (L1 2, 1, 1), threshold 1.5",
            ((1,) * 4,),
            ((1, 3),),
            {
                "tokenval_distance": "fsq_l1",
                "tokenval_threshold": 1.5,
                "codec_offset": 100,
                "codec_size": 16,
                "fsq_levels": [4, 4],
            },
            {RESPONSE_IDS: ((100, 105, 106, 110),)},
        ),
        Example(
            "at the cutoff: distances 2 then 3 with threshold 2: a distance equal to it starts nothing, 3 does",
            ((1,) * 3,),
            ((2, 1),),
            {"tokenval_distance": "id", "tokenval_threshold": 2.0, "codec_offset": 100, "codec_size": 50},
            {RESPONSE_IDS: ((100, 102, 105),)},
        ),
        Example(
            "a hair under the cutoff: threshold 1 - 2^-30, distances 1 then 0: the 1 starts a segment",
            ((1,) * 3,),
            ((1, 2),),
            {"tokenval_distance": "id", "tokenval_threshold": 1.0 - 2.0**-30, "codec_offset": 100, "codec_size": 50},
            {RESPONSE_IDS: ((100, 101, 101),)},
        ),
    )

    def candidates(self, config, packed, inputs):
        dist, outside = tokenval_scores(
            inputs.get(RESPONSE_IDS),
            packed,
            codec_offset=config.codec_offset,
            codec_size=config.codec_size,
            distance=config.tokenval_distance,
            fsq_levels=config.fsq_levels,
        )
        # integer distances: d > threshold exactly when d > floor(threshold), compared in integers (a float threshold
        # against a float32 tensor would be rounded to float32 first), capped at the distances' largest value
        above = dist > min(math.floor(config.tokenval_threshold), torch.iinfo(dist.dtype).max)
        return Candidates(packed.valid & above, dist.float(), outside)

    def reference(self, config, row):
        def code(token_id):  # None outside the codec
            return token_id - config.codec_offset if 0 <= token_id - config.codec_offset < config.codec_size else None

        def digits(c):  # mixed radix, digit 0 least significant
            out = []
            for level in config.fsq_levels:
                out.append(c % level)
                c //= level
            return out

        def distance(a, b):
            if config.tokenval_distance == "id":
                return abs(a - b)
            pairs = zip(digits(a), digits(b), strict=True)
            if config.tokenval_distance == "fsq_l1":
                return sum(abs(x - y) for x, y in pairs)
            return sum(x != y for x, y in pairs)

        out = [None]
        for p in range(1, len(row.response_ids)):
            a, b = code(row.response_ids[p - 1]), code(row.response_ids[p])
            if a is None or b is None:  # a token outside the codec, or the one after it
                out.append(FORCED)
            else:
                d = distance(a, b)
                out.append(float(d) if d > config.tokenval_threshold else None)
        return out

    def sweeps(self, config, packed, inputs):
        ids = packed.pack(inputs.get(RESPONSE_IDS))
        offset, size = config.codec_offset, config.codec_size
        if not bool((packed.valid & (ids >= offset) & (ids < offset + size)).any()):
            return [
                f"tokenval left out: no response id lies in the codec range [{offset}, {offset + size}) "
                "(policy_loss.codec_offset / codec_size; set them with --set)"
            ]
        out: list[Sweep | str] = []
        for distance in TOKENVAL_DISTANCES:
            if distance != "id" and math.prod(config.fsq_levels) != size:
                out.append(f"tokenval/{distance} left out: prod(fsq_levels) != codec_size")
                continue
            if distance == "id":
                settings = dict(codec_offset=offset, codec_size=size, distance=distance, fsq_levels=config.fsq_levels)
                dist, outside = tokenval_scores(inputs.get(RESPONSE_IDS), packed, **settings)
                grid = tuple(sorted({0.0, *quantile_grid(dist[packed.has_previous & ~outside])}))
            else:  # every possible digit distance below the largest
                top = sum(v - 1 for v in config.fsq_levels) if distance == "fsq_l1" else len(config.fsq_levels)
                grid = tuple(float(t) for t in range(top))
            fixed = {"segment_rule": self.name, "tokenval_distance": distance}
            out.append(Sweep(f"tokenval/{distance}", fixed, "tokenval_threshold", grid))
        return out

    def validate(self, config):
        if config.tokenval_distance != "id" and math.prod(config.fsq_levels) != config.codec_size:
            fail(
                "fsq_levels",
                config.fsq_levels,
                f"levels whose product equals policy_loss.codec_size={config.codec_size} "
                f"(tokenval_distance={config.tokenval_distance!r} splits codes into FSQ digits)",
            )
