/* A CUDA driver emulator: the driver functions dmaload resolves
 * (crates/dmaload/src/sys/cuda.rs), with their exact versioned names and
 * cuda.h prototypes, acting on host memory so every GPU code path can run
 * where there is no GPU. See README.md beside this file for what it models
 * (asynchrony, a link, a race detector, faults) and its settings. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct context *CUcontext;
typedef struct stream *CUstream;
typedef struct event *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_MAP_FAILED = 205,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804,
    CUDA_ERROR_UNKNOWN = 999,
};

/* CUpointer_attribute and CUmemorytype values. */
enum { ATTR_MEMORY_TYPE = 2, ATTR_DEVICE_ORDINAL = 9, ATTR_RANGE_START = 11, ATTR_RANGE_SIZE = 12 };
enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2 };
/* CU_MEMHOSTREGISTER_READ_ONLY */
enum { MEMHOSTREGISTER_READ_ONLY = 0x08 };

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

#define MAX_DEVICES 8
#define MAX_FAULTS 32
#define PIECE (1u << 20) /* a copy advances over the link in pieces this big */
/* Device addresses: a non-canonical x86-64 range (bits 63..47 differ), so
 * dereferencing one on the host faults at once. */
#define DEVICE_BASE 0xd00d000000000000ull
#define DEVICE_SPAN (1ull << 40)

enum fault_kind { FAULT_RETURN, FAULT_STICKY, FAULT_HANG, FAULT_HOLD, FAULT_DELAY };

struct fault {
    enum fault_kind kind;
    char symbol[48]; /* FAULT_RETURN: the function; else "copy" */
    unsigned long nth;
    CUresult code; /* FAULT_DELAY: microseconds */
};

static struct {
    int devices;
    size_t memory; /* bytes per device */
    double link_bytes_per_ns; /* 0: unlimited */
    uint64_t copy_latency_ns, pin_ns_per_page;
    int strict;
    struct fault faults[MAX_FAULTS];
    int nfaults;
    uint64_t lost_after; /* bytes; 0: never */
    CUresult lost_code;
    FILE *log; /* DMALOAD_EMU_LOG: pinning and copies, one line each */
} cfg;

/* Appends a line to DMALOAD_EMU_LOG, where set. Lock held. */
static void log_line(const char *fmt, ...)
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

struct context {
    int device, retained;
    CUresult sticky; /* a device-side error: every later call returns it */
};

struct op {
    struct op *next;
    unsigned char *dst;
    const unsigned char *src;
    size_t len;
    uint64_t hash;
    struct registration *reg; /* pinned source, or NULL for driver staging */
    unsigned char *staged; /* the driver's own copy of a pageable source */
    struct allocation *alloc;
    enum fault_kind fault; /* FAULT_RETURN: none */
    CUresult fault_code; /* FAULT_DELAY: microseconds */
};

#define STREAM_MAGIC 0x5354524d
#define EVENT_MAGIC 0x45564e54
#define DEAD_MAGIC 0xdead

struct stream {
    unsigned magic;
    struct context *ctx;
    struct op *head, *tail;
    uint64_t queued, done; /* ops queued and completed so far */
    int waited, destroyed;
    pthread_t worker;
    struct stream *next_live;
};

struct event {
    unsigned magic;
    struct context *ctx;
    struct stream *stream; /* the last record, or NULL */
    uint64_t target; /* complete once stream->done reaches it */
};

/* Device memory: a memfd of its own, mapped shared, so another process
 * can map the same bytes (cuIpcOpenMemHandle). */
struct allocation {
    struct allocation *next;
    CUdeviceptr dptr;
    size_t size;
    int device;
    unsigned char *host;
    unsigned pending;
    int fd; /* the memfd (-1 in an importer, which maps it and closes it) */
    ino_t inode; /* the memfd's, named by its IPC handle */
    pid_t exporter; /* an opened IPC handle: the process that allocated it; 0 for our own memory */
    unsigned opens; /* an opened IPC handle: cuIpcOpenMemHandle calls not yet closed */
};

/* What cuIpcGetMemHandle writes in the 64-byte CUipcMemHandle: enough
 * for another process of the same user to open the memfd through
 * /proc/PID/fd/FD and check it is still that allocation. */
