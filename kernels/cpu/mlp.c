/* mlp.c — gated-MLP activations: SwiGLU and GeGLU (tanh or erf GELU).
 *
 *   swiglu: y = silu(g) u = g sigmoid(g) u
 *   geglu:  y = gelu(g) u,  gelu(g) = g Phi(g) (erf) or 0.5 g (1 + tanh(k (g + 0.044715 g^3))) (tanh)
 *
 * Conventions (OPS.md, layers; golden refimpl/mlp.py): g, u and y are (rows, n) with element
 * stride 1 and their own row strides in elements, so the fused gate-first projection h (t, 2i) is
 * passed as two views of one buffer (g = h + 0, u = h + i, both with row stride 2i). dtype
 * KP_F32 / KP_F16 / KP_BF16, the same for all three. fp16/bf16 are widened on load, all arithmetic
 * is fp32, y is rounded (RNE) once on store. Every function of an element is branch-free (selects),
 * so the row loop vectorises in each ISA path of KP_MULTIVERSION.
 *
 * Numerics (the forms of kernels/triton/mlp.py; exact algebra on the textbook formulas):
 * - sigmoid(z) from e = kp_expf(-|z|) in [0, 1]: 1 / (1 + e), or e / (1 + e) for z < 0; exp never
 *   sees a positive argument, so nothing overflows.
 * - tanh GELU = g sigmoid(2 k (g + 0.044715 g^3)), as (1 + tanh x) / 2 = sigmoid(2x) (1 + tanh x
 *   cancels for g < -2).
 * - erf GELU = g Phi(g), Phi(g) = erfc(|g| / sqrt 2) / 2 below 0 and 1 - that above (never
 *   1 + erf, which cancels); erfc(a) = t exp(-a^2 + P(t)), t = 1 / (1 + a / 2), P the degree-9
 *   least-squares fit of ln(erfc(a) e^(a^2) / t) over a in [0, 10.5] (max error 5.1e-8), with
 *   a^2 = g^2 / 2 formed in double (exact: a float squared has 48 bits) so the exponent is rounded
 *   once. g is clamped to +-16, where Phi is 0 or 1 in fp32.
 *
 * Backward (glu_backward_kernel; OPS.md "backward"): dgate = dy u act'(g), dup = dy act(g), each
 * rounded once. act' is silu' = s(g) + g s(g) s(-g), tanh gelu' = s(z) + g s(z) s(-z) z' and erf
 * gelu' = Phi(g) + g phi(g); the sigmoid's derivative s(z) s(-z) = e / (1 + e)^2 from e = exp(-|z|),
 * never 1 - s(z) (which is all rounding once s(z) rounds to 1, past z = 17 in fp32). phi(g) =
 * exp(-g^2 / 2) / sqrt(2 pi) with g^2 in double (one rounding of the exponent, as Phi's).
 */
#include "common.h"

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU_ERF = 2 };
enum { KP_ERR_ACT = 3 };

#define GELU_K0 1.5957691216057308f  /* 2 sqrt(2 / pi) */
#define GELU_K1 0.07135481627159562f /* 2 sqrt(2 / pi) 0.044715 */
#define RSQRT2 0.7071067811865476f
#define ERFC_T_MIN 0.16f             /* 1 / (1 + 10.5 / 2): erfc(10.5) underflows fp32 */
#define CDF_CLAMP 16.0f
#define RSQRT_2PI 0.3989422804014327f  /* 1 / sqrt(2 pi) */

/* P(t), constant term first (see the header comment). */
static const float ERFC_C[10] = {
    -1.2654595234870583f, 0.998868406666354f, 0.38460636771813217f, 0.0443623435504635f,
    -0.02751209170696793f, -0.025994682841872035f, -0.7619841921205215f, 1.206169534811215f,
    -0.7018472679782412f, 0.14879115527827563f,
};

KP_INLINE float sigmoid_f32(float z) {
    float e = kp_expf(-fabsf(z));
    float r = 1.0f / (1.0f + e);
    return z >= 0.0f ? r : e * r;
}

