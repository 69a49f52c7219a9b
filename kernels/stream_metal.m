// STREAM-like GPU memory bandwidth (copy, triad) for edgerun's bandwidth probe on Apple Silicon.
// Built by edgerun/hw/kernels.py:
//   clang -O2 -fobjc-arc -framework Foundation -framework Metal stream_metal.m -o stream_metal
// Usage: stream_metal N_FLOATS REPS  ->  prints one JSON line with the best seconds per kernel.
// The compute kernels are compiled at run time from the source string below (float32 elements;
// bytes counted as STREAM does: copy 8 B per element, triad 12 B per element).
// Not exercised on the development machine (no Mac there): edgerun falls back to the C kernel
// if this program fails to build or run.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <stdio.h>
#include <stdlib.h>

static NSString *const kSource =
    @"#include <metal_stdlib>\n"
     "using namespace metal;\n"
     "kernel void copy_k(device const float *a [[buffer(0)]], device float *c [[buffer(1)]],\n"
     "                   uint i [[thread_position_in_grid]]) { c[i] = a[i]; }\n"
     "kernel void triad_k(device float *a [[buffer(0)]], device const float *b [[buffer(1)]],\n"
     "                    device const float *c [[buffer(2)]], constant float &s [[buffer(3)]],\n"
     "                    uint i [[thread_position_in_grid]]) { a[i] = b[i] + s * c[i]; }\n";

static double run(id<MTLCommandQueue> q, id<MTLComputePipelineState> p, NSArray<id<MTLBuffer>> *bufs,
                  const float *s, NSUInteger n) {
    id<MTLCommandBuffer> cb = [q commandBuffer];
    id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoder];
    [enc setComputePipelineState:p];
    for (NSUInteger k = 0; k < bufs.count; k++) [enc setBuffer:bufs[k] offset:0 atIndex:k];
    if (s) [enc setBytes:s length:sizeof(float) atIndex:bufs.count];
    NSUInteger tg = p.maxTotalThreadsPerThreadgroup < 256 ? p.maxTotalThreadsPerThreadgroup : 256;
    [enc dispatchThreads:MTLSizeMake(n, 1, 1) threadsPerThreadgroup:MTLSizeMake(tg, 1, 1)];
    [enc endEncoding];
    [cb commit];
    [cb waitUntilCompleted];
    if (cb.status != MTLCommandBufferStatusCompleted) return -1.0;
    return cb.GPUEndTime - cb.GPUStartTime;
}

int main(int argc, const char **argv) {
    @autoreleasepool {
        if (argc != 3) { fprintf(stderr, "usage: %s N_FLOATS REPS\n", argv[0]); return 2; }
        NSUInteger n = (NSUInteger)strtoull(argv[1], NULL, 10);
        int reps = atoi(argv[2]);
        if (n < 1024 || reps < 1) { fprintf(stderr, "need N_FLOATS >= 1024 and REPS >= 1\n"); return 2; }
        id<MTLDevice> dev = MTLCreateSystemDefaultDevice();
        if (!dev) { fprintf(stderr, "no Metal device\n"); return 1; }
        NSError *err = nil;
        id<MTLLibrary> lib = [dev newLibraryWithSource:kSource options:nil error:&err];
        if (!lib) { fprintf(stderr, "Metal compile failed: %s\n", err.localizedDescription.UTF8String); return 1; }
        id<MTLComputePipelineState> pc = [dev newComputePipelineStateWithFunction:[lib newFunctionWithName:@"copy_k"] error:&err];
        id<MTLComputePipelineState> pt = [dev newComputePipelineStateWithFunction:[lib newFunctionWithName:@"triad_k"] error:&err];
        if (!pc || !pt) { fprintf(stderr, "pipeline failed: %s\n", err.localizedDescription.UTF8String); return 1; }
        NSUInteger bytes = n * sizeof(float);
        id<MTLBuffer> a = [dev newBufferWithLength:bytes options:MTLResourceStorageModePrivate];
        id<MTLBuffer> b = [dev newBufferWithLength:bytes options:MTLResourceStorageModePrivate];
        id<MTLBuffer> c = [dev newBufferWithLength:bytes options:MTLResourceStorageModePrivate];
        if (!a || !b || !c) { fprintf(stderr, "cannot allocate 3 x %lu bytes\n", (unsigned long)bytes); return 1; }
        id<MTLCommandQueue> q = [dev newCommandQueue];
        const float s = 3.0f;
        double best_copy = 1e30, best_triad = 1e30;
        for (int r = 0; r < reps + 1; r++) {      // the first round warms up and is not counted
            double tc = run(q, pc, @[a, c], NULL, n);
            double tt = run(q, pt, @[a, b, c], &s, n);
            if (tc < 0 || tt < 0) { fprintf(stderr, "command buffer failed\n"); return 1; }
            if (r > 0 && tc < best_copy) best_copy = tc;
            if (r > 0 && tt < best_triad) best_triad = tt;
        }
        printf("{\"n\": %lu, \"copy_s\": %.9g, \"triad_s\": %.9g, \"elem_bytes\": 4}\n",
               (unsigned long)n, best_copy, best_triad);
    }
    return 0;
}
