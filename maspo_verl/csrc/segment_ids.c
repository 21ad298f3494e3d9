/*
 * Segment ids of maspo_verl.segments, one row at a time (the C path of compute_segment_ids).
 *
 * The vectorised torch code in maspo_verl/segments/ defines the rules; this file computes the
 * same ids row by row: a row's valid tokens are copied run by run into dense arrays (the packed row
 * of segments.Packed), the rule and the length limits run on those in short loops the compiler
 * vectorises, and the ids are copied back run by run. Only the rule a row needs runs (the words
 * rule's fallback on rows without words only). Built and loaded by maspo_verl/native.py; floats are
 * compared exactly as torch compares them (float32 arithmetic, no contraction), so both paths give
 * identical ids.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { RULE_FIXED = 0, RULE_LOGPROB = 1, RULE_TOKENVAL = 2, RULE_WORDS = 3, RULE_TURNS = 4 };
enum { DIST_ID = 0, DIST_L1 = 1, DIST_HAMMING = 2 };
enum { F32 = 0, F64 = 1, BF16 = 2 };
enum { I64 = 0, I32 = 1 };
enum { BOUND = 1, FORCED = 2 };
enum { ROW_EMPTY = 0, ROW_OWN_RULE = 1, ROW_FALLBACK = 2 };
#define MAX_GROUPS 64
#define NO_WORD (-1)

/* Mirrors maspo_verl.native.Config (ctypes). */
typedef struct {
    int64_t rule, fallback_rule, window, per_sample, min_len, max_len, turn_window;
    double logprob_threshold, tokenval_threshold, std_floor, max_drop;
    int64_t codec_offset, codec_size, distance, n_groups;
    /* FSQ digits in groups: digit group g of code c is (c / radix) % size, by shift and mask when
     * shift >= 0; its distance is table[ga * size + gb] (uint8) or, with no table (a single large
     * digit), computed directly */
    int64_t group_radix[MAX_GROUPS], group_size[MAX_GROUPS], group_shift[MAX_GROUPS];
    const uint8_t *group_table[MAX_GROUPS];
} config;

typedef struct {
    int64_t T;
    const uint8_t *mask;
    const void *logp;
    int64_t logp_dtype;
    const void *tokens;
    int64_t tokens_dtype;
    const void *words;
    int64_t words_dtype;
    const config *cfg;
    int64_t *ids;
    int8_t *row_state;
    void *sizes;
    int64_t sizes_dtype;
} job;

typedef struct {
    const job *j;
    int64_t r0, r1;
    int status, started;
} slice;

/* One thread's buffers, each with room for a row (and min_len - 1 guard columns on either side). */
typedef struct {
    int64_t *runs;   /* [start, end) of each run of valid tokens, 2 per run */
    int64_t *ints;   /* packed token or word ids, then the segment ids */
    int64_t *first;  /* each segment's first token */
    float *floats;   /* packed log-probs */
    float *score, *ext, *s1, *s2;
    uint8_t *flags;
    int64_t n_runs, n;
} scratch;

/* The runs of valid tokens of a mask row (0/1 bytes) into sc->runs; returns the number of valid tokens. */
static int64_t find_runs(const uint8_t *m, int64_t T, scratch *sc) {
    int64_t t = 0, n = 0, r = 0;
    while (t < T) {
        uint64_t word;
        while (t + 8 <= T && (memcpy(&word, m + t, 8), word == 0)) t += 8; /* skip padding 8 bytes at a time */
        while (t < T && !m[t]) t++;
        if (t == T) break;
        const uint8_t *zero = memchr(m + t, 0, (size_t)(T - t));
        int64_t end = zero ? zero - m : T;
        sc->runs[r++] = t;
        sc->runs[r++] = end;
        n += end - t;
        t = end;
    }
    sc->n_runs = r / 2;
    return n;
}

/* The row's valid entries of an integer input, packed, as int64. */
static void pack_ints(const void *p, int64_t dtype, int64_t base, const scratch *sc, int64_t *out) {
    for (int64_t r = 0, k = 0; r < sc->n_runs; r++) {
        int64_t a = sc->runs[2 * r], len = sc->runs[2 * r + 1] - a;
        if (dtype == I64) {
            memcpy(out + k, (const int64_t *)p + base + a, sizeof(int64_t) * (size_t)len);
        } else {
            const int32_t *src = (const int32_t *)p + base + a;
            for (int64_t i = 0; i < len; i++) out[k + i] = src[i];
        }
        k += len;
    }
}

