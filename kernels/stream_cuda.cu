// STREAM-like GPU memory bandwidth (copy, triad) for edgerun's bandwidth probe on CUDA devices
// (Jetson Orin: the GPU reads the same LPDDR5 as the CPU). Built by edgerun/hw/kernels.py:
//   nvcc -O3 -arch=native stream_cuda.cu -o stream_cuda
// Usage: stream_cuda N_DOUBLES REPS  ->  prints one JSON line with the best seconds per kernel.
// Bytes counted as STREAM does: copy 16 B per element, triad 24 B per element.
#include <cstdio>
#include <cstdlib>

__global__ void init_k(double *a, double *b, double *c, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        a[i] = 1.0; b[i] = 2.0; c[i] = 0.5;
    }
}

__global__ void copy_k(const double *__restrict__ a, double *__restrict__ c, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        c[i] = a[i];
}

__global__ void triad_k(double *__restrict__ a, const double *__restrict__ b, const double *__restrict__ c,
                        double s, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        a[i] = b[i] + s * c[i];
}

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); return 1; } } while (0)

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s N_DOUBLES REPS\n", argv[0]); return 2; }
    size_t n = strtoull(argv[1], NULL, 10);
    int reps = atoi(argv[2]);
    if (n < 1024 || reps < 1) { fprintf(stderr, "need N_DOUBLES >= 1024 and REPS >= 1\n"); return 2; }
    double *a, *b, *c;
    CHECK(cudaMalloc(&a, n * sizeof(double)));
    CHECK(cudaMalloc(&b, n * sizeof(double)));
    CHECK(cudaMalloc(&c, n * sizeof(double)));
    int dev = 0, sms = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int threads = 256, blocks = sms * 8;
    init_k<<<blocks, threads>>>(a, b, c, n);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    float best_copy = 1e30f, best_triad = 1e30f, ms = 0.f;
    for (int r = 0; r < reps; r++) {
        CHECK(cudaEventRecord(t0));
        copy_k<<<blocks, threads>>>(a, c, n);
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (ms < best_copy) best_copy = ms;
        CHECK(cudaEventRecord(t0));
        triad_k<<<blocks, threads>>>(a, b, c, 3.0, n);
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (ms < best_triad) best_triad = ms;
    }
    double probe = 0.0;
    CHECK(cudaMemcpy(&probe, a + n / 2, sizeof(double), cudaMemcpyDeviceToHost));
    printf("{\"n\": %zu, \"copy_s\": %.9g, \"triad_s\": %.9g, \"check\": %.9g, \"elem_bytes\": 8}\n",
           n, best_copy * 1e-3, best_triad * 1e-3, probe);
    cudaFree(a); cudaFree(b); cudaFree(c);
    return 0;
}
