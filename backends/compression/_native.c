/* The compressor's and the CPU decoder's inner loops in C: parsing symbols into codewords, rebuilding
 * a dictionary, and one chunk's codewords -> symbols -> merged 16-bit floats.
 *
 * The numpy path (cpu_decode.expand_into + merge_into) makes a dozen passes over a chunk; this makes
 * one over the codewords, expanding each word's symbols into a small buffer that stays in L1, and one
 * over that buffer, merging each symbol with its raw byte straight into the output. It runs with the
 * GIL released, so the loader's threads decode chunks in parallel.
 *
 * Built at install time as an optional extension (pyproject.toml); without a C compiler the loader
 * uses the numpy path, which gives the same bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define HAVE_SSE42_CRC 1
#endif

#define NUM_CODEWORDS 65536
#define BLOCK 4096          /* symbols merged at a time: the buffer stays in L1 */
#define MAX_WORD_SYMBOLS 8  /* layout.MAX_WORD_SYMBOLS */

enum { KIND_BF16 = 0, KIND_FP16 = 1 };

static inline uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline void store_word(uint8_t *dst, uint64_t word) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(dst, &word, 8);    /* first symbol in the lowest byte */
#else
    for (int i = 0; i < 8; i++) dst[i] = (uint8_t)(word >> (8 * i));
#endif
}

/* Release the buffers a function parsed; then, when it found a problem with them, raise ValueError. */
static int release(const char *problem, Py_buffer **buffers, size_t count) {
    for (size_t i = 0; i < count; i++) PyBuffer_Release(buffers[i]);
    if (problem != NULL) PyErr_SetString(PyExc_ValueError, problem);
    return problem == NULL;
}

/* bf16: sign = raw bit 7, exponent = symbol, mantissa = raw bits 0-6; fp16: symbol high, raw low. */
static void merge(uint16_t *out, const uint8_t *raw, const uint8_t *symbols, Py_ssize_t n, int kind) {
    if (kind == KIND_BF16) {
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (uint16_t)(((raw[i] & 0x80u) << 8) | ((unsigned)symbols[i] << 7) | (raw[i] & 0x7Fu));
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (uint16_t)(((unsigned)symbols[i] << 8) | raw[i]);
    }
}

/* 0 on success; -1 when a codeword is outside the dictionary or the lengths do not add up to n
 * (the output is then partly written and must be discarded). */
static int decode(const uint8_t *codes, Py_ssize_t num_codes, const uint64_t *payload, const uint8_t *lengths,
                  Py_ssize_t num_words, const uint8_t *raw, uint16_t *out, Py_ssize_t n, int kind) {
    uint8_t buffer[BLOCK + 16];
    Py_ssize_t done = 0, fill = 0;
    for (Py_ssize_t i = 0; i < num_codes; i++) {
        uint16_t code = load_u16(codes + 2 * i);
        if (code >= num_words) return -1;
        Py_ssize_t length = lengths[code];
        if (done + fill + length > n) return -1;
        store_word(buffer + fill, payload[code]);
        fill += length;
        if (fill >= BLOCK) {
            merge(out + done, raw + done, buffer, BLOCK, kind);
            done += BLOCK;
            fill -= BLOCK;
            memmove(buffer, buffer + BLOCK, (size_t)fill);
        }
    }
    if (done + fill != n) return -1;
    merge(out + done, raw + done, buffer, fill, kind);
    return 0;
}

/* The dictionary's words in breadth-first order, as codebook.build_codebook builds them (see _levels
 * there): a word of depth d+1 is a word of depth d followed by one of the first ranks r whose
 * probability is at least threshold / P(word); its probability is P(word) * p[r]. The same correctly
 * rounded double operations in the same order (no contraction: see pyproject.toml), so the words are
 * identical, and the loader checks them against the stored checksum anyway. Returns the number of
 * words, or -1 when they would exceed NUM_CODEWORDS. */
