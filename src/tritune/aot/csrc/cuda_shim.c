/* The CUDA driver API functions the main and Triton's generated launcher call, forwarded to libcuda.so.1 opened
 * with dlopen at run time: an executable links no libcuda, so a bundle builds where there is no GPU and no CUDA
 * toolkit (Triton's bundled cuda.h is enough) and runs wherever there is a driver.
 *
 * cuda.h #defines many names to versioned symbols (cuMemAlloc -> cuMemAlloc_v2, cuEventElapsedTime ->
 * cuEventElapsedTime_v2 in CUDA 13 headers). Each function below is defined with the header's prototype, so the
 * macro gives it the versioned name the callers use, and looks up that same macro-expanded name (STR() expands
 * before stringifying); an older driver without it gets the unversioned base name (a trailing _v<digits> cut). */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#define STR_(x) #x
#define STR(x) STR_(x)

#define SHIM_FUNCTIONS(X)                                                                                             \
    X(cuInit) X(cuDeviceGet) X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease)        \
    X(cuCtxSetCurrent) X(cuCtxSynchronize) X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemsetD8)  \
    X(cuMemsetD8Async) X(cuMemHostAlloc) X(cuMemHostGetDevicePointer) X(cuMemFreeHost) X(cuStreamCreate)            \
    X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamWaitValue32) X(cuEventCreate) X(cuEventRecord)              \
    X(cuEventSynchronize) X(cuEventElapsedTime) X(cuEventDestroy) X(cuGetErrorString) X(cuModuleLoadData)            \
    X(cuModuleGetFunction) X(cuModuleUnload) X(cuFuncSetCacheConfig) X(cuFuncSetAttribute) X(cuFuncGetAttribute)     \
    X(cuLaunchKernel)

/* ## keeps the argument unexpanded, so SLOT_cuMemAlloc, not SLOT_cuMemAlloc_v2. */
#define SHIM_SLOT(name) SLOT_##name,
enum { SHIM_FUNCTIONS(SHIM_SLOT) NUM_SLOTS };

/* Here the argument is macro-expanded first: "cuMemAlloc_v2". */
#define SHIM_NAME(name) STR(name),
static const char *const SYMBOLS[NUM_SLOTS] = {SHIM_FUNCTIONS(SHIM_NAME)};

static void *functions[NUM_SLOTS];
static char load_error[512];
static int state; /* 0 not tried, 1 being resolved, 2 done */

static void *find_symbol(void *lib, const char *symbol) {
    void *fn = dlsym(lib, symbol);
    if (fn != NULL) return fn;
    /* cuMemAlloc_v2 -> cuMemAlloc: the name the symbol had before the driver versioned it. */
    char base[128];
    size_t len = strlen(symbol);
    if (len >= sizeof base) return NULL;
    memcpy(base, symbol, len + 1);
    size_t end = len;
    while (end > 0 && base[end - 1] >= '0' && base[end - 1] <= '9') end--;
    if (end == len || end < 2 || base[end - 1] != 'v' || base[end - 2] != '_') return NULL;
    base[end - 2] = '\0';
    return dlsym(lib, base);
}

static void resolve_all(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        snprintf(load_error, sizeof load_error, "cannot load libcuda.so.1 (no NVIDIA driver here?): %s",
                 why ? why : "unknown error");
        return;
    }
    for (int i = 0; i < NUM_SLOTS; i++) functions[i] = find_symbol(lib, SYMBOLS[i]);
    /* lib stays open for the life of the process, as the driver expects. */
}

/* Resolves every symbol once; threads arriving meanwhile wait, later calls cost one atomic load. */
static void ensure_loaded(void) {
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == 2) return;
    int expected = 0;
    if (__atomic_compare_exchange_n(&state, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        resolve_all();
        __atomic_store_n(&state, 2, __ATOMIC_RELEASE);
        return;
    }
    while (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != 2) {
    }
}

/* The function in slot, or NULL with the CUresult to return in *rc. */
static void *function(int slot, CUresult *rc) {
    ensure_loaded();
    if (load_error[0]) {
        *rc = CUDA_ERROR_NO_DEVICE;
        return NULL;
    }
    if (functions[slot] == NULL) {
        static int warned[NUM_SLOTS];
        if (!__atomic_exchange_n(&warned[slot], 1, __ATOMIC_RELAXED))
            fprintf(stderr, "tritune: libcuda.so.1 has no %s: this driver is too old for it\n", SYMBOLS[slot]);
        *rc = CUDA_ERROR_NOT_SUPPORTED;
        return NULL;
    }
    return functions[slot];
}

/* Calls slot's function as a CUresult CUDAAPI (*)PARAMS with ARGS. memcpy, not a cast, turns the data
 * pointer from dlsym into a function pointer without a type-punning warning. */