/* The row's valid log-probs, packed, as float32 (the conversion torch's .float() makes). */
static void pack_floats(const void *p, int64_t dtype, int64_t base, const scratch *sc, float *out) {
    for (int64_t r = 0, k = 0; r < sc->n_runs; r++) {
        int64_t a = sc->runs[2 * r], len = sc->runs[2 * r + 1] - a;
        if (dtype == F32) {
            memcpy(out + k, (const float *)p + base + a, sizeof(float) * (size_t)len);
        } else if (dtype == F64) {
            const double *src = (const double *)p + base + a;
            for (int64_t i = 0; i < len; i++) out[k + i] = (float)src[i];
        } else {
            const uint16_t *src = (const uint16_t *)p + base + a;
            for (int64_t i = 0; i < len; i++) { /* bfloat16: the high half of a float32 */
                const uint32_t bits = (uint32_t)src[i] << 16;
                memcpy(out + k + i, &bits, sizeof bits);
            }
        }
        k += len;
    }
}

static inline int64_t fsq_distance(const config *c, int64_t a, int64_t b) {
    int64_t dist = 0;
    for (int64_t g = 0; g < c->n_groups; g++) {
        int64_t size = c->group_size[g], da, db;
        if (c->group_shift[g] >= 0) {
            da = (a >> c->group_shift[g]) & (size - 1);
            db = (b >> c->group_shift[g]) & (size - 1);
        } else {
            da = (a / c->group_radix[g]) % size;
            db = (b / c->group_radix[g]) % size;
        }
        if (c->group_table[g])
            dist += c->group_table[g][da * size + db];
        else
            dist += c->distance == DIST_L1 ? llabs(da - db) : (da != db);
    }
    return dist;
}

/* Sums in float64 with four running sums (the order differs from torch's only by float64 round-off). */
static double sum_f64(const float *restrict x, int64_t n) {
    double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        a0 += x[k];
        a1 += x[k + 1];
        a2 += x[k + 2];
        a3 += x[k + 3];
    }
    for (; k < n; k++) a0 += x[k];
    return (a0 + a1) + (a2 + a3);
}

static double sum_squares_f64(const float *restrict x, int64_t n, double centre) {
    double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        const double d0 = x[k] - centre, d1 = x[k + 1] - centre, d2 = x[k + 2] - centre, d3 = x[k + 3] - centre;
        a0 += d0 * d0;
        a1 += d1 * d1;
        a2 += d2 * d2;
        a3 += d3 * d3;
    }
    for (; k < n; k++) a0 += (x[k] - centre) * (x[k] - centre);
    return (a0 + a1) + (a2 + a3);
}

typedef struct {
    const config *c;
    const int64_t *code;
    int64_t n, size;
    float threshold;
    int64_t shift[8], bits[8];
    const uint8_t *table[8];
    uint8_t *flags;
    float *score;
} tokenval_args;

/* The tokenval candidates of codes (id - codec_offset): with groups >= 0, FSQ digit groups by shift,
 * mask and table; with groups < 0, fsq_distance or the id distance. The arguments come by value: a
 * copy of the caller's whose fields stores to flags cannot alias, so they stay in registers. */
