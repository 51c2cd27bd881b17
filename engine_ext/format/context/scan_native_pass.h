/* The context pass of scan_native.c, for one instruction set: included once per variant with
SCAN_ISA (0 scalar, 1 AVX2, 2 AVX-512BW), SCAN_TARGET (the functions' target attribute) and
SCAN_SUFFIX (their names' suffix) defined; it undefines them at its end.

Per chunk of 64 elements of a row's run:
  e[j]     = (u[i + j] >> shift) & mask                    exponent bytes (vectorised by the compiler)
  ge[k]    = bits j where e[j] >= edges[k - 1], ge[0] = the chunk's valid bits, ge[16] = 0
  cls[c]   = ge[c] & ~ge[c + 1]                             the chunk's elements of class c
  left[c] -= popcount(cls[c])                               16 countdowns, one vector loop
Only where a countdown reaches zero is that class's chunk walked (select the left[c]-th of its
bits, emit, take the next rank's gap), and then the chunk's emissions are put in element order.
Classes beyond K count down from FAR and have no bits, so every loop runs over all 16.
*/
#define SCAN_CAT_(a, b) a##b
#define SCAN_CAT(a, b) SCAN_CAT_(a, b)
#define SCAN_NAME(x) SCAN_CAT(x, SCAN_SUFFIX)

/* Each class edge, ready for the chunk loop: broadcast where the variant compares whole vectors. Edges past
K - 1 are 0xFF and switched off by ``on`` (an exponent byte can be 0xFF, so no edge is out of its reach). */
typedef struct {
#if SCAN_ISA == 2
    __m512i t[MAX_K - 1];
#elif SCAN_ISA == 1
    __m256i t[MAX_K - 1];
#else
    uint8_t t[MAX_K - 1];
#endif
    uint64_t on[MAX_K - 1];
} SCAN_NAME(Edges);

SCAN_TARGET static inline void SCAN_NAME(edges_of)(const Scan *s, SCAN_NAME(Edges) * ed) {
    for (int k = 0; k < MAX_K - 1; k++) {
        const uint8_t t = k < s->K - 1 ? s->edges[k] : 0xFF;
        ed->on[k] = k < s->K - 1 ? ~(uint64_t)0 : 0;
#if SCAN_ISA == 2
        ed->t[k] = _mm512_set1_epi8((char)t);
#elif SCAN_ISA == 1
        ed->t[k] = _mm256_set1_epi8((char)t);
#else
        ed->t[k] = t;
#endif
    }
}

/* ge[1..15] for 64 exponent bytes: bit j where e[j] >= edge k (a constant trip count: unrolled, in registers). */
#if SCAN_ISA == 2
SCAN_TARGET static inline void SCAN_NAME(edge_masks)(__m512i v, const SCAN_NAME(Edges) * ed, uint64_t *ge) {
    for (int k = 0; k < MAX_K - 1; k++) ge[k + 1] = _mm512_cmpge_epu8_mask(v, ed->t[k]) & ed->on[k];
}
#elif SCAN_ISA == 1
SCAN_TARGET static inline void SCAN_NAME(edge_masks)(const uint8_t *e, const SCAN_NAME(Edges) * ed, uint64_t *ge) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)e), hi = _mm256_loadu_si256((const __m256i *)(e + 32));
    for (int k = 0; k < MAX_K - 1; k++) { /* e >= t, unsigned: max(e, t) == e */
        uint32_t a = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(lo, ed->t[k]), lo));
        uint32_t b = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(hi, ed->t[k]), hi));
        ge[k + 1] = ((uint64_t)a | ((uint64_t)b << 32)) & ed->on[k];
    }
}
#else
SCAN_TARGET static inline void SCAN_NAME(edge_masks)(const uint8_t *e, const SCAN_NAME(Edges) * ed, uint64_t *ge) {
    for (int k = 0; k < MAX_K - 1; k++) {
        uint64_t m = 0;
        for (int j = 0; j < CHUNK; j++) m |= (uint64_t)(e[j] >= ed->t[k]) << j;
        ge[k + 1] = m & ed->on[k];
    }
}
#endif

/* The exponent bytes of n <= 64 elements from element i; bytes past n are 0. */
SCAN_TARGET static inline void SCAN_NAME(exponents)(const Scan *s, int64_t i, int n, uint8_t *e) {
    const int shift = s->shift;
    const unsigned mask = s->mask;
    if (n < CHUNK) memset(e, 0, CHUNK);
    if (s->itemsize == 2) {
        const uint16_t *u = (const uint16_t *)s->u + i;
        if (n == CHUNK)
            for (int j = 0; j < CHUNK; j++) e[j] = (uint8_t)((u[j] >> shift) & mask);
        else
            for (int j = 0; j < n; j++) e[j] = (uint8_t)((u[j] >> shift) & mask);
    } else if (s->itemsize == 1) {
        const uint8_t *u = (const uint8_t *)s->u + i;
        for (int j = 0; j < n; j++) e[j] = (uint8_t)((u[j] >> shift) & mask);
    } else {
        const uint32_t *u = (const uint32_t *)s->u + i;
        for (int j = 0; j < n; j++) e[j] = (uint8_t)((u[j] >> shift) & mask);
    }
}