KP_INLINE float std_normal_cdf_f32(float g) {
    g = g < -CDF_CLAMP ? -CDF_CLAMP : g;
    g = g > CDF_CLAMP ? CDF_CLAMP : g;
    float a = fabsf(g) * RSQRT2;
    float t = 1.0f / (1.0f + 0.5f * a);
    float tc = t > ERFC_T_MIN ? t : ERFC_T_MIN;
    float p = ERFC_C[9];
    for (int k = 8; k >= 0; k--) p = p * tc + ERFC_C[k];
    float arg = (float)((double)p - 0.5 * ((double)g * (double)g));
    float half_erfc = 0.5f * t * kp_expf(arg);
    return g < 0.0f ? half_erfc : 1.0f - half_erfc;
}

KP_INLINE float activation(float g, int act) {
    switch (act) {
    case ACT_GELU_TANH: return g * sigmoid_f32(g * (GELU_K0 + GELU_K1 * g * g));
    case ACT_GELU_ERF: return g * std_normal_cdf_f32(g);
    default: return g * sigmoid_f32(g);
    }
}

/* `act` and `dt` are compile-time constants at every call (one instantiation each), so the switches
 * fold away and the loop body vectorises. */
KP_INLINE void glu_rows(const char *g, int64_t stride_g_row, const char *u, int64_t stride_u_row, char *y,
                        int64_t stride_y_row, int64_t rows, int64_t n, int act, int dt) {
    const int64_t size = kp_itemsize(dt);
    for (int64_t r = 0; r < rows; r++) {
        const void *g_row = g + r * stride_g_row * size;
        const void *u_row = u + r * stride_u_row * size;
        void *y_row = y + r * stride_y_row * size;
        for (int64_t j = 0; j < n; j++)
            kp_store(y_row, j, activation(kp_load(g_row, j, dt), act) * kp_load(u_row, j, dt), dt);
    }
}

#define GLU_DTYPES(act)                                                                           \
    switch (dtype) {                                                                              \
    case KP_F32: glu_rows(G_ptr, stride_g_row, U_ptr, stride_u_row, Y_ptr, stride_y_row, rows, n, act, KP_F32); \
        return KP_OK;                                                                             \
    case KP_F16: glu_rows(G_ptr, stride_g_row, U_ptr, stride_u_row, Y_ptr, stride_y_row, rows, n, act, KP_F16); \
        return KP_OK;                                                                             \
    case KP_BF16: glu_rows(G_ptr, stride_g_row, U_ptr, stride_u_row, Y_ptr, stride_y_row, rows, n, act, KP_BF16); \
        return KP_OK;                                                                             \
    default: return KP_ERR_DTYPE;                                                                 \
    }

KP_INLINE int glu_kernel_impl(int dtype, int act, const void *G_ptr, int64_t stride_g_row, const void *U_ptr,
                              int64_t stride_u_row, void *Y_ptr, int64_t stride_y_row, int64_t rows, int64_t n) {
    switch (act) {
    case ACT_SILU: GLU_DTYPES(ACT_SILU)
    case ACT_GELU_TANH: GLU_DTYPES(ACT_GELU_TANH)
    case ACT_GELU_ERF: GLU_DTYPES(ACT_GELU_ERF)
    default: return KP_ERR_ACT;
    }
}

KP_MULTIVERSION(glu_kernel,
                (int dtype, int act, const void *G_ptr, int64_t stride_g_row, const void *U_ptr,
                 int64_t stride_u_row, void *Y_ptr, int64_t stride_y_row, int64_t rows, int64_t n),
                (dtype, act, G_ptr, stride_g_row, U_ptr, stride_u_row, Y_ptr, stride_y_row, rows, n))

/* ---- backward ---------------------------------------------------------------------------------- */

/* s(z) (1 - s(z)) as s(z) s(-z) = e / (1 + e)^2, e = exp(-|z|): nothing cancels, nothing overflows. */
KP_INLINE float sigmoid_grad_f32(float z) {
    float e = kp_expf(-fabsf(z));
    float q = 1.0f / (1.0f + e);
    return e * q * q;
}