static inline void tokenval_loop(const tokenval_args p, int64_t groups, int whole_bytes) {
    const int64_t *restrict code = p.code;
    uint8_t *restrict flags = p.flags;
    float *restrict score = p.score;
    const uint64_t size = (uint64_t)p.size;
    const float threshold = p.threshold;
    const int64_t n = p.n;
    for (int64_t k = 1; k < n; k++) {
        const int64_t a = code[k], b = code[k - 1];
        const int both = ((uint64_t)a < size) & ((uint64_t)b < size);
        int64_t dist = 0;
        if (groups >= 0) { /* masked digits index the table whatever the codes: computed for every token */
            for (int64_t g = 0; g < groups; g++) {
                if (whole_bytes) { /* group g is byte g: constant shifts once unrolled */
                    dist += p.table[g][(((a >> (8 * g)) & 255) << 8) | ((b >> (8 * g)) & 255)];
                } else {
                    const int64_t mask = ((int64_t)1 << p.bits[g]) - 1;
                    dist += p.table[g][(((a >> p.shift[g]) & mask) << p.bits[g]) | ((b >> p.shift[g]) & mask)];
                }
            }
        } else if (both) {
            dist = p.c->distance == DIST_ID ? llabs(a - b) : fsq_distance(p.c, a, b);
        }
        const float sk = both ? (float)dist : 0.0f;
        score[k] = sk;
        /* a token outside the codec, and the one after it, are forced boundaries */
        flags[k] = (uint8_t)(both ? (sk > threshold ? BOUND : 0) : FORCED | BOUND);
    }
}

static inline float clampf(float x, float limit) { return x < -limit ? -limit : (x > limit ? limit : x); }

/* Candidate boundaries (flags) and their scores for a row's n valid tokens, packed. For RULE_WORDS,
 * returns whether a valid token belongs to a word (1 for the other rules). */
static int candidates(const job *j, const config *c, int64_t rule, int64_t row, scratch *sc) {
    const int64_t n = sc->n, base = row * j->T;
    uint8_t *restrict flags = sc->flags;
    float *restrict score = sc->score;
    if (rule == RULE_FIXED) {
        for (int64_t k = 0, phase = 0; k < n; k++, phase = phase + 1 == c->window ? 0 : phase + 1) {
            flags[k] = phase == 0 ? BOUND : 0;
            score[k] = 1.0f;
        }
    } else if (rule == RULE_LOGPROB) {
        const float max_drop = (float)c->max_drop;
        float *restrict lp = sc->floats;
        pack_floats(j->logp, j->logp_dtype, base, sc, lp);
        /* as torch.nan_to_num(nan=0, posinf=max_drop, neginf=-max_drop) */
        for (int64_t k = 0; k < n; k++) {
            const float x = lp[k] != lp[k] ? 0.0f : lp[k];
            lp[k] = x == INFINITY ? max_drop : (x == -INFINITY ? -max_drop : x);
        }
        score[0] = 0.0f;
        for (int64_t k = 1; k < n; k++) score[k] = clampf(lp[k - 1] - lp[k], max_drop);
        if (c->per_sample) {
            /* mean and population standard deviation of the row's drops, in float64 */
            const double count = n > 1 ? (double)(n - 1) : 1.0;
            const double mu = sum_f64(score + 1, n - 1) / count;
            const double sd = sqrt(sum_squares_f64(score + 1, n - 1, mu) / count);
            const double cutoff = mu + c->logprob_threshold * (sd > c->std_floor ? sd : c->std_floor);
            /* a float32 exceeds the cutoff exactly when it exceeds the largest float32 <= cutoff */
            float low = (float)cutoff;
            if ((double)low > cutoff) low = nextafterf(low, -INFINITY);
            for (int64_t k = 0; k < n; k++) flags[k] = score[k] > low ? BOUND : 0;
        } else {
            const float threshold = (float)c->logprob_threshold;
            for (int64_t k = 0; k < n; k++) flags[k] = score[k] > threshold ? BOUND : 0;
        }
    } else if (rule == RULE_TOKENVAL) {
        const float threshold = (float)c->tokenval_threshold;
        const int64_t size = c->codec_size;
        int64_t *restrict code = sc->ints;
        pack_ints(j->tokens, j->tokens_dtype, base, sc, code);
        for (int64_t k = 0; k < n; k++) code[k] -= c->codec_offset;
        score[0] = 0.0f;
        flags[0] = 0;
        /* digit groups read by shift and mask and looked up in a table; the loop with the group count
         * a constant (unrolled) for the usual one to four groups, and constant shifts when each group
         * is a whole byte (XCodec2's [4]*8: two bytes) */
        tokenval_args args = {c, code, n, size, threshold, {0}, {0}, {0}, flags, score};
        int by_table = c->distance != DIST_ID && c->n_groups <= 8, whole_bytes = by_table;
        for (int64_t g = 0; by_table && g < c->n_groups; g++) {
            by_table = c->group_shift[g] >= 0 && c->group_table[g] != NULL;
            whole_bytes &= by_table && c->group_size[g] == 256 && c->group_shift[g] == 8 * g;
            args.shift[g] = c->group_shift[g];
            args.bits[g] = __builtin_ctzll((unsigned long long)c->group_size[g]);
            args.table[g] = c->group_table[g];
        }
        const int64_t groups = by_table ? c->n_groups : -1;
        switch (whole_bytes ? groups : groups + 16) {
        case 1: tokenval_loop(args, 1, 1); break;
        case 2: tokenval_loop(args, 2, 1); break;
        case 3: tokenval_loop(args, 3, 1); break;
        case 4: tokenval_loop(args, 4, 1); break;
        default: tokenval_loop(args, groups, 0);
        }
    } else if (rule == RULE_TURNS) {
        /* a turn is a run of valid tokens: each turn's first token but the row's first is a forced
         * boundary (min_len never joins two turns); with turn_window > 0 every turn_window-th token
         * of a turn is a boundary too */
        const int64_t w = c->turn_window;
        for (int64_t r = 0, k = 0; r < sc->n_runs; r++) {
            const int64_t len = sc->runs[2 * r + 1] - sc->runs[2 * r];
            for (int64_t i = 0, phase = 0; i < len; i++, k++, phase = phase + 1 == w ? 0 : phase + 1) {
                flags[k] = w > 0 && phase == 0 ? BOUND : 0;
                score[k] = 1.0f;
            }
            if (r > 0) flags[k - len] = FORCED | BOUND;
        }
    } else { /* RULE_WORDS: a boundary where the word id changes; score 2 on a word, 1 on a gap */
        int64_t *restrict w = sc->ints;
        pack_ints(j->words, j->words_dtype, base, sc, w);
        int any = 0;
        flags[0] = 0;
        for (int64_t k = 1; k < n; k++) flags[k] = w[k] != w[k - 1] ? BOUND : 0;
        for (int64_t k = 0; k < n; k++) {
            score[k] = w[k] != NO_WORD ? 2.0f : 1.0f;
            any |= w[k] != NO_WORD;
        }
        return any;
    }
    return 1;
}

