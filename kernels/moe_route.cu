// moe_route: Mixture-of-Experts routing, per row of logits
// ([rows, experts + shared_gate]): softmax over the first `experts` values,
// the `k` largest in descending order (the lower index first among equals),
// divided by their sum when `normalize`; with `shared_gate`, a last slot
// routes to expert `experts` with weight sigmoid(the row's last value).
// ids and weights are [rows, k + shared_gate]. One thread per row; expf,
// not the fast intrinsic, for the manifest's 1e-5.

#include "common.cuh"

// MAX_EXPERTS_PER_TOKEN of the architecture description.
#define MOE_MAX_K 16

extern "C" __global__ void moe_route(const float* __restrict__ logits, u32 rows, u32 experts, u32 k,
                                     u32 normalize, u32 shared_gate, u32* __restrict__ ids,
                                     float* __restrict__ weights) {
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = logits + (u64)r * (experts + shared_gate);
    const u64 out = (u64)r * (k + shared_gate);
    float top = row[0];
    for (u32 e = 1; e < experts; ++e) top = fmaxf(top, row[e]);
    float sum = 0.0f;
    for (u32 e = 0; e < experts; ++e) sum += expf(row[e] - top);
    u32 chosen[MOE_MAX_K];
    float chosen_sum = 0.0f;
    for (u32 j = 0; j < k; ++j) {
        u32 best = experts;
        for (u32 e = 0; e < experts; ++e) {
            bool taken = false;
            for (u32 i = 0; i < j; ++i) taken = taken || chosen[i] == e;
            if (!taken && (best == experts || row[e] > row[best])) best = e;
        }
        chosen[j] = best;
        const float w = expf(row[best] - top) / sum;
        ids[out + j] = best;
        weights[out + j] = w;
        chosen_sum += w;
    }
    if (normalize)
        for (u32 j = 0; j < k; ++j) weights[out + j] /= chosen_sum;
    if (shared_gate) {
        ids[out + k] = experts;
        weights[out + k] = 1.0f / (1.0f + expf(-row[experts]));
    }
}
