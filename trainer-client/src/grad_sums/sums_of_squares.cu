// Every gradient's sum of squares in one launch (the `fused` way of grad_sums).
//
// Each tensor is cut into chunks of `chunk` elements, and the chunks of all tensors
// are numbered one after another: block b sums the squares of chunk b and adds its
// partial sum to its tensor's slot of `out` (zeroed by the caller). So the whole
// launch reads each gradient once, whatever the number or size of the tensors, as
// PyTorch's multi-tensor kernels (`torch._foreach_norm`) do.
//
// `table` holds three 64-bit words per tensor, in the caller's order:
//   [0] the address of its first element,
//   [1] its element count,
//   [2] (dtype << 32) | the number of its first chunk,
// dtype being 0 for f32, 1 for bf16 and 2 for f16. A tensor of no elements has no
// chunk, and its slot stays 0.
//
// NaN and infinity propagate into the sums (a square is never negative, so an
// infinity never meets its opposite): a non-finite sum is how the loss scaler's
// found_inf and the record's non-finite gradients are decided.
//
// Compiled at run time by NVRTC, so no CUDA header is included: bf16 widens to f32 by
// a shift, f16 through the PTX conversion instruction.

#define THREADS 256

__device__ __forceinline__ float from_bf16(unsigned int bits16) {
    return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ float from_f16(unsigned short bits16) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits16));
    return f;
}

// The square of each 16-bit half of `word` (dtype 1: bf16, 2: f16), summed.
__device__ __forceinline__ float square_pair(unsigned int word, unsigned int dtype) {
    float a, b;
    if (dtype == 1) {
        a = from_bf16(word & 0xffffu);
        b = from_bf16(word >> 16);
    } else {
        a = from_f16((unsigned short)(word & 0xffffu));
        b = from_f16((unsigned short)(word >> 16));
    }
    return a * a + b * b;
}

__device__ __forceinline__ float square_one(const char* base, unsigned long long i, unsigned int dtype) {
    float v;
    if (dtype == 0) {
        v = ((const float*)base)[i];
    } else if (dtype == 1) {
        v = from_bf16(((const unsigned short*)base)[i]);
    } else {
        v = from_f16(((const unsigned short*)base)[i]);
    }
    return v * v;
}

extern "C" __global__ void gradflow_sums_of_squares(
    const unsigned long long* table,
    unsigned int tensors,
    unsigned int chunk,
    float* out
) {
    const unsigned int c = blockIdx.x;
    // The last tensor whose first chunk is at or before c (an empty tensor shares its
    // first chunk with the next one, which this search prefers).
    unsigned int lo = 0, hi = tensors - 1;
    while (lo < hi) {
        const unsigned int mid = (lo + hi + 1) / 2;
        if ((unsigned int)(table[3 * mid + 2] & 0xffffffffull) <= c) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    const char* base = (const char*)table[3 * lo];
    const unsigned long long len = table[3 * lo + 1];
    const unsigned int dtype = (unsigned int)(table[3 * lo + 2] >> 32);
    const unsigned int first = (unsigned int)(table[3 * lo + 2] & 0xffffffffull);
    const unsigned long long start = (unsigned long long)(c - first) * chunk;
    const unsigned long long end = start + chunk < len ? start + chunk : len;

    float acc = 0.0f;
    const unsigned int size = dtype == 0 ? 4 : 2;
    const unsigned int per_vector = 16 / size;
    // 16-byte loads where the chunk starts on a 16-byte boundary (every chunk does
    // when the tensor does: `chunk` is a multiple of 8 elements), the tail one by one.
    unsigned long long vector_end = start;
    if ((((unsigned long long)(base + start * size)) & 15ull) == 0) {
        vector_end = start + (end - start) / per_vector * per_vector;
        const uint4* vectors = (const uint4*)(base + start * size);
        const unsigned long long count = (vector_end - start) / per_vector;
        for (unsigned long long v = threadIdx.x; v < count; v += THREADS) {
            const uint4 q = vectors[v];
            if (dtype == 0) {
                const float x = __uint_as_float(q.x), y = __uint_as_float(q.y);
                const float z = __uint_as_float(q.z), w = __uint_as_float(q.w);
                acc += x * x + y * y + z * z + w * w;
            } else {
                acc += square_pair(q.x, dtype) + square_pair(q.y, dtype)
                     + square_pair(q.z, dtype) + square_pair(q.w, dtype);
            }
        }
    }
    for (unsigned long long i = vector_end + threadIdx.x; i < end; i += THREADS) {
        acc += square_one(base, i, dtype);
    }

    // The block's sum: within each warp by shuffles, then across the warps.
    for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    __shared__ float warps[THREADS / 32];
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        warps[warp] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        acc = lane < THREADS / 32 ? warps[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) {
            acc += __shfl_down_sync(0xffffffffu, acc, offset);
        }
        if (lane == 0) {
            atomicAdd(&out[lo], acc);
        }
    }
}