static inline float max2(float a, float b) { return a > b ? a : b; }

/* Keep a boundary stronger than every key in the window before it and at least as strong as every
 * key in the window after it, and every forced one. */
static inline uint8_t kept(uint8_t f, float own, float before, float after) {
    int keep = (own > before) & (own >= after);
    return (uint8_t)(keep || (f & FORCED) ? f : f & (uint8_t)~BOUND);
}

/* suppress_close's last step for a window of w keys: the maxima taken directly. */
static inline void suppress_direct(int64_t n, int64_t w, uint8_t *restrict flags, const float *restrict ext) {
    for (int64_t k = 0; k < n; k++) {
        float before = ext[k], after = ext[k + w + 1];
        for (int64_t d = 1; d < w; d++) {
            before = max2(before, ext[k + d]);
            after = max2(after, ext[k + w + 1 + d]);
        }
        flags[k] = kept(flags[k], ext[w + k], before, after);
    }
}

/* Drop each boundary that has a boundary at least as strong within min_len - 1 tokens before it,
 * or a stronger one within min_len - 1 tokens after it (suppressed ones included); forced ones stay.
 * The windows' maxima: directly for short windows, else by van Herk / Gil-Werman (running maxima
 * forwards and backwards inside blocks of the window's width), whose cost does not grow with min_len. */