static Py_ssize_t build_words(const double *probs, const uint8_t *symbols, Py_ssize_t num, double threshold,
                              uint64_t *payload, uint8_t *lengths, double *word_probs) {
    for (Py_ssize_t r = 0; r < num; r++) {
        payload[r] = symbols[r];
        lengths[r] = 1;
        word_probs[r] = probs[r];
    }
    Py_ssize_t lo = 0, hi = num, total = num;
    for (int depth = 1; depth < MAX_WORD_SYMBOLS && lo < hi; depth++) {
        for (Py_ssize_t w = lo; w < hi; w++) {
            double limit = threshold / word_probs[w];
            for (Py_ssize_t r = 0; r < num && probs[r] >= limit; r++) {
                if (total == NUM_CODEWORDS) return -1;
                payload[total] = payload[w] | ((uint64_t)symbols[r] << (8 * depth));
                lengths[total] = (uint8_t)(depth + 1);
                word_probs[total] = word_probs[w] * probs[r];
                total++;
            }
        }
        lo = hi;
        hi = total;
    }
    return total;
}

static PyObject *build_tables(PyObject *self, PyObject *args) {
    Py_buffer probs, symbols, payload, lengths;
    double threshold;
    if (!PyArg_ParseTuple(args, "y*y*dw*w*:build_tables", &probs, &symbols, &threshold, &payload, &lengths))
        return NULL;
    const char *problem = NULL;
    Py_ssize_t num = symbols.len;
    if (probs.len != 8 * num || num < 1 || num > 256) problem = "probs must be one float64 per symbol (1..256)";
    else if (payload.len != NUM_CODEWORDS * 8 || lengths.len != NUM_CODEWORDS) problem = "tables must cover 65536 codewords";
    else if ((uintptr_t)payload.buf % 8 != 0 || (uintptr_t)probs.buf % 8 != 0) problem = "misaligned buffer";
    Py_ssize_t total = 0;
    double *word_probs = problem == NULL ? PyMem_RawMalloc(NUM_CODEWORDS * sizeof(double)) : NULL;
    if (word_probs != NULL) {
        Py_BEGIN_ALLOW_THREADS
        memset(payload.buf, 0, (size_t)payload.len);
        memset(lengths.buf, 0, (size_t)lengths.len);
        total = build_words(probs.buf, symbols.buf, num, threshold, payload.buf, lengths.buf, word_probs);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(word_probs);
    }
    if (!release(problem, (Py_buffer *[]){&probs, &symbols, &payload, &lengths}, 4)) return NULL;
    if (word_probs == NULL) return PyErr_NoMemory();
    return PyLong_FromSsize_t(total);
}

/* Greedy longest-match parse of alphabet ranks through the dictionary tree (codebook.encode_many's
 * numpy loop, one lane at a time): a word starts at the single-symbol word of its first rank and
 * follows children while the next rank has one, up to MAX_WORD_SYMBOLS symbols, never past its lane.
 * Returns the number of codewords, or -1 when the ranks or the tree are inconsistent. */
static Py_ssize_t encode(const uint8_t *ranks, Py_ssize_t n, const int64_t *first_child, const int64_t *num_children,
                         Py_ssize_t num_words, Py_ssize_t lane_size, uint16_t *codes, uint16_t *lanes) {
    Py_ssize_t num_codes = 0;
    for (Py_ssize_t lane = 0, start = 0; start < n; lane++, start += lane_size) {
        Py_ssize_t end = start + lane_size < n ? start + lane_size : n, before = num_codes;
        for (Py_ssize_t pos = start; pos < end;) {
            int64_t node = ranks[pos];
            if (node >= num_words) return -1;
            Py_ssize_t length = 1;
            while (length < MAX_WORD_SYMBOLS && pos + length < end && ranks[pos + length] < num_children[node]) {
                node = first_child[node] + ranks[pos + length];
                if (node < 0 || node >= num_words) return -1;
                length++;
            }
            codes[num_codes++] = (uint16_t)node;
            pos += length;
        }
        lanes[lane] = (uint16_t)(num_codes - before);   /* as numpy's astype: the format's lanes hold <= 1024 */
    }
    return num_codes;
}