#define IPC_MAGIC 0x50494c44u /* "DLIP" */
struct ipc_wire {
    uint32_t magic, uid;
    int32_t pid, fd;
    uint64_t inode, size;
    int32_t device, reserved;
};
typedef struct {
    char reserved[64];
} CUipcMemHandle;
_Static_assert(sizeof(struct ipc_wire) <= sizeof(CUipcMemHandle), "the IPC handle is 64 bytes");

/* Device addresses of IPC mappings already closed: strict mode names a
 * copy into one (addresses are never reused, so they stay unknown). */
struct closed {
    struct closed *next;
    CUdeviceptr dptr;
    size_t size;
};

struct registration {
    struct registration *next;
    unsigned char *start;
    size_t len;
    unsigned pending;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int initialised; /* 0: cuInit not called or failed */
static CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
static struct context contexts[MAX_DEVICES];
static struct allocation *allocations;
static struct registration *registrations;
static struct closed *closed_mappings;
static struct stream *streams;
static size_t allocated[MAX_DEVICES];
static CUdeviceptr next_dptr[MAX_DEVICES];
static uint64_t link_free_at[MAX_DEVICES]; /* ns: when the link is next idle */
static uint64_t bytes_copied;
static CUresult lost; /* the device fell off the bus: every call returns it */
/* Copies moving bytes now, outside the lock: a call that reports the lost
 * device waits for them, as a driver reports it once the device's copy
 * engines are stopped (else a caller told of the loss would unmap a slot
 * a copy is still reading). */
static unsigned transfers_running;
static unsigned long calls[64], copies; /* per-symbol call counts (see count_call) */

static __thread struct context *ctx_stack[64];
static __thread int ctx_depth;

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list args;
    va_start(args, fmt);
    fputs("cuda-emu: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    abort();
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t deadline)
{
    struct timespec ts = {(time_t)(deadline / 1000000000u), (long)(deadline % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* A 64-bit hash of the bytes, eight at a time (fast enough to run twice
 * per copy in strict mode). */
static uint64_t hash_bytes(const unsigned char *p, size_t len)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    for (; i < len; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
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

/* Counts a call of `symbol` (an index into `calls`) and returns the code
 * DMALOAD_EMU_FAULTS makes this call fail with, or 0. Lock held. */
static CUresult injected(const char *symbol, int index)
{
    unsigned long n = ++calls[index];
    for (int i = 0; i < cfg.nfaults; i++)
        if (cfg.faults[i].kind == FAULT_RETURN && cfg.faults[i].nth == n && !strcmp(cfg.faults[i].symbol, symbol))
            return cfg.faults[i].code;
    return CUDA_SUCCESS;
}

/* Every entry point but the version and error-text lookups starts here:
 * counts the call, applies injected faults, a lost device, and cuInit. */
#define ENTER(name)                                                                                                    \
    pthread_mutex_lock(&lock);                                                                                         \
    do {                                                                                                               \
        CUresult early_ = injected(#name, __COUNTER__);                                                                \
        if (!early_ && lost) {                                                                                         \
            while (transfers_running)                                                                                  \
                pthread_cond_wait(&changed, &lock);                                                                    \
            early_ = lost;                                                                                             \
        }                                                                                                              \
        if (!early_ && !initialised)                                                                                   \
            early_ = init_result;                                                                                      \
        if (early_) {                                                                                                  \
            pthread_mutex_unlock(&lock);                                                                               \
            return early_;                                                                                             \
        }                                                                                                              \
    } while (0)

#define RETURN(code)                                                                                                   \
    do {                                                                                                               \
        CUresult result_ = (code);                                                                                     \
        pthread_mutex_unlock(&lock);                                                                                   \
        return result_;                                                                                                \
    } while (0)

/* The calling thread's current context, or NULL. */
static struct context *current(void)
{
    return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
}

/* The code a call needing the current context fails with, or 0. */
static CUresult check_current(void)
{
    struct context *ctx = current();
    if (!ctx || !ctx->retained)
        return CUDA_ERROR_INVALID_CONTEXT;
    return ctx->sticky;
}

static struct allocation *find_allocation(CUdeviceptr p)
{
    for (struct allocation *a = allocations; a; a = a->next)
        if (p >= a->dptr && p - a->dptr < a->size)
            return a;
    return NULL;
}

static struct registration *find_registration(const void *p, size_t len)
{
    const unsigned char *b = p;
    for (struct registration *r = registrations; r; r = r->next)
        if (b >= r->start && (size_t)(b - r->start) < r->len && len <= r->len - (size_t)(b - r->start))
            return r;
    return NULL;
}

/* ---- the copy engine ---------------------------------------------------- */

/* Moves one op's bytes over the modelled link, in pieces, without the lock. */
static void transfer(struct context *ctx, struct op *op)
{
    uint64_t latency = cfg.copy_latency_ns;
    if (op->fault == FAULT_DELAY)
        latency += (uint64_t)op->fault_code * 1000;
    if (latency)
        sleep_until(now_ns() + latency);
    for (size_t off = 0; off < op->len; off += PIECE) {
        /* A lost device's copy engines stop mid-copy. */
        if (__atomic_load_n(&lost, __ATOMIC_RELAXED))
            return;
        size_t piece = op->len - off < PIECE ? op->len - off : PIECE;
        uint64_t end = 0;
        if (cfg.link_bytes_per_ns > 0) {
            /* The piece's turn on the link; the host's memcpy runs inside
             * it, so only the modelled time counts. */
            pthread_mutex_lock(&lock);
            uint64_t begin = now_ns();
            if (link_free_at[ctx->device] > begin)
                begin = link_free_at[ctx->device];
            end = begin + (uint64_t)((double)piece / cfg.link_bytes_per_ns);
            link_free_at[ctx->device] = end;
            pthread_mutex_unlock(&lock);
        }
        memcpy(op->dst + off, op->src + off, piece);
        if (end)
            sleep_until(end);
    }
}

static void *stream_worker(void *arg)
{
    struct stream *s = arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!s->head && !s->destroyed)
            pthread_cond_wait(&changed, &lock);
        if (!s->head)
            break;
        struct op *op = s->head;
        while ((op->fault == FAULT_HOLD && !s->waited) || op->fault == FAULT_HANG)
            pthread_cond_wait(&changed, &lock);
        int skip = s->ctx->sticky || lost;
        if (op->fault == FAULT_STICKY && !skip) {
            s->ctx->sticky = op->fault_code;
            skip = 1;
        }
        if (!skip) {
            transfers_running++;
            pthread_mutex_unlock(&lock);
            transfer(s->ctx, op);
            pthread_mutex_lock(&lock);
            transfers_running--;
            if (cfg.strict && hash_bytes(op->src, op->len) != op->hash)
                die("strict: the %zu-byte copy source at %p..%p (a pinned slot) was rewritten while its copy "
                    "to %#llx was pending: its event had not completed",
                    op->len, (void *)op->src, (void *)(op->src + op->len),
                    op->alloc->dptr + (CUdeviceptr)(op->dst - op->alloc->host));
            bytes_copied += op->len;
            if (cfg.lost_after && bytes_copied >= cfg.lost_after && !lost)
                __atomic_store_n(&lost, cfg.lost_code, __ATOMIC_RELAXED);
        }
        if (op->reg)
            op->reg->pending--;
        op->alloc->pending--;
        free(op->staged);
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        free(op);
        s->done++;
        pthread_cond_broadcast(&changed);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

/* Waits (lock held) until `s` has done its first `target` ops. */
static void wait_stream(struct stream *s, uint64_t target)
{
    s->waited = 1;
    pthread_cond_broadcast(&changed);
    while (s->done < target)
        pthread_cond_wait(&changed, &lock);
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
    pthread_once(&configured, configure);
    pthread_mutex_lock(&lock);
    CUresult code = injected("cuInit", __COUNTER__);
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

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    ENTER(cuMemGetInfo_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!free_bytes || !total)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    *total = cfg.memory;
    *free_bytes = cfg.memory - allocated[current()->device];
    RETURN(CUDA_SUCCESS);
}

/* Records `host` as `size` bytes of device memory at the next device
 * address of `device`. Lock held. */
static struct allocation *add_allocation(int device, size_t size, unsigned char *host)
{
    struct allocation *a = calloc(1, sizeof *a);
    a->dptr = next_dptr[device];
    a->size = size;
    a->device = device;
    a->host = host;
    a->fd = -1;
    a->next = allocations;
    allocations = a;
    /* Addresses are never reused, so a stale pointer stays unknown. */
    next_dptr[device] += (size + 511 + 0xfffff) & ~(CUdeviceptr)0xfffff;
    return a;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    ENTER(cuMemAlloc_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!dptr || !size)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    int device = current()->device;
    size_t rounded = (size + 511) & ~(size_t)511; /* the driver's 512-byte granule */
    if (rounded > cfg.memory - allocated[device])
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    /* Shared memory, so cuIpcOpenMemHandle in another process maps the
     * same bytes. Backed as copies first write it, not here: a device
     * allocates in a few milliseconds whatever the size, while populating
     * host memory costs about a second a GiB on a small VM (which a load
     * would be charged as its set-up). The page faults of the copies run
     * inside the modelled link's time. */
    char name[32];
    snprintf(name, sizeof name, "cuda-emu cuda:%d", device);
    int fd = memfd_create(name, MFD_CLOEXEC);
    struct stat st;
    if (fd < 0 || ftruncate(fd, (off_t)rounded) || fstat(fd, &st)) {
        if (fd >= 0)
            close(fd);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    void *host = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (host == MAP_FAILED) {
        close(fd);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct allocation *a = add_allocation(device, size, host);
    a->fd = fd;
    a->inode = st.st_ino;
    allocated[device] += rounded;
    *dptr = a->dptr;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ENTER(cuMemFree_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct allocation **link = &allocations;
    while (*link && (*link)->dptr != dptr)
        link = &(*link)->next;
    struct allocation *a = *link;
    if (!a || a->exporter) /* an opened IPC handle is closed, not freed */
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (a->pending) {
        if (cfg.strict)
            die("strict: cuMemFree of device memory %#llx..%#llx with %u copies into it pending", a->dptr,
                a->dptr + a->size, a->pending);
        for (struct stream *s = streams; s; s = s->next_live)
            wait_stream(s, s->queued);
    }
    *link = a->next;
    allocated[a->device] -= (a->size + 511) & ~(size_t)511;
    munmap(a->host, (a->size + 511) & ~(size_t)511);
    close(a->fd); /* an importer's mapping keeps the memory until it closes */
    free(a);
    RETURN(CUDA_SUCCESS);
}

/* The host bytes behind device span dptr..dptr+len, or NULL. `op` names
 * the call for strict mode, which aborts on an IPC mapping already closed. */
static unsigned char *device_bytes(const char *op, CUdeviceptr dptr, size_t len, struct allocation **owner)
{
    struct allocation *a = find_allocation(dptr);
    if (!a && cfg.strict)
        for (struct closed *c = closed_mappings; c; c = c->next)
            if (dptr >= c->dptr && dptr - c->dptr < c->size)
                die("strict: %s at %#llx, in the IPC mapping %#llx..%#llx that cuIpcCloseMemHandle closed", op,
                    dptr, c->dptr, c->dptr + c->size);
    if (!a || len > a->size - (dptr - a->dptr))
        return NULL;
    if (owner)
        *owner = a;
    return a->host + (dptr - a->dptr);
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dptr, unsigned char value, size_t len)
{
    ENTER(cuMemsetD8_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    unsigned char *bytes = device_bytes("cuMemsetD8", dptr, len, NULL);
    if (!bytes)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    memset(bytes, value, len);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len)
{
    ENTER(cuMemcpyDtoH_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    unsigned char *bytes = device_bytes("cuMemcpyDtoH", src, len, NULL);
    if (!bytes || !dst)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    memcpy(dst, bytes, len);
    RETURN(CUDA_SUCCESS);
}

static int valid_stream(CUstream s)
{
    for (struct stream *live = streams; live; live = live->next_live)
        if (live == s)
            return s->magic == STREAM_MAGIC;
    return 0;
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, CUstream s)
{
    ENTER(cuMemcpyHtoDAsync_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!s || !valid_stream(s)) /* dmaload never copies on the legacy stream */
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (s->ctx->sticky)
        RETURN(s->ctx->sticky);
    struct allocation *alloc;
    unsigned char *bytes = device_bytes("cuMemcpyHtoDAsync", dst, len, &alloc);
    if (!bytes || !src || alloc->device != s->ctx->device)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct op *op = calloc(1, sizeof *op);
    op->dst = bytes;
    op->len = len;
    op->alloc = alloc;
    op->reg = find_registration(src, len);
    if (!op->reg && cfg.strict)
        die("strict: cuMemcpyHtoDAsync of %zu bytes to %#llx from pageable host memory %p..%p (no "
            "cuMemHostRegister range holds it): the driver would stage it and copy at a fraction of the link",
            len, dst, src, (const void *)((const unsigned char *)src + len));
    log_line("copy %p %zu\n", src, len);
    if (op->reg) {
        op->src = src;
        op->reg->pending++;
    } else {
        /* Pageable: the driver stages the bytes before returning. */
        op->staged = malloc(len ? len : 1);
        memcpy(op->staged, src, len);
        op->src = op->staged;
    }
    op->hash = cfg.strict ? hash_bytes(op->src, len) : 0;
    op->fault = FAULT_RETURN;
    unsigned long n = ++copies;
    for (int i = 0; i < cfg.nfaults; i++)
        if (cfg.faults[i].kind != FAULT_RETURN && cfg.faults[i].nth == n) {
            op->fault = cfg.faults[i].kind;
            op->fault_code = cfg.faults[i].code;
        }
    alloc->pending++;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->queued++;
    pthread_cond_broadcast(&changed);
    if (!op->reg) {
        /* Pageable: returns once the stream has taken the staged bytes. */
        uint64_t target = s->queued;
        while (s->done < target)
            pthread_cond_wait(&changed, &lock);
    }
    RETURN(CUDA_SUCCESS);
}

/* Whether a registration holds any of `len` bytes at `start`. Lock held. */
static int overlaps_registration(const unsigned char *start, size_t len)
{
    for (struct registration *r = registrations; r; r = r->next)
        if (start < r->start + r->len && r->start < start + len)
            return 1;
    return 0;
}

EXPORT CUresult cuMemHostRegister_v2(void *ptr, size_t len, unsigned flags)
{
    ENTER(cuMemHostRegister_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    long page = sysconf(_SC_PAGESIZE);
    if (!ptr || !len)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    unsigned char *start = ptr;
    if (overlaps_registration(start, len))
        RETURN(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    /* Pinning faults every page in, at a cost per page, as the driver's
     * pin_user_pages does: writable unless the registration is read-only,
     * so memory registered fresh is allocated here, not at its first write
     * (a read would only map the shared zero page). Without the lock, as
     * pinning one range does not stop the copies of another. */
    pthread_mutex_unlock(&lock);
    uintptr_t first = (uintptr_t)start & ~(uintptr_t)(page - 1);
    size_t span = (size_t)((uintptr_t)start + len - first);
    size_t pages = (span + (size_t)page - 1) / (size_t)page;
    int advice = flags & MEMHOSTREGISTER_READ_ONLY ? MADV_POPULATE_READ : MADV_POPULATE_WRITE;
    if (madvise((void *)first, pages * (size_t)page, advice)) {
        if (errno != EINVAL) { /* not mapped (or not writable), or no memory left */
            CUresult refused = errno == ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
            pthread_mutex_lock(&lock);
            RETURN(refused);
        }
        /* A kernel before 5.14: touching is the closest there is. */
        for (size_t i = 0; i < pages; i++)
            (void)*(volatile unsigned char *)(first + i * (size_t)page);
    }
    if (cfg.pin_ns_per_page)
        sleep_until(now_ns() + pages * cfg.pin_ns_per_page);
    pthread_mutex_lock(&lock);
    if (overlaps_registration(start, len)) /* registered meanwhile by another thread */
        RETURN(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    struct registration *r = calloc(1, sizeof *r);
    r->start = start;
    r->len = len;
    r->next = registrations;
    registrations = r;
    log_line("register %p %zu\n", ptr, len);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostUnregister(void *ptr)
{
    ENTER(cuMemHostUnregister);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct registration **link = &registrations;
    while (*link && (*link)->start != ptr)
        link = &(*link)->next;
    struct registration *r = *link;
    if (!r)
        RETURN(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    if (r->pending) {
        if (cfg.strict)
            die("strict: cuMemHostUnregister of the pinned slot %p..%p with %u copies from it pending", r->start,
                r->start + r->len, r->pending);
        for (struct stream *s = streams; s; s = s->next_live)
            wait_stream(s, s->queued);
    }
    *link = r->next;
    log_line("unregister %p %zu\n", r->start, r->len);
    free(r);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuPointerGetAttribute(void *data, unsigned attribute, CUdeviceptr ptr)
{
    ENTER(cuPointerGetAttribute);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!data)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct allocation *a = find_allocation(ptr);
    if (a) {
        switch (attribute) {
        case ATTR_MEMORY_TYPE: *(unsigned *)data = MEMORYTYPE_DEVICE; RETURN(CUDA_SUCCESS);
        case ATTR_DEVICE_ORDINAL: *(int *)data = a->device; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_START: *(CUdeviceptr *)data = a->dptr; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_SIZE: *(size_t *)data = a->size; RETURN(CUDA_SUCCESS);
        default: RETURN(CUDA_ERROR_INVALID_VALUE);
        }
    }
    struct registration *r = find_registration((const void *)(uintptr_t)ptr, 1);
    if (r) {
        switch (attribute) {
        case ATTR_MEMORY_TYPE: *(unsigned *)data = MEMORYTYPE_HOST; RETURN(CUDA_SUCCESS);
        case ATTR_DEVICE_ORDINAL: *(int *)data = 0; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_START: *(CUdeviceptr *)data = (CUdeviceptr)(uintptr_t)r->start; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_SIZE: *(size_t *)data = r->len; RETURN(CUDA_SUCCESS);
        default: RETURN(CUDA_ERROR_INVALID_VALUE);
        }
    }
    RETURN(CUDA_ERROR_INVALID_VALUE);
}

EXPORT CUresult cuStreamCreate(CUstream *out, unsigned flags)
{
    ENTER(cuStreamCreate);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!out || flags > 1)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct stream *s = calloc(1, sizeof *s);
    s->magic = STREAM_MAGIC;
    s->ctx = current();
    if (pthread_create(&s->worker, NULL, stream_worker, s)) {
        free(s);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    s->next_live = streams;
    streams = s;
    *out = s;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamSynchronize(CUstream s)
{
    ENTER(cuStreamSynchronize);
    if (!valid_stream(s))
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    wait_stream(s, s->queued);
    RETURN(s->ctx->sticky);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
    ENTER(cuStreamDestroy_v2);
    if (!valid_stream(s))
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    /* Like the driver, returns at once; queued work still completes (a
     * hung copy keeps its worker). The record stays for events on it. */
    s->destroyed = 1;
    s->magic = DEAD_MAGIC;
    pthread_cond_broadcast(&changed);
    pthread_detach(s->worker);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventCreate(CUevent *out, unsigned flags)
{
    ENTER(cuEventCreate);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!out || flags > 0xf)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    e->ctx = current();
    *out = e;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventRecord(CUevent e, CUstream s)
{
    ENTER(cuEventRecord);
    if (!e || e->magic != EVENT_MAGIC || !s || !valid_stream(s) || s->ctx != e->ctx)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (s->ctx->sticky)
        RETURN(s->ctx->sticky);
    e->stream = s;
    e->target = s->queued;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventQuery(CUevent e)
{
    ENTER(cuEventQuery);
    if (!e || e->magic != EVENT_MAGIC)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (e->ctx->sticky)
        RETURN(e->ctx->sticky);
    if (!e->stream || e->stream->done >= e->target)
        RETURN(CUDA_SUCCESS);
    /* Asking is waiting (a poller with a deadline): a held copy runs. */
    e->stream->waited = 1;
    pthread_cond_broadcast(&changed);
    RETURN(CUDA_ERROR_NOT_READY);
}

EXPORT CUresult cuEventSynchronize(CUevent e)
{
    ENTER(cuEventSynchronize);
    if (!e || e->magic != EVENT_MAGIC)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (e->stream)
        wait_stream(e->stream, e->target);
    RETURN(e->ctx->sticky);
}

EXPORT CUresult cuEventDestroy_v2(CUevent e)
{
    ENTER(cuEventDestroy_v2);
    if (!e || e->magic != EVENT_MAGIC)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    e->magic = DEAD_MAGIC;
    free(e);
    RETURN(CUDA_SUCCESS);
}

/* ---- IPC: device memory shared between processes ----------------------- */

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    ENTER(cuIpcGetMemHandle);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct allocation *a = find_allocation(dptr);
    /* Like the driver: the base of a cuMemAlloc allocation of this process. */
    if (!handle || !a || a->dptr != dptr || a->exporter)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct ipc_wire wire = {IPC_MAGIC, (uint32_t)getuid(), (int32_t)getpid(), a->fd, (uint64_t)a->inode,
                            (uint64_t)a->size, a->device, 0};
    memset(handle, 0, sizeof *handle);
    memcpy(handle, &wire, sizeof wire);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned flags)
{
    ENTER(cuIpcOpenMemHandle_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct ipc_wire wire;
    memcpy(&wire, &handle, sizeof wire);
    if (!pdptr || flags > 1 || wire.magic != IPC_MAGIC)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (wire.pid == (int32_t)getpid()) /* the driver refuses a process its own memory */
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    /* No peer memory: the handle's device must be the current context's. */
    if (wire.device != current()->device)
        RETURN(CUDA_ERROR_INVALID_DEVICE);
    /* Opened again while open: the same address, counted (as the driver). */
    for (struct allocation *a = allocations; a; a = a->next)
        if (a->exporter == wire.pid && a->inode == (ino_t)wire.inode) {
            a->opens++;
            *pdptr = a->dptr;
            RETURN(CUDA_SUCCESS);
        }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", wire.pid, wire.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) /* another user's process, or the exporter is gone */
        RETURN(errno == EACCES || errno == EPERM ? CUDA_ERROR_NOT_PERMITTED : CUDA_ERROR_INVALID_HANDLE);
    /* The fd number may have been reused since: it must be that memfd. */
    struct stat st;
    size_t rounded = (wire.size + 511) & ~(uint64_t)511;
    if (fstat(fd, &st) || st.st_ino != (ino_t)wire.inode || (uint64_t)st.st_size != rounded) {
        close(fd);
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    }
    /* Backed as copies first write it, as in the exporter. */
    void *host = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (host == MAP_FAILED)
        RETURN(CUDA_ERROR_MAP_FAILED);
    struct allocation *a = add_allocation(wire.device, wire.size, host);
    a->inode = (ino_t)wire.inode;
    a->exporter = wire.pid;
    a->opens = 1;
    *pdptr = a->dptr;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    ENTER(cuIpcCloseMemHandle);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct allocation **link = &allocations;
    while (*link && !((*link)->dptr == dptr && (*link)->exporter))
        link = &(*link)->next;
    struct allocation *a = *link;
    if (!a)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (--a->opens)
        RETURN(CUDA_SUCCESS);
    if (a->pending) {
        if (cfg.strict)
            die("strict: cuIpcCloseMemHandle of %#llx..%#llx with %u copies into it pending", a->dptr,
                a->dptr + a->size, a->pending);
        for (struct stream *s = streams; s; s = s->next_live)
            wait_stream(s, s->queued);
    }
    *link = a->next;
    munmap(a->host, (a->size + 511) & ~(size_t)511);
    struct closed *c = calloc(1, sizeof *c);
    c->dptr = a->dptr;
    c->size = a->size;
    c->next = closed_mappings;
    closed_mappings = c;
    free(a);
    RETURN(CUDA_SUCCESS);
}

/* `calls` has a slot per ENTER site (__COUNTER__): make sure it is enough. */
_Static_assert(__COUNTER__ < (int)(sizeof calls / sizeof *calls), "calls[] too small");