SCAN_TARGET static int64_t SCAN_NAME(run_scan)(Scan *s) {
    const int K = s->K;
    int64_t left[MAX_K], cnt[MAX_K], ptr[MAX_K], stop[MAX_K];
    uint64_t ge[MAX_K + 1];
    int64_t pc[MAX_K + 1];
    uint8_t e[CHUNK];
    int64_t k_out = 0;
    SCAN_NAME(Edges) ed;
    SCAN_NAME(edges_of)(s, &ed);
    for (int k = 0; k <= MAX_K; k++) ge[k] = 0;
    pc[MAX_K] = 0;
    for (int64_t b = 0; b < s->n_blocks; b++) {
        const int64_t *st = s->starts + b * (K + 1);
        for (int c = 0; c < MAX_K; c++) {
            ptr[c] = stop[c] = 0;
            left[c] = FAR;
            if (c < K && st[c] < st[c + 1]) {
                ptr[c] = st[c];
                stop[c] = st[c + 1];
                const int64_t r = s->ranks[ptr[c]];
                left[c] = r >= 0 && r < FAR ? r + 1 : FAR; /* a hostile rank: never found, so the count comes short */
            }
        }
        const int64_t run = s->run[b];
        for (int64_t ri = s->row_ptr[b]; ri < s->row_ptr[b + 1]; ri++) {
            const int64_t row = s->rows[ri];
            /* Blocks cut rows into short runs, which the hardware prefetcher follows poorly (an 8 x 8 cut of a bf16
               part: 1 KB runs, 0.68 against 0.39 ns per element whole): fetch the next row's chunk ahead. */
            const char *ahead = ri + 1 < s->row_ptr[b + 1] ? (const char *)s->u + (s->rows[ri + 1] - row) * s->itemsize : NULL;
            for (int64_t i = row; i < row + run; i += CHUNK) {
                const int n = (int)(row + run - i < CHUNK ? row + run - i : CHUNK);
                if (ahead)
                    for (int line = 0; line < CHUNK * s->itemsize; line += 64)
                        __builtin_prefetch(ahead + i * s->itemsize + line);
#if SCAN_ISA == 2
                if (n == CHUNK && s->itemsize == 2) { /* bf16 and fp16, the common case: the bytes stay in a register */
                    const uint16_t *w = (const uint16_t *)s->u + i;
                    const __m512i m16 = _mm512_set1_epi16((short)s->mask);
                    __m512i a = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)w), s->shift), m16);
                    __m512i z = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)(w + 32)), s->shift), m16);
                    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)), _mm512_cvtepi16_epi8(z), 1);
                    SCAN_NAME(edge_masks)(v, &ed, ge);
                } else {
                    SCAN_NAME(exponents)(s, i, n, e);
                    SCAN_NAME(edge_masks)(_mm512_loadu_si512((const void *)e), &ed, ge);
                }
#else
                SCAN_NAME(exponents)(s, i, n, e);
                SCAN_NAME(edge_masks)(e, &ed, ge);
#endif
                ge[0] = n == CHUNK ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1);
                if (n < CHUNK)
                    for (int k = 1; k < MAX_K; k++) ge[k] &= ge[0];
                for (int k = 0; k < MAX_K; k++) pc[k] = __builtin_popcountll(ge[k]);
                unsigned hit = 0; /* bit c: class c's countdown ends in this chunk */
                for (int c = 0; c < MAX_K; c++) { /* ge[c + 1] is within ge[c]: class c has the difference */
                    cnt[c] = pc[c] - pc[c + 1];
                    left[c] -= cnt[c];
                    hit |= (unsigned)(left[c] <= 0) << c;
                }
                if (!hit) continue;
                const int64_t first = k_out;
                for (; hit; hit &= hit - 1) {
                    const int c = __builtin_ctz(hit);
                    left[c] += cnt[c]; /* back to the countdown at the chunk's start, then walk its bits */
                    uint64_t m = ge[c] & ~ge[c + 1];
                    int64_t have = cnt[c];
                    while (left[c] <= have) {
#if SCAN_ISA == 2 /* BMI2's deposit: the left[c]-th set bit in one step (fast on every CPU with AVX-512) */
                        const int bit = (int)__builtin_ctzll(_pdep_u64((uint64_t)1 << (left[c] - 1), m));
#else
                        uint64_t below = m;
                        for (int64_t r = left[c] - 1; r > 0; r--) below &= below - 1; /* drop the bits before it */
                        const int bit = __builtin_ctzll(below);
#endif
                        const int64_t p = ptr[c];
                        s->pos[k_out] = i + bit;
                        s->src[k_out] = p;
                        k_out++;
                        ptr[c] = p + 1;
                        m = bit == 63 ? 0 : m & (~(uint64_t)0 << (bit + 1));
                        have = __builtin_popcountll(m);
                        /* ranks not ascending: never found, so the count comes short (and no signed overflow) */
                        left[c] = p + 1 < stop[c] && s->ranks[p + 1] > s->ranks[p] ? s->ranks[p + 1] - s->ranks[p] : FAR;
                    }
                    left[c] -= have;
                }
                for (int64_t x = first + 1; x < k_out; x++) { /* the chunk's emissions in element order */
                    const int64_t p = s->pos[x], q = s->src[x];
                    int64_t y = x;
                    for (; y > first && s->pos[y - 1] > p; y--) {
                        s->pos[y] = s->pos[y - 1];
                        s->src[y] = s->src[y - 1];
                    }
                    s->pos[y] = p;
                    s->src[y] = q;
                }
            }
        }
    }
    return k_out;
}

#undef SCAN_NAME
#undef SCAN_CAT
#undef SCAN_CAT_
#undef SCAN_ISA
#undef SCAN_TARGET
#undef SCAN_SUFFIX