static void suppress_close(int64_t min_len, scratch *sc) {
    const int64_t n = sc->n, w = min_len - 1, len = n + 2 * w;
    uint8_t *restrict flags = sc->flags;
    const float *restrict score = sc->score;
    float *restrict ext = sc->ext, *restrict s1 = sc->s1, *restrict s2 = sc->s2;
    /* ext: the keys with w columns of -inf on either side; a key is the score on a boundary (+inf on
     * the first token and forced ones) and -FLT_MAX elsewhere */
    for (int64_t i = 0; i < w; i++) ext[i] = ext[w + n + i] = -INFINITY;
    for (int64_t k = 0; k < n; k++) {
        const float sk = score[k];
        const int f = flags[k];
        const float key = (f & FORCED) ? INFINITY : sk;
        ext[w + k] = (f & BOUND) ? key : -FLT_MAX;
    }
    ext[w] = INFINITY; /* the first valid token */
    /* the window before token k is ext[k .. k + w - 1], the one after it ext[k + w + 1 .. k + 2w] */
    if (w <= 16) {
        switch (w) { /* constant widths unroll */
        case 1: suppress_direct(n, 1, flags, ext); break;
        case 2: suppress_direct(n, 2, flags, ext); break;
        case 3: suppress_direct(n, 3, flags, ext); break;
        case 4: suppress_direct(n, 4, flags, ext); break;
        default: suppress_direct(n, w, flags, ext);
        }
        return;
    }
    for (int64_t start = 0; start < len; start += w) {
        int64_t end = start + w < len ? start + w : len;
        float run = -INFINITY;
        for (int64_t i = start; i < end; i++) s1[i] = run = max2(ext[i], run);
        run = -INFINITY;
        for (int64_t i = end - 1; i >= start; i--) s2[i] = run = max2(ext[i], run);
    }
    /* max of ext[a .. a + w - 1] = max(s2[a], s1[a + w - 1]) */
    for (int64_t k = 0; k < n; k++) {
        int64_t a = k + w + 1;
        float after = a + w - 1 < len ? max2(s2[a], s1[a + w - 1]) : -INFINITY;
        flags[k] = kept(flags[k], ext[w + k], max2(s2[k], s1[k + w - 1]), after);
    }
}

/* Segment ids of the packed row (a boundary every max_len tokens inside a longer segment, then the
 * running count), copied to the row's valid tokens, 0 on the others; and, when asked, each segment's
 * number of tokens at the segment's id (0 elsewhere), in float32 or float64. */
static void write_ids(const job *j, scratch *sc, int64_t row) {
    const config *c = j->cfg;
    const int64_t T = j->T, n = sc->n;
    const uint8_t *restrict flags = sc->flags;
    int64_t *restrict ids = sc->ints;
    int64_t *out = j->ids + row * T;
    int64_t id = -1;
    for (int64_t k = 0; k < n; k++) ids[k] = id += flags[k] & BOUND;
    /* a segment longer than max_len has the same id at k and k - max_len (ids never decrease) */
    int64_t too_long = 0;
    for (int64_t k = c->max_len > 0 ? c->max_len : n; k < n; k++) too_long |= ids[k] == ids[k - c->max_len];
    if (too_long) {
        /* next: where the running segment reaches max_len tokens, unless a boundary comes first */
        const int64_t max_len = c->max_len;
        id = -1;
        for (int64_t k = 0, next = max_len; k < n; k++) {
            const int64_t start = flags[k] & BOUND;
            next = (next & (start - 1)) | ((k + max_len) & -start); /* masks, not a branch */
            const int64_t split = k == next;
            next += max_len & -split;
            ids[k] = id += start | split;
        }
    }
    int64_t t = 0, k = 0;
    for (int64_t r = 0; r < sc->n_runs; r++) {
        int64_t a = sc->runs[2 * r], len = sc->runs[2 * r + 1] - a;
        memset(out + t, 0, sizeof(int64_t) * (size_t)(a - t));
        memcpy(out + a, ids + k, sizeof(int64_t) * (size_t)len);
        k += len;
        t = a + len;
    }
    memset(out + t, 0, sizeof(int64_t) * (size_t)(T - t));
    if (!j->sizes) return;
    /* first[s]: the first token of segment s (written from the end, so the smallest k stays) */
    const int64_t segments = n > 0 ? ids[n - 1] + 1 : 0;
    int64_t *restrict first = sc->first;
    for (int64_t i = n - 1; i >= 0; i--) first[ids[i]] = i;
    first[segments] = n;
    if (j->sizes_dtype == F64) {
        double *sz = (double *)j->sizes + row * T;
        memset(sz, 0, sizeof(double) * (size_t)T);
        for (int64_t i = 0; i < segments; i++) sz[i] = (double)(first[i + 1] - first[i]);
    } else {
        float *sz = (float *)j->sizes + row * T;
        memset(sz, 0, sizeof(float) * (size_t)T);
        for (int64_t i = 0; i < segments; i++) sz[i] = (float)(first[i + 1] - first[i]);
    }
}

