/* Host copies in the pattern of patch 0006's per-layer cell copies into the KV tensors (an L2
 * restore on the CPU): memcpy (what ggml_backend_tensor_set_2d does) against streaming stores
 * (what patch 0007 does), one thread or split by layers over two, and a sweep of sizes that also
 * times one read of the copy afterwards (what the next decode does). Built and run by
 * bench_copy_stores.py, which writes the JSON; prints one JSON object.
 *
 *   copy_stores N_CELLS KV_CELLS ARENA_CELLS N_LAYER K_ROW V_EMBD V_ELEM REPEATS
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t n_cells, kv_cells, arena_cells, n_layer, k_row, v_embd, v_elem;
static uint8_t *arena, *kv;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* as patch 0007's skippy_stream_avx2 */
__attribute__((target("avx2"))) static void stream_avx2(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    head = head < n ? head : n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    }
    memcpy(dst + i, src + i, n - i);
}

static void plain(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }

typedef void (*copy_fn)(uint8_t *, const uint8_t *, size_t);

static size_t arena_layer(void) { return arena_cells * (k_row + v_embd * v_elem); }
static size_t kv_layer(void) { return kv_cells * (k_row + v_embd * v_elem); }

/* layers [l0, l1): K rows by cell, then V transposed (v_embd rows of n_cells elements) */
static void restore(size_t l0, size_t l1, copy_fn copy) {
    for (size_t l = l0; l < l1; ++l) {
        const uint8_t *a = arena + l * arena_layer();
        uint8_t *k = kv + l * kv_layer();
        copy(k, a, n_cells * k_row);
        const uint8_t *av = a + arena_cells * k_row;
        uint8_t *kvv = k + kv_cells * k_row;
        for (size_t r = 0; r < v_embd; ++r) {
            copy(kvv + r * kv_cells * v_elem, av + r * arena_cells * v_elem, n_cells * v_elem);
        }
    }
    _mm_sfence();
}

struct half { size_t l0, l1; copy_fn copy; };
static void *run_half(void *p) {
    struct half *h = p;
    restore(h->l0, h->l1, h->copy);
    return NULL;
}
static void restore_two(copy_fn copy) {
    pthread_t t;
    struct half h = {n_layer / 2, n_layer, copy};
    pthread_create(&t, NULL, run_half, &h);
    restore(0, n_layer / 2, copy);
    pthread_join(t, NULL);
}

static volatile uint64_t sink;
static void read_all(const uint8_t *p, size_t n) {
    uint64_t x = 0;
    for (size_t i = 0; i < n; i += 64) x += p[i];
    sink = x;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static void put(const char *name, double *t, int n, int last) {
    qsort(t, n, sizeof(double), cmp);
    printf("\"%s\": {\"median_ms\": %.3f, \"min_ms\": %.3f, \"max_ms\": %.3f}%s", name, t[n / 2], t[0],
           t[n - 1], last ? "" : ", ");
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s N_CELLS KV_CELLS ARENA_CELLS N_LAYER K_ROW V_EMBD V_ELEM REPEATS\n", argv[0]);
        return 2;
    }
    n_cells = strtoull(argv[1], 0, 10); kv_cells = strtoull(argv[2], 0, 10);
    arena_cells = strtoull(argv[3], 0, 10); n_layer = strtoull(argv[4], 0, 10);
    k_row = strtoull(argv[5], 0, 10); v_embd = strtoull(argv[6], 0, 10);
    v_elem = strtoull(argv[7], 0, 10);
    const int reps = atoi(argv[8]);
    if (!__builtin_cpu_supports("avx2")) {
        printf("{\"error\": \"no AVX2\"}\n");
        return 0;
    }
    const size_t bytes = n_cells * (k_row + v_embd * v_elem) * n_layer;
    arena = aligned_alloc(4096, n_layer * arena_layer());
    kv = aligned_alloc(4096, n_layer * kv_layer());
    uint8_t *flat = aligned_alloc(4096, bytes), *flat2 = aligned_alloc(4096, bytes);
    memset(arena, 1, n_layer * arena_layer()); memset(kv, 2, n_layer * kv_layer());
    memset(flat, 3, bytes); memset(flat2, 4, bytes);

    enum { ARMS = 6 };
    const char *names[ARMS] = {"memcpy_flat", "pattern_memcpy", "pattern_stream",
                               "pattern_memcpy_2threads", "pattern_stream_2threads", "stream_flat"};
    double *t[ARMS];
    for (int a = 0; a < ARMS; ++a) t[a] = malloc(sizeof(double) * reps);
    for (int r = 0; r < reps; ++r) {  /* the arms alternate: the same minutes for each */
        double t0;
        t0 = now_ms(); memcpy(flat2, flat, bytes); t[0][r] = now_ms() - t0;
        t0 = now_ms(); restore(0, n_layer, plain); t[1][r] = now_ms() - t0;
        t0 = now_ms(); restore(0, n_layer, stream_avx2); t[2][r] = now_ms() - t0;
        t0 = now_ms(); restore_two(plain); t[3][r] = now_ms() - t0;
        t0 = now_ms(); restore_two(stream_avx2); t[4][r] = now_ms() - t0;
        t0 = now_ms(); stream_avx2(flat2, flat, bytes); _mm_sfence(); t[5][r] = now_ms() - t0;
    }
    printf("{\"bytes\": %zu, ", bytes);
    for (int a = 0; a < ARMS; ++a) put(names[a], t[a], reps, 0);

    /* sizes: a flat copy then one read of it, cached stores vs streaming ones */
    const size_t sizes[] = {(size_t)256 << 10, (size_t)1 << 20, (size_t)2 << 20, (size_t)8 << 20,
                            (size_t)24 << 20, (size_t)48 << 20, bytes};
    const int n_sizes = sizeof(sizes) / sizeof(sizes[0]);
    uint8_t *junk = aligned_alloc(4096, (size_t)256 << 20);
    memset(junk, 5, (size_t)256 << 20);
    printf("\"sizes\": [");
    for (int z = 0; z < n_sizes; ++z) {
        const size_t n = sizes[z] < bytes ? sizes[z] : bytes;
        double *c[4];
        for (int a = 0; a < 4; ++a) c[a] = malloc(sizeof(double) * reps);
        for (int r = 0; r < reps; ++r) {
            for (int m = 0; m < 2; ++m) {
                memcpy(junk, junk + ((size_t)128 << 20), (size_t)128 << 20);  /* evict */
                const double t0 = now_ms();
                if (m) { stream_avx2(flat2, flat, n); _mm_sfence(); } else { memcpy(flat2, flat, n); }
                const double t1 = now_ms();
                read_all(flat2, n);
                c[m * 2][r] = t1 - t0;
                c[m * 2 + 1][r] = now_ms() - t0;
            }
        }
        printf("{\"bytes\": %zu, ", n);
        put("memcpy", c[0], reps, 0); put("memcpy_then_read", c[1], reps, 0);
        put("stream", c[2], reps, 0); put("stream_then_read", c[3], reps, 1);
        printf("}%s", z + 1 < n_sizes ? ", " : "");
    }
    printf("]}\n");
    return 0;
}