/* act'(g), with act(g) stored in *a (both from one evaluation of the sigmoid or Phi). */
KP_INLINE float activation_grad(float g, int act, float *a) {
    switch (act) {
    case ACT_GELU_TANH: {
        float z = g * (GELU_K0 + GELU_K1 * g * g);
        float s = sigmoid_f32(z);
        *a = g * s;
        return s + g * sigmoid_grad_f32(z) * (GELU_K0 + 3.0f * GELU_K1 * g * g);
    }
    case ACT_GELU_ERF: {
        float p = std_normal_cdf_f32(g);
        *a = g * p;
        return p + g * (kp_expf((float)(-0.5 * ((double)g * (double)g))) * RSQRT_2PI);
    }
    default: {
        float s = sigmoid_f32(g);
        *a = g * s;
        return s + g * sigmoid_grad_f32(g);
    }
    }
}

KP_INLINE void glu_bwd_rows(const char *g, int64_t sg, const char *u, int64_t su, const char *dy, int64_t sdy,
                            char *dg, int64_t sdg, char *du, int64_t sdu, int64_t rows, int64_t n, int act, int dt) {
    const int64_t size = kp_itemsize(dt);
    for (int64_t i = 0; i < rows; i++) {
        const char *gi = g + i * sg * size, *ui = u + i * su * size, *dyi = dy + i * sdy * size;
        char *dgi = dg + i * sdg * size, *dui = du + i * sdu * size;
        for (int64_t j = 0; j < n; j++) {
            float a;
            float da = activation_grad(kp_load(gi, j, dt), act, &a);
            float t = kp_load(dyi, j, dt);
            kp_store(dgi, j, t * kp_load(ui, j, dt) * da, dt);
            kp_store(dui, j, t * a, dt);
        }
    }
}

#define GLU_BWD_DTYPES(act)                                                                         \
    switch (dtype) {                                                                                \
    case KP_F32: glu_bwd_rows(G_ptr, sg, U_ptr, su, DY_ptr, sdy, DG_ptr, sdg, DU_ptr, sdu, rows, n, act, KP_F32); \
        return KP_OK;                                                                               \
    case KP_F16: glu_bwd_rows(G_ptr, sg, U_ptr, su, DY_ptr, sdy, DG_ptr, sdg, DU_ptr, sdu, rows, n, act, KP_F16); \
        return KP_OK;                                                                               \
    case KP_BF16: glu_bwd_rows(G_ptr, sg, U_ptr, su, DY_ptr, sdy, DG_ptr, sdg, DU_ptr, sdu, rows, n, act, KP_BF16); \
        return KP_OK;                                                                               \
    default: return KP_ERR_DTYPE;                                                                   \
    }

KP_INLINE int glu_backward_kernel_impl(int dtype, int act, const void *G_ptr, int64_t sg, const void *U_ptr,
                                       int64_t su, const void *DY_ptr, int64_t sdy, void *DG_ptr, int64_t sdg,
                                       void *DU_ptr, int64_t sdu, int64_t rows, int64_t n) {
    switch (act) {
    case ACT_SILU: GLU_BWD_DTYPES(ACT_SILU)
    case ACT_GELU_TANH: GLU_BWD_DTYPES(ACT_GELU_TANH)
    case ACT_GELU_ERF: GLU_BWD_DTYPES(ACT_GELU_ERF)
    default: return KP_ERR_ACT;
    }
}

KP_MULTIVERSION(glu_backward_kernel,
                (int dtype, int act, const void *G_ptr, int64_t sg, const void *U_ptr, int64_t su, const void *DY_ptr,
                 int64_t sdy, void *DG_ptr, int64_t sdg, void *DU_ptr, int64_t sdu, int64_t rows, int64_t n),
                (dtype, act, G_ptr, sg, U_ptr, su, DY_ptr, sdy, DG_ptr, sdg, DU_ptr, sdu, rows, n))
