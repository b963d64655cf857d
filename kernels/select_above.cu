// Compaction for exact Top-K on CUDA: the indices of the entries whose magnitude is at
// least a threshold, written in any order through an atomic counter (at most capacity).
// Compiled by fusionp2p/kernels/topk_select.py through CuPy (RawModule from this text).
extern "C" __global__
void select_above(const float* __restrict__ x, const long long n, const float threshold,
                  long long* __restrict__ out, unsigned long long* __restrict__ count,
                  const long long capacity) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (; i < n; i += stride) {
        if (fabsf(x[i]) >= threshold) {
            unsigned long long slot = atomicAdd(count, 1ULL);
            if (slot < (unsigned long long)capacity) out[slot] = i;
        }
    }
}
