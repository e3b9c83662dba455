/* A CUDA driver emulator: the driver functions dmaload resolves
 * (crates/dmaload/src/sys/cuda/mod.rs), with their exact versioned names and
 * cuda.h prototypes, acting on host memory so every GPU code path can run
 * where there is no GPU. See README.md beside this file for what it models
 * (asynchrony, a link, a race detector, faults) and its settings.
 *
 * This file: the settings and faults, the shared state, the helpers every
 * entry point uses, and the entry points of errors, devices and contexts;
 * memory.c, copy.c and ipc.c hold the rest, emu.h what they share. */
#include "emu.h"

static const struct {
    CUresult code;
    const char *name, *text;
} ERRORS[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
    {CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "forward compatibility was attempted on non supported HW"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* ---- settings (read once, at cuInit) ------------------------------------ */

/* Device addresses: a non-canonical x86-64 range (bits 63..47 differ), so
 * dereferencing one on the host faults at once. */
#define DEVICE_BASE 0xd00d000000000000ull
#define DEVICE_SPAN (1ull << 40)

struct settings cfg;

/* Appends a line to DMALOAD_EMU_LOG, where set. Lock held. */
void log_line(const char *fmt, ...)
{
    if (!cfg.log)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(cfg.log, fmt, ap);
    va_end(ap);
    fflush(cfg.log);
}

/* ---- state -------------------------------------------------------------- */

/* The state the files share (emu.h says what each is), then this file's. */
pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
int initialised;
CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static struct context contexts[MAX_DEVICES];
struct allocation *allocations;
struct closed *closed_mappings;
struct stream *streams;
CUdeviceptr next_dptr[MAX_DEVICES];
CUresult lost;
unsigned transfers_running;

static __thread struct context *ctx_stack[64];
static __thread int ctx_depth;

void die(const char *fmt, ...)
{
    va_list args;
    va_start(args, fmt);
    fputs("cuda-emu: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    abort();
}

uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void sleep_until(uint64_t deadline)
{
    struct timespec ts = {(time_t)(deadline / 1000000000u), (long)(deadline % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static double env_double(const char *name, double fallback)
{
    const char *value = getenv(name);
    if (!value || !*value)
        return fallback;
    char *end;
    double parsed = strtod(value, &end);
    if (*end || parsed < 0)
        die("%s=%s is not a non-negative number", name, value);
    return parsed;
}

/* DMALOAD_EMU_FAULTS: see README.md for the grammar. */
static void parse_faults(void)
{
    const char *spec = getenv("DMALOAD_EMU_FAULTS");
    if (!spec || !*spec)
        return;
    char *copy = strdup(spec), *save = NULL;
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        unsigned long long bytes;
        int code = CUDA_ERROR_UNKNOWN, used = 0;
        if (sscanf(item, "lost=%llu%n", &bytes, &used) == 1 && !item[used]) {
            cfg.lost_after = bytes ? bytes : 1;
            cfg.lost_code = CUDA_ERROR_UNKNOWN;
            continue;
        }
        if (sscanf(item, "lost=%llu:%d%n", &bytes, &code, &used) == 2 && !item[used]) {
            cfg.lost_after = bytes ? bytes : 1;
            cfg.lost_code = code;
            continue;
        }
        if (cfg.nfaults == MAX_FAULTS)
            die("DMALOAD_EMU_FAULTS has more than %d faults", MAX_FAULTS);
        struct fault *f = &cfg.faults[cfg.nfaults];
        char action[32] = "";
        if (sscanf(item, "%47[A-Za-z0-9_]#%lu=%31s", f->symbol, &f->nth, action) != 3 || f->nth == 0)
            die("DMALOAD_EMU_FAULTS: cannot parse '%s' (see tests/cuda-emu/README.md)", item);
        if (!strcmp(f->symbol, "copy")) {
            if (!strcmp(action, "hang"))
                f->kind = FAULT_HANG;
            else if (!strcmp(action, "hold"))
                f->kind = FAULT_HOLD;
            else if (sscanf(action, "sticky:%d%n", &f->code, &used) == 1 && !action[used] && f->code)
                f->kind = FAULT_STICKY;
            else if (sscanf(action, "delay:%d%n", &f->code, &used) == 1 && !action[used] && f->code > 0)
                f->kind = FAULT_DELAY;
            else
                die("DMALOAD_EMU_FAULTS: '%s': copy#N takes hang, hold, sticky:CODE or delay:US", item);
        } else if (sscanf(action, "%d%n", &f->code, &used) == 1 && !action[used] && f->code) {
            f->kind = FAULT_RETURN;
        } else {
            die("DMALOAD_EMU_FAULTS: '%s': SYMBOL#N takes a nonzero CUresult", item);
        }
        cfg.nfaults++;
    }
    free(copy);
}

static void configure(void)
{
    cfg.devices = (int)env_double("DMALOAD_EMU_DEVICES", 1);
    if (cfg.devices > MAX_DEVICES)
        die("DMALOAD_EMU_DEVICES=%d: at most %d", cfg.devices, MAX_DEVICES);
    cfg.memory = (size_t)(env_double("DMALOAD_EMU_MEMORY_MIB", 16384) * (1 << 20));
    cfg.link_bytes_per_ns = env_double("DMALOAD_EMU_LINK_GIBS", 0) * (1ull << 30) / 1e9;
    cfg.copy_latency_ns = (uint64_t)(env_double("DMALOAD_EMU_COPY_LATENCY_US", 0) * 1000);
    cfg.pin_ns_per_page = (uint64_t)env_double("DMALOAD_EMU_PIN_NS_PER_PAGE", 0);
    cfg.strict = env_double("DMALOAD_EMU_STRICT", 0) != 0;
    const char *log = getenv("DMALOAD_EMU_LOG");
    if (log && *log && !(cfg.log = fopen(log, "ae")))
        die("DMALOAD_EMU_LOG=%s: cannot open it: %s", log, strerror(errno));
    parse_faults();
    for (int d = 0; d < MAX_DEVICES; d++) {
        contexts[d].device = d;
        next_dptr[d] = DEVICE_BASE + (CUdeviceptr)d * DEVICE_SPAN;
    }
}

/* Counts a call in `calls` (the entry point's own count) and returns the
 * code DMALOAD_EMU_FAULTS makes this call of `symbol` fail with, or 0.
 * Lock held. */
CUresult injected(const char *symbol, unsigned long *calls)
{
    unsigned long n = ++*calls;
    for (int i = 0; i < cfg.nfaults; i++)
        if (cfg.faults[i].kind == FAULT_RETURN && cfg.faults[i].nth == n && !strcmp(cfg.faults[i].symbol, symbol))
            return cfg.faults[i].code;
    return CUDA_SUCCESS;
}

/* The calling thread's current context, or NULL. */
struct context *current(void)
{
    return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
}

/* The code a call needing the current context fails with, or 0. */
CUresult check_current(void)
{
    struct context *ctx = current();
    if (!ctx || !ctx->retained)
        return CUDA_ERROR_INVALID_CONTEXT;
    return ctx->sticky;
}

/* ---- entry points ------------------------------------------------------- */

EXPORT CUresult cuGetErrorName(CUresult code, const char **name)
{
    for (size_t i = 0; i < sizeof ERRORS / sizeof *ERRORS; i++)
        if (ERRORS[i].code == code) {
            *name = ERRORS[i].name;
            return CUDA_SUCCESS;
        }
    *name = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult code, const char **text)
{
    for (size_t i = 0; i < sizeof ERRORS / sizeof *ERRORS; i++)
        if (ERRORS[i].code == code) {
            *text = ERRORS[i].text;
            return CUDA_SUCCESS;
        }
    *text = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 12040;
    return CUDA_SUCCESS;
}

static pthread_once_t configured = PTHREAD_ONCE_INIT;

EXPORT CUresult cuInit(unsigned flags)
{
    static unsigned long calls; /* counted as ENTER counts */
    pthread_once(&configured, configure);
    pthread_mutex_lock(&lock);
    CUresult code = injected("cuInit", &calls);
    if (!code && flags)
        code = CUDA_ERROR_INVALID_VALUE;
    if (!code && cfg.devices == 0)
        code = CUDA_ERROR_NO_DEVICE;
    if (!initialised) {
        init_result = code;
        initialised = !code;
    }
    RETURN(code);
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
    ENTER(cuDeviceGetCount);
    if (!count)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    *count = cfg.devices;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    ENTER(cuDeviceGet);
    if (!device)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0 || ordinal >= cfg.devices)
        RETURN(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice device)
{
    ENTER(cuDeviceGetName);
    if (!name || len <= 0)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (device < 0 || device >= cfg.devices)
        RETURN(CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "dmaload CUDA emulator");
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device)
{
    ENTER(cuDevicePrimaryCtxRetain);
    if (!ctx)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (device < 0 || device >= cfg.devices)
        RETURN(CUDA_ERROR_INVALID_DEVICE);
    contexts[device].retained++;
    *ctx = &contexts[device];
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device)
{
    ENTER(cuDevicePrimaryCtxRelease_v2);
    if (device < 0 || device >= cfg.devices)
        RETURN(CUDA_ERROR_INVALID_DEVICE);
    if (!contexts[device].retained)
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    contexts[device].retained--;
    RETURN(CUDA_SUCCESS);
}

static int valid_context(CUcontext ctx)
{
    return ctx >= contexts && ctx < contexts + cfg.devices && ctx->retained;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    ENTER(cuCtxGetCurrent);
    if (!ctx)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    *ctx = current();
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    ENTER(cuCtxSetCurrent);
    if (!ctx) { /* NULL unbinds: the stack loses its top */
        if (ctx_depth)
            ctx_depth--;
        RETURN(CUDA_SUCCESS);
    }
    if (!valid_context(ctx))
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    if (!ctx_depth)
        ctx_depth = 1;
    ctx_stack[ctx_depth - 1] = ctx;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    ENTER(cuCtxPushCurrent_v2);
    if (!valid_context(ctx))
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    if (ctx_depth == (int)(sizeof ctx_stack / sizeof *ctx_stack))
        RETURN(CUDA_ERROR_INVALID_VALUE);
    ctx_stack[ctx_depth++] = ctx;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    ENTER(cuCtxPopCurrent_v2);
    if (!ctx_depth)
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    struct context *top = ctx_stack[--ctx_depth];
    if (ctx)
        *ctx = top;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSynchronize(void)
{
    ENTER(cuCtxSynchronize);
    struct context *ctx = current();
    if (!ctx || !ctx->retained)
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    for (struct stream *s = streams; s; s = s->next_live)
        if (s->ctx == ctx)
            wait_stream(s, s->queued);
    RETURN(ctx->sticky);
}

