// Probe (H200, issue 12, twelfth session): do the keys' graphs stay at the fresh launch speed as the
// bodies of one conditional switch node in one graph executable, where as separate executables they
// slow from the fourth on (docs/performance.md, twelfth session)? Plain CUDA, no torch:
//   A: one executable with a switch node of N bodies, each a chain of K tiny kernels, the body picked
//      by a kernel that reads the key from device memory (cudaGraphSetConditional); us per launch for
//      bodies 0, N/2 and N-1.
//   B: then N separate executables of the same chains, the first timed after each is instantiated,
//      and A again; E: each of them launched once; C: N more captured on a stream each; D: streams
//      that run a kernel, no graph (the first of B timed after each, A at the end).
// Build and run on the GPU machine: nvcc -arch=sm_90 -o /tmp/switch_probe scripts/cuda/switch_probe.cu && /tmp/switch_probe [N] [K]
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)

__global__ void add1(float* x) { x[threadIdx.x] += 1.f; }
__global__ void pick(cudaGraphConditionalHandle h, const unsigned* key) { cudaGraphSetConditional(h, *key); }

static void capture_chain(cudaStream_t s, cudaGraph_t into, float* x, int k) {
  CK(cudaStreamBeginCaptureToGraph(s, into, nullptr, nullptr, 0, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < k; i++) add1<<<1, 32, 0, s>>>(x);
  cudaGraph_t done;
  CK(cudaStreamEndCapture(s, &done));
}

static float us_per_launch(cudaGraphExec_t e, cudaStream_t s) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < 5; r++) {
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < 200; i++) CK(cudaGraphLaunch(e, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.f / 200);
  }
  std::sort(t.begin(), t.end());
  return t[2];
}

int main(int argc, char** argv) {
  int n = argc > 1 ? std::atoi(argv[1]) : 8, k = argc > 2 ? std::atoi(argv[2]) : 100;
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float* x; CK(cudaMalloc(&x, 4096)); CK(cudaMemset(x, 0, 4096));
  unsigned* key; CK(cudaMalloc(&key, sizeof(unsigned)));

  // A: one executable, a switch over n bodies
  cudaGraph_t parent; CK(cudaGraphCreate(&parent, 0));
  cudaGraphConditionalHandle h; CK(cudaGraphConditionalHandleCreate(&h, parent, 0, 0));
  cudaGraphNode_t picker;
  cudaKernelNodeParams kp = {};
  void* args[] = {&h, &key};
  kp.func = (void*)pick; kp.gridDim = dim3(1); kp.blockDim = dim3(1); kp.kernelParams = args;
  CK(cudaGraphAddKernelNode(&picker, parent, nullptr, 0, &kp));
  cudaGraphNodeParams cp = {};
  cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = h; cp.conditional.type = cudaGraphCondTypeSwitch; cp.conditional.size = n;
  cudaGraphNode_t sw;
#if CUDART_VERSION >= 13000
  CK(cudaGraphAddNode(&sw, parent, &picker, nullptr, 1, &cp));
#else
  CK(cudaGraphAddNode(&sw, parent, &picker, 1, &cp));
#endif
  for (int i = 0; i < n; i++) capture_chain(s, cp.conditional.phGraph_out[i], x, k);
  cudaGraphExec_t one; CK(cudaGraphInstantiate(&one, parent, 0));
  auto time_bodies = [&](const char* when) {
    for (unsigned b : {0u, (unsigned)n / 2, (unsigned)n - 1}) {
      CK(cudaMemcpy(key, &b, sizeof(b), cudaMemcpyHostToDevice));
      std::printf("A %s: switch body %u of %d: %.1f us a launch\n", when, b, n, us_per_launch(one, s));
    }
  };
  time_bodies("fresh");

  // B: n separate executables of the same chains
  std::vector<cudaGraphExec_t> execs;
  for (int i = 0; i < n; i++) {
    cudaGraph_t g; CK(cudaGraphCreate(&g, 0));
    capture_chain(s, g, x, k);
    cudaGraphExec_t e; CK(cudaGraphInstantiate(&e, g, 0));
    execs.push_back(e);
    std::printf("B: %d separate executables: the first %.1f us a launch\n", i + 1, us_per_launch(execs[0], s));
  }
  time_bodies("after B");
  // E: each of B's executables launched once
  for (int i = 1; i < n; i++) {
    CK(cudaGraphLaunch(execs[i], s));
    CK(cudaStreamSynchronize(s));
    std::printf("E: %d of them launched once: the first %.1f us a launch\n", i + 1, us_per_launch(execs[0], s));
  }
  time_bodies("after E");

  // C: n more executables, each captured on a stream of its own; D: streams that run a kernel, no graph
  for (int i = 0; i < n; i++) {
    cudaStream_t si; CK(cudaStreamCreateWithFlags(&si, cudaStreamNonBlocking));
    cudaGraph_t g; CK(cudaGraphCreate(&g, 0));
    capture_chain(si, g, x, k);
    cudaGraphExec_t e; CK(cudaGraphInstantiate(&e, g, 0));
    std::printf("C: %d more executables, each captured on its own stream: the first %.1f us a launch\n", i + 1,
                us_per_launch(execs[0], s));
  }
  for (int i = 0; i < 2 * n; i++) {
    cudaStream_t si; CK(cudaStreamCreateWithFlags(&si, cudaStreamNonBlocking));
    add1<<<1, 32, 0, si>>>(x);
    CK(cudaStreamSynchronize(si));
    std::printf("D: %d more streams that ran a kernel: the first %.1f us a launch\n", i + 1, us_per_launch(execs[0], s));
  }
  time_bodies("after C and D");
  std::printf("k=%d kernels a body\n", k);
  return 0;
}