static PyObject *encode_lanes(PyObject *self, PyObject *args) {
    Py_buffer ranks, first_child, num_children, codes, lanes;
    Py_ssize_t lane_size;
    if (!PyArg_ParseTuple(args, "y*y*y*nw*w*:encode_lanes", &ranks, &first_child, &num_children, &lane_size, &codes,
                          &lanes))
        return NULL;
    const char *problem = NULL;
    Py_ssize_t n = ranks.len, num_words = first_child.len / 8;
    if (first_child.len % 8 != 0 || num_children.len != first_child.len || num_words > NUM_CODEWORDS)
        problem = "first_child and num_children must be int64 per word (at most 65536 words)";
    else if (lane_size < 1) problem = "lane_size must be positive";
    else if (codes.len != 2 * n || lanes.len != 2 * ((n + lane_size - 1) / lane_size))
        problem = "codes must hold one uint16 per rank and lanes one uint16 per lane";
    else if ((uintptr_t)first_child.buf % 8 || (uintptr_t)num_children.buf % 8 || (uintptr_t)codes.buf % 2
             || (uintptr_t)lanes.buf % 2)
        problem = "misaligned buffer";
    Py_ssize_t num_codes = 0;
    if (problem == NULL) {
        Py_BEGIN_ALLOW_THREADS
        num_codes = encode(ranks.buf, n, first_child.buf, num_children.buf, num_words, lane_size, codes.buf, lanes.buf);
        Py_END_ALLOW_THREADS
    }
    if (!release(problem, (Py_buffer *[]){&ranks, &first_child, &num_children, &codes, &lanes}, 5)) return NULL;
    return PyLong_FromSsize_t(num_codes);
}

/* What is wrong with a decode call's common buffers (NULL when nothing): the dictionary tables, the
 * codewords, and the output against the raw bytes. */
static const char *decode_buffers_problem(const Py_buffer *codes, const Py_buffer *payload, const Py_buffer *lengths,
                                          Py_ssize_t num_words, const Py_buffer *raw, const Py_buffer *out, int kind) {
    if (payload->len != NUM_CODEWORDS * 8 || lengths->len != NUM_CODEWORDS) return "tables must cover 65536 codewords";
    if (num_words < 0 || num_words > NUM_CODEWORDS) return "num_words out of range";
    if (codes->len % 2 != 0) return "codes must be whole uint16 codewords";
    if (out->len != 2 * raw->len) return "out must hold one 16-bit value per raw byte";
    if (kind != KIND_BF16 && kind != KIND_FP16) return "unknown kind";
    if ((uintptr_t)payload->buf % 8 != 0 || (uintptr_t)out->buf % 2 != 0) return "misaligned buffer";
    return NULL;
}

/* CRC-32C (Castagnoli, reflected, the value of the `crc32c` package): the SSE4.2 instruction where
 * the CPU has it, else a byte-wise table. */
static uint32_t crc_table[256];
static int crc_hardware;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[i] = c;
    }
#ifdef HAVE_SSE42_CRC
    __builtin_cpu_init();
    crc_hardware = __builtin_cpu_supports("sse4.2");
#endif
}

#ifdef HAVE_SSE42_CRC
__attribute__((target("sse4.2"))) static uint32_t crc_update_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
    }
    crc = (uint32_t)c;
    for (; n > 0; p++, n--) crc = _mm_crc32_u8(crc, *p);
    return crc;
}
#endif

static uint32_t crc32c_table(const uint8_t *p, size_t n) {
    uint32_t crc = 0xFFFFFFFFu;
    for (; n > 0; p++, n--) crc = crc_table[(crc ^ *p) & 0xFFu] ^ (crc >> 8);
    return ~crc;
}

static uint32_t crc32c_of(const uint8_t *p, size_t n) {
#ifdef HAVE_SSE42_CRC
    if (crc_hardware) return ~crc_update_hw(0xFFFFFFFFu, p, n);
#endif
    return crc32c_table(p, n);
}

/* Chunks [first, end) of one tensor, each checked against its two stored CRC-32Cs (codes, raw bytes)
 * and decoded, all without the GIL: one call per range rather than a few Python calls per chunk, so
 * a decoding thread barely contends for the GIL with the interpreter's other threads. Chunk c has
 * elements [c * chunk_size, min(+chunk_size, n)) and lanes [c * lanes_per_chunk, ...), whose
 * codewords start at lane_offsets[lane]. Returns -1, or 3 * chunk + (0: codes checksum, 1: raw
 * checksum, 2: codewords do not decode to the chunk's size) for the first bad chunk. */