static int run_rows(slice *s) {
    const job *j = s->j;
    const config *c = j->cfg;
    const int64_t T = j->T, width = T + 2 * (c->min_len > 1 ? c->min_len : 0) + 2;
    scratch sc = {0};
    sc.runs = malloc(sizeof(int64_t) * (size_t)width);
    sc.ints = malloc(sizeof(int64_t) * (size_t)width);
    sc.first = malloc(sizeof(int64_t) * (size_t)width);
    sc.floats = malloc(sizeof(float) * (size_t)width);
    sc.score = malloc(sizeof(float) * (size_t)width);
    sc.ext = malloc(sizeof(float) * (size_t)width);
    sc.s1 = malloc(sizeof(float) * (size_t)width);
    sc.s2 = malloc(sizeof(float) * (size_t)width);
    sc.flags = malloc((size_t)width);
    int status = sc.runs && sc.ints && sc.first && sc.floats && sc.score && sc.ext && sc.s1 && sc.s2 && sc.flags ? 0 : -1;
    for (int64_t row = s->r0; status == 0 && row < s->r1; row++) {
        sc.n = find_runs(j->mask + row * T, T, &sc);
        j->row_state[row] = ROW_EMPTY;
        if (sc.n > 0) {
            int own = candidates(j, c, c->rule, row, &sc);
            if (!own) candidates(j, c, c->fallback_rule, row, &sc);
            j->row_state[row] = own ? ROW_OWN_RULE : ROW_FALLBACK;
            sc.flags[0] |= BOUND; /* the first valid token starts a segment */
            if (c->min_len > 1) suppress_close(c->min_len, &sc);
        }
        write_ids(j, &sc, row);
    }
    free(sc.runs);
    free(sc.ints);
    free(sc.first);
    free(sc.floats);
    free(sc.score);
    free(sc.ext);
    free(sc.s1);
    free(sc.s2);
    free(sc.flags);
    return status;
}

static void *run_thread(void *arg) {
    slice *s = arg;
    s->status = run_rows(s);
    return NULL;
}

/* ids [B, T] (int64, 0 on padding), row_state [B] (ROW_*) and, unless sizes is NULL, the segment
 * sizes [B, T] (F32 or F64; at each segment's id, 0 elsewhere); rows are split over `threads`
 * threads. Returns 0, or -1 when memory ran out. */
int maspo_segment_ids(int64_t B, int64_t T, const uint8_t *mask, const void *logp, int64_t logp_dtype,
                      const void *tokens, int64_t tokens_dtype, const void *words, int64_t words_dtype,
                      const config *cfg, int64_t *ids, int8_t *row_state, void *sizes, int64_t sizes_dtype,
                      int64_t threads) {
    job j = {T, mask, logp, logp_dtype, tokens, tokens_dtype, words, words_dtype, cfg, ids, row_state, sizes,
             sizes_dtype};
    if (threads > B) threads = B;
    if (threads <= 1) {
        slice s = {&j, 0, B, 0, 0};
        return run_rows(&s);
    }
    slice *slices = calloc((size_t)threads, sizeof(slice));
    pthread_t *tids = calloc((size_t)threads, sizeof(pthread_t));
    if (!slices || !tids) {
        free(slices);
        free(tids);
        return -1;
    }
    for (int64_t i = 0; i < threads; i++) {
        slices[i] = (slice){&j, B * i / threads, B * (i + 1) / threads, 0, 0};
        if (i > 0) slices[i].started = pthread_create(&tids[i], NULL, run_thread, &slices[i]) == 0;
        if (i > 0 && !slices[i].started) slices[i].status = run_rows(&slices[i]); /* no thread: run here */
    }
    int status = run_rows(&slices[0]);
    for (int64_t i = 1; i < threads; i++) {
        if (slices[i].started) pthread_join(tids[i], NULL);
        status |= slices[i].status;
    }
    free(slices);
    free(tids);
    return status;
}