#define FORWARD(name, params, args)                                                                                   \
    do {                                                                                                              \
        CUresult rc_ = CUDA_SUCCESS;                                                                                  \
        void *p_ = function(SLOT_##name, &rc_);                                                                       \
        if (p_ == NULL) return rc_;                                                                                   \
        CUresult(CUDAAPI * fn_) params;                                                                               \
        memcpy(&fn_, &p_, sizeof fn_);                                                                                \
        return fn_ args;                                                                                              \
    } while (0)

CUresult CUDAAPI cuInit(unsigned int Flags) {
    FORWARD(cuInit, (unsigned int), (Flags));
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    FORWARD(cuDeviceGet, (CUdevice *, int), (device, ordinal));
}

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    FORWARD(cuDeviceGetAttribute, (int *, CUdevice_attribute, CUdevice), (pi, attrib, dev));
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    FORWARD(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice), (pctx, dev));
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
    FORWARD(cuDevicePrimaryCtxRelease, (CUdevice), (dev));
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
    FORWARD(cuCtxSetCurrent, (CUcontext), (ctx));
}

CUresult CUDAAPI cuCtxSynchronize(void) {
    FORWARD(cuCtxSynchronize, (void), ());
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
    FORWARD(cuMemAlloc, (CUdeviceptr *, size_t), (dptr, bytesize));
}

CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
    FORWARD(cuMemFree, (CUdeviceptr), (dptr));
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    FORWARD(cuMemcpyHtoD, (CUdeviceptr, const void *, size_t), (dstDevice, srcHost, ByteCount));
}

CUresult CUDAAPI cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    FORWARD(cuMemcpyDtoH, (void *, CUdeviceptr, size_t), (dstHost, srcDevice, ByteCount));
}

CUresult CUDAAPI cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    FORWARD(cuMemsetD8, (CUdeviceptr, unsigned char, size_t), (dstDevice, uc, N));
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
    FORWARD(cuMemsetD8Async, (CUdeviceptr, unsigned char, size_t, CUstream), (dstDevice, uc, N, hStream));
}

CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    FORWARD(cuMemHostAlloc, (void **, size_t, unsigned int), (pp, bytesize, Flags));
}

CUresult CUDAAPI cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    FORWARD(cuMemHostGetDevicePointer, (CUdeviceptr *, void *, unsigned int), (pdptr, p, Flags));
}

CUresult CUDAAPI cuMemFreeHost(void *p) {
    FORWARD(cuMemFreeHost, (void *), (p));
}

CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    FORWARD(cuStreamCreate, (CUstream *, unsigned int), (phStream, Flags));
}

CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
    FORWARD(cuStreamDestroy, (CUstream), (hStream));
}

CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
    FORWARD(cuStreamSynchronize, (CUstream), (hStream));
}

CUresult CUDAAPI cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    FORWARD(cuStreamWaitValue32, (CUstream, CUdeviceptr, cuuint32_t, unsigned int), (stream, addr, value, flags));
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    FORWARD(cuEventCreate, (CUevent *, unsigned int), (phEvent, Flags));
}

CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
    FORWARD(cuEventRecord, (CUevent, CUstream), (hEvent, hStream));
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
    FORWARD(cuEventSynchronize, (CUevent), (hEvent));
}

CUresult CUDAAPI cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    FORWARD(cuEventElapsedTime, (float *, CUevent, CUevent), (pMilliseconds, hStart, hEnd));
}

CUresult CUDAAPI cuEventDestroy(CUevent hEvent) {
    FORWARD(cuEventDestroy, (CUevent), (hEvent));
}

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    FORWARD(cuModuleLoadData, (CUmodule *, const void *), (module, image));
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    FORWARD(cuModuleGetFunction, (CUfunction *, CUmodule, const char *), (hfunc, hmod, name));
}

CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
    FORWARD(cuModuleUnload, (CUmodule), (hmod));
}

CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) {
    FORWARD(cuFuncSetCacheConfig, (CUfunction, CUfunc_cache), (hfunc, config));
}

CUresult CUDAAPI cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) {
    FORWARD(cuFuncSetAttribute, (CUfunction, CUfunction_attribute, int), (hfunc, attrib, value));
}

CUresult CUDAAPI cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
    FORWARD(cuFuncGetAttribute, (int *, CUfunction_attribute, CUfunction), (pi, attrib, hfunc));
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    FORWARD(cuLaunchKernel,
            (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
             unsigned int, CUstream, void **, void **),
            (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams,
             extra));
}

/* Without a driver there is no one to ask, so the reason the library did not load is the message for every
 * code; a driver missing only this entry point gets a generic text. */
CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
    CUresult rc = CUDA_SUCCESS;
    void *p = function(SLOT_cuGetErrorString, &rc);
    if (p == NULL) {
        if (pStr != NULL)
            *pStr = load_error[0] ? load_error : "unknown CUDA error (libcuda.so.1 has no cuGetErrorString)";
        return CUDA_SUCCESS;
    }
    CUresult(CUDAAPI * fn)(CUresult, const char **);
    memcpy(&fn, &p, sizeof fn);
    return fn(error, pStr);
}