static Py_ssize_t decode_range(const uint8_t *codes, Py_ssize_t num_codes, const uint64_t *payload,
                               const uint8_t *lengths, Py_ssize_t num_words, const uint8_t *raw, uint16_t *out,
                               Py_ssize_t n, int kind, const int64_t *lane_offsets, Py_ssize_t num_lanes,
                               Py_ssize_t lanes_per_chunk, Py_ssize_t chunk_size, const uint32_t *checks,
                               Py_ssize_t first, Py_ssize_t end) {
    for (Py_ssize_t c = first; c < end; c++) {
        Py_ssize_t lo = c * chunk_size, hi = lo + chunk_size < n ? lo + chunk_size : n;
        Py_ssize_t lane_lo = c * lanes_per_chunk;
        Py_ssize_t lane_hi = lane_lo + lanes_per_chunk < num_lanes ? lane_lo + lanes_per_chunk : num_lanes;
        int64_t c0 = lane_offsets[lane_lo], c1 = lane_offsets[lane_hi];
        if (c0 < 0 || c1 < c0 || c1 > num_codes) return 3 * c;
        if (crc32c_of(codes + 2 * c0, (size_t)(2 * (c1 - c0))) != checks[2 * c]) return 3 * c;
        if (crc32c_of(raw + lo, (size_t)(hi - lo)) != checks[2 * c + 1]) return 3 * c + 1;
        if (decode(codes + 2 * c0, c1 - c0, payload, lengths, num_words, raw + lo, out + lo, hi - lo, kind) != 0)
            return 3 * c + 2;
    }
    return -1;
}

/* What is wrong with decode_chunks' chunk layout and range over n elements (NULL when nothing). */
static const char *chunks_problem(const Py_buffer *offsets, const Py_buffer *checks, Py_ssize_t n,
                                  Py_ssize_t lanes_per_chunk, Py_ssize_t chunk_size, Py_ssize_t first, Py_ssize_t end) {
    Py_ssize_t num_lanes = offsets->len / 8 - 1;
    if (offsets->len % 8 != 0 || num_lanes < 0) return "lane offsets must be int64, one more than the lanes";
    if (chunk_size < 1 || lanes_per_chunk < 1) return "chunk_size and lanes_per_chunk must be positive";
    Py_ssize_t num_chunks = (n + chunk_size - 1) / chunk_size;
    if ((num_lanes + lanes_per_chunk - 1) / lanes_per_chunk != num_chunks) return "lanes do not cover the chunks";
    if (checks->len != 8 * num_chunks) return "checks must be two uint32 per chunk";
    if (first < 0 || end < first || end > num_chunks) return "chunk range out of bounds";
    if ((uintptr_t)offsets->buf % 8 || (uintptr_t)checks->buf % 4) return "misaligned buffer";
    return NULL;
}

static PyObject *decode_chunks(PyObject *self, PyObject *args) {
    Py_buffer codes, payload, lengths, raw, out, offsets, checks;
    Py_ssize_t num_words, lanes_per_chunk, chunk_size, first, end;
    int kind;
    if (!PyArg_ParseTuple(args, "y*y*y*ny*w*iy*nny*nn:decode_chunks", &codes, &payload, &lengths, &num_words, &raw,
                          &out, &kind, &offsets, &lanes_per_chunk, &chunk_size, &checks, &first, &end))
        return NULL;
    Py_ssize_t n = raw.len, num_lanes = offsets.len / 8 - 1;
    const char *problem = decode_buffers_problem(&codes, &payload, &lengths, num_words, &raw, &out, kind);
    if (problem == NULL)
        problem = chunks_problem(&offsets, &checks, n, lanes_per_chunk, chunk_size, first, end);
    Py_ssize_t bad = -1;
    if (problem == NULL) {
        Py_BEGIN_ALLOW_THREADS
        bad = decode_range(codes.buf, codes.len / 2, payload.buf, lengths.buf, num_words, raw.buf, out.buf, n, kind,
                           offsets.buf, num_lanes, lanes_per_chunk, chunk_size, checks.buf, first, end);
        Py_END_ALLOW_THREADS
    }
    if (!release(problem, (Py_buffer *[]){&codes, &payload, &lengths, &raw, &out, &offsets, &checks}, 7)) return NULL;
    return PyLong_FromSsize_t(bad);
}

