/* kvq_codes.h — the 8-bit KV-cache codes widened exactly to fp32 (kvquant_decode.c, kvquant_prefill.c,
 * kvquant_append.c).
 *
 * Codes: float8_e4m3fn and float8_e5m2 through a 256-entry table of their exact values (built once, on first
 * use: `if (!tables_ready) build_tables();`), int8 as its signed value. Include after common.h.
 */
#ifndef KP_KVQ_CODES_H
#define KP_KVQ_CODES_H

#include <math.h>
#include <stdint.h>

static float E4M3[256], E5M2[256];
static int tables_ready = 0;

static void build_tables(void) {
    for (int c = 0; c < 256; c++) {
        int sign = c >> 7;
        int e = (c >> 3) & 0xF, m = c & 7;  /* e4m3fn: bias 7, no inf, 0x7F / 0xFF NaN */
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
        if ((c & 0x7F) == 0x7F) v = NAN;
        E4M3[c] = sign ? -v : v;
        e = (c >> 2) & 0x1F;  /* e5m2: bias 15, exponent 31 inf / NaN */
        m = c & 3;
        v = e == 0 ? ldexpf((float)m, -16) : ldexpf((float)(4 + m), e - 17);
        if (e == 31) v = m ? NAN : INFINITY;
        E5M2[c] = sign ? -v : v;
    }
    tables_ready = 1;
}

/* Element i of a code row, widened exactly to fp32. */
static inline float code(const void *row, int64_t i, const float *lut) {
    if (lut) return lut[((const uint8_t *)row)[i]];
    return (float)((const int8_t *)row)[i];
}


#endif
