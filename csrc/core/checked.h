/* checked.h - overflow-checked size arithmetic for the engine (internal).
 * Every byte count, element count and offset the core derives from caller
 * sizes goes through these: a product or sum that does not fit is refused
 * with TEC_ERR_INVALID_ARG instead of wrapping into a small allocation or
 * an out-of-range address. Exercised by tests/test_reliability_sizes.py. */
#ifndef TEC_CHECKED_H
#define TEC_CHECKED_H

#include <stddef.h>
#include <stdint.h>

/* The largest byte count the core hands to memory calls: an offset of this
 * size still fits a ptrdiff_t and an off_t. */
#define TEC_BYTES_MAX ((uint64_t)INT64_MAX)

/* *out = a * b * c as a byte count; 0 when it overflows or any factor is
 * negative (the caller reports). */
static inline int tec_mul3(int64_t a, int64_t b, int64_t c, size_t *out)
{
    int64_t ab, abc;
    if (a < 0 || b < 0 || c < 0 || __builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc))
        return 0;
    if ((uint64_t)abc > (uint64_t)SIZE_MAX)
        return 0;
    *out = (size_t)abc;
    return 1;
}

/* The bytes of a row-major matrix of `rows` rows with leading dimension
 * `ld` (elements) of `es` bytes each: rows * ld * es (the last row is
 * counted whole). 0 on overflow. */
static inline int tec_matrix_bytes(int64_t rows, int64_t ld, size_t es, size_t *out)
{
    return tec_mul3(rows, ld, (int64_t)es, out);
}

/* *out = a + b, 0 on overflow past TEC_BYTES_MAX. */
static inline int tec_add_bytes(size_t a, size_t b, size_t *out)
{
    size_t s;
    if (__builtin_add_overflow(a, b, &s) || (uint64_t)s > TEC_BYTES_MAX)
        return 0;
    *out = s;
    return 1;
}

#endif