static PyObject *crc32c_py(PyObject *self, PyObject *args) {
    Py_buffer data;
    int table = 0;
    if (!PyArg_ParseTuple(args, "y*|p:crc32c", &data, &table)) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = table ? crc32c_table(data.buf, (size_t)data.len) : crc32c_of(data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *decode_chunk(PyObject *self, PyObject *args) {
    Py_buffer codes, payload, lengths, raw, out;
    Py_ssize_t num_words;
    int kind;
    if (!PyArg_ParseTuple(args, "y*y*y*ny*w*i:decode_chunk", &codes, &payload, &lengths, &num_words, &raw,
                          &out, &kind))
        return NULL;
    const char *problem = decode_buffers_problem(&codes, &payload, &lengths, num_words, &raw, &out, kind);
    int status = 0;
    if (problem == NULL) {
        Py_BEGIN_ALLOW_THREADS
        status = decode(codes.buf, codes.len / 2, payload.buf, lengths.buf, num_words, raw.buf, out.buf, raw.len,
                        kind);
        Py_END_ALLOW_THREADS
    }
    if (!release(problem, (Py_buffer *[]){&codes, &payload, &lengths, &raw, &out}, 5)) return NULL;
    return PyBool_FromLong(status == 0);
}

static PyMethodDef methods[] = {
    {"decode_chunk", decode_chunk, METH_VARARGS,
     "decode_chunk(codes, payload, lengths, num_words, raw, out, kind) -> bool\n\n"
     "Expand one chunk's little-endian uint16 codewords through the dictionary tables (payload: 65536\n"
     "uint64 words, lengths: 65536 uint8) and merge each symbol with its raw byte into `out` (16-bit\n"
     "floats; kind 0 = bf16, 1 = fp16). False when a codeword is outside the dictionary or the word\n"
     "lengths do not add up to len(raw); `out` is then partly written."},
    {"build_tables", build_tables, METH_VARARGS,
     "build_tables(probs, symbols, threshold, payload, lengths) -> int\n\n"
     "Fill the decoder's tables (payload: 65536 uint64, lengths: 65536 uint8; zero past the dictionary)\n"
     "with the dictionary codebook.build_codebook builds for sorted float64 `probs` of uint8 `symbols`\n"
     "and `threshold`. Returns the number of words, or -1 when they would exceed 65536."},
    {"encode_lanes", encode_lanes, METH_VARARGS,
     "encode_lanes(ranks, first_child, num_children, lane_size, codes, lanes) -> int\n\n"
     "Parse uint8 alphabet `ranks` into codewords (uint16 `codes`, capacity one per rank) lane by lane,\n"
     "greedy longest match through the dictionary tree (int64 first_child / num_children per word);\n"
     "`lanes` gets each lane's codeword count. Returns the number of codewords, or -1 when the ranks\n"
     "or the tree are inconsistent."},
    {"decode_chunks", decode_chunks, METH_VARARGS,
     "decode_chunks(codes, payload, lengths, num_words, raw, out, kind, lane_offsets, lanes_per_chunk, chunk_size,\n"
     "              checks, first, end) -> int\n\n"
     "Check and decode chunks [first, end) of one tensor (its whole codes, raw bytes and output; int64\n"
     "lane_offsets [num_lanes + 1]; uint32 checks [num_chunks, 2]: the CRC-32C of each chunk's codes and raw\n"
     "bytes) without the GIL. -1 when all are good, else 3 * chunk + 0 (codes checksum), 1 (raw checksum)\n"
     "or 2 (codewords do not decode to the chunk's size) for the first bad one."},
    {"crc32c", crc32c_py, METH_VARARGS,
     "crc32c(data, table=False) -> int: the CRC-32C decode_chunks checks, by the instruction where the CPU\n"
     "has one or (table=True, as on other CPUs) by the byte-wise table. For tests."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "C inner loops of the weight compressor and decoder.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    return PyModule_Create(&module);
}
